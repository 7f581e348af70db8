"""KL-coefficient controllers for the in-reward KL penalty: fixed, and adaptive toward a target KL.

A pipeline keeps one controller, reads `.value` as the coefficient for `kl_penalized_rewards`, and
calls `.update(current_kl, n_steps)` once per step with the batch's mean KL. `KL_CONTROLLERS` is the
only list of valid controller names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from roll_backend.algorithms.registry import lookup

ADAPTIVE_ERROR_CLIP = 0.2  # bound on the proportional error per update (Ziegler et al. 2019)


class KLController(Protocol):
    """The coefficient `value` and how it reacts to the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """A constant coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. 2019 ("Fine-tuning LMs from human preferences", eq. 2).

    error = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon, so the coefficient
    grows while the KL is above target and shrinks below it, by at most 20% per `horizon` steps.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if not target_kl > 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0, got target_kl={target_kl}.")
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0 steps, got horizon={horizon}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon


def _fixed(kl_coef: float, target_kl: float | None, horizon: int | None) -> KLController:
    return FixedKLController(kl_coef)


def _adaptive(kl_coef: float, target_kl: float | None, horizon: int | None) -> KLController:
    if target_kl is None or horizon is None:
        raise ValueError(
            f"the adaptive KL controller needs target_kl and horizon; got target_kl={target_kl}, horizon={horizon}."
        )
    return AdaptiveKLController(kl_coef, target_kl, horizon)


KL_CONTROLLERS: dict[str, Callable[[float, float | None, int | None], KLController]] = {
    "fixed": _fixed,
    "adaptive": _adaptive,
}
KL_CONTROLLER_NAMES: tuple[str, ...] = tuple(KL_CONTROLLERS)


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """A new controller of `kind` ('fixed' or 'adaptive') starting at `kl_coef`; ValueError for unknown kinds."""
    return lookup(KL_CONTROLLERS, "KL controller", kind)(kl_coef, target_kl, horizon)
