"""Fixed and adaptive KL-coefficient controllers."""

import pytest

from roll_backend.algorithms import AdaptiveKLController, FixedKLController, make_kl_controller


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(current_kl=3.0, n_steps=100)
    assert controller.value == 0.05


def test_adaptive_controller_moves_toward_target_with_clipped_error():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    controller.update(current_kl=0.1, n_steps=10)  # error 1.0 clipped to 0.2: x 1.02
    assert controller.value == pytest.approx(0.102)
    controller.update(current_kl=0.0, n_steps=10)  # error -1.0 clipped to -0.2: x 0.98
    assert controller.value == pytest.approx(0.102 * 0.98)
    controller.update(current_kl=0.055, n_steps=50)  # error 0.1: x 1.05
    assert controller.value == pytest.approx(0.102 * 0.98 * 1.05)


def test_make_kl_controller_by_name():
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    adaptive = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.1, 0.05, 100)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_kl": None, "horizon": 100}, "needs target_kl and horizon"),
        ({"target_kl": 0.05, "horizon": 0}, "horizon > 0"),
        ({"target_kl": 0.0, "horizon": 10}, "target_kl > 0"),
    ],
)
def test_adaptive_controller_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_kl_controller("adaptive", 0.1, **kwargs)


def test_unknown_controller_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        make_kl_controller("pid", 0.1)
    assert str(err.value) == "unknown KL controller 'pid'; known: fixed, adaptive."
