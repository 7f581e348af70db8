"""KL estimators (values, clamps, straight-through gradient) and the KL-penalised reward."""

import math

import pytest
import torch

from roll_backend.algorithms import KL_ESTIMATOR_NAMES, get_kl_estimator, kl_estimate, kl_penalized_rewards

# d = logp - ref_logp. -3 and 15 trip only the value clamp of k3 (e^3 - 4 = 16.1, e^-15 + 14 = 14);
# +-25 trip the log-ratio clamp at 20 as well.
D = [0.5, -0.3, 0.0, -3.0, 15.0, 25.0, -25.0]
REF = torch.full((1, len(D)), -1.0)


def logp_for(d=D):
    return (REF + torch.tensor([d])).requires_grad_()


def k3(d):
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


def k3_grad(d):
    x = -d
    if abs(x) > 20 or abs(math.exp(x) - x - 1) > 10:
        return 0.0  # a clamp is active
    return 1.0 - math.exp(x)


@pytest.mark.parametrize(
    "kind, value, grad",
    [
        ("k1", lambda d: d, lambda d: 1.0),
        ("abs", abs, lambda d: math.copysign(1.0, d) if d else 0.0),
        ("k2", lambda d: 0.5 * d * d, lambda d: d),
        ("k3", k3, k3_grad),
        ("k3+", k3, lambda d: d),
    ],
)
def test_kl_value_and_gradient(kind, value, grad):
    logp = logp_for()
    kl = kl_estimate(logp, REF, kind)
    kl.sum().backward()
    assert kl.detach()[0].tolist() == pytest.approx([value(d) for d in D], rel=1e-5, abs=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([grad(d) for d in D], rel=1e-5, abs=1e-6)


def test_k3_gradient_is_zero_where_clamps_are_active():
    logp = logp_for()
    kl_estimate(logp, REF, "k3").sum().backward()
    assert logp.grad[0, 3:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert kl_estimate(logp, REF, "k3")[0, 3:].tolist() == [10.0, 10.0, 10.0, 10.0]


@pytest.mark.parametrize(
    "alias, canonical", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+")]
)
def test_aliases_give_the_canonical_estimator(alias, canonical):
    assert get_kl_estimator(alias) is get_kl_estimator(canonical)


def test_unknown_kl_estimator_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        kl_estimate(REF, REF, "k4")
    assert str(err.value) == f"unknown KL estimator 'k4'; known: {', '.join(KL_ESTIMATOR_NAMES)}."
    for name in ("k1", "abs", "k2", "k3", "k3+", "kl", "mse", "low_var_kl"):
        assert name in KL_ESTIMATOR_NAMES


SCORES = torch.tensor([[0.0, 0.0, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5]])
REF_LOGP = torch.tensor([[-1.5, -1.0, -0.5]])  # d = [0.5, -1, 0]


def test_kl_penalized_rewards_subtract_coef_times_log_ratio():
    assert kl_penalized_rewards(SCORES, OLD, REF_LOGP, 0.1).tolist() == [pytest.approx([-0.05, 0.1, 1.0])]


def test_kl_penalized_rewards_with_estimator_and_mask():
    rewards = kl_penalized_rewards(SCORES, OLD, REF_LOGP, 0.1, kind="k2")
    assert rewards.tolist() == [pytest.approx([-0.0125, -0.05, 1.0])]
    old = OLD.clone()
    old[0, 1] = float("nan")
    masked = kl_penalized_rewards(SCORES, old, REF_LOGP, 0.1, mask=torch.tensor([[1.0, 0.0, 1.0]]))
    assert masked.tolist() == [pytest.approx([-0.05, 0.0, 1.0])]
