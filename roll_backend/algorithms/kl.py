"""KL estimators between the policy and the reference policy, and the KL-penalised token reward.

Per-token estimators of KL(pi || pi_ref) from log-probabilities of the sampled tokens
(J. Schulman, "Approximating KL divergence", 2020). `KL_ESTIMATORS` is the only list of valid names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll_backend.algorithms.registry import lookup
from roll_backend.algorithms.stats import zero_outside_mask

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

K3_LOG_RATIO_CLAMP = 20.0  # bound on log(pi_ref / pi) before exp, so exp never overflows float32
K3_VALUE_CLAMP = 10.0  # bound on the k3 value itself; gradients are 0 where either clamp is active


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref: unbiased, high variance, can be negative."""
    return logp - ref_logp


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|."""
    return (logp - ref_logp).abs()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log pi_ref)^2: biased, low variance; its gradient is the true KL gradient."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1 with r = pi_ref / pi: unbiased, non-negative; departs by clamping log r to
    [-20, 20] and the value to [-10, 10] (for stability, as the reference trainer does)."""
    log_ratio = torch.clamp(ref_logp - logp, min=-K3_LOG_RATIO_CLAMP, max=K3_LOG_RATIO_CLAMP)
    k3 = torch.exp(log_ratio) - log_ratio - 1
    return torch.clamp(k3, min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)


def kl_k3_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3+: the value of k3 with the gradient of k2 (straight-through), an unbiased value with an
    unbiased KL gradient."""
    k2 = kl_k2(logp, ref_logp)
    return k2 - k2.detach() + kl_k3(logp, ref_logp).detach()


KL_ESTIMATORS: dict[str, KLFn] = {
    "k1": kl_k1,
    "kl": kl_k1,
    "abs": kl_abs,
    "k2": kl_k2,
    "mse": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
    "k3+": kl_k3_plus,
    "low_var_kl+": kl_k3_plus,
}
KL_ESTIMATOR_NAMES: tuple[str, ...] = tuple(KL_ESTIMATORS)


def get_kl_estimator(name: str) -> KLFn:
    """The estimator registered as `name` (canonical k1, abs, k2, k3, k3+ or an alias); ValueError otherwise."""
    return lookup(KL_ESTIMATORS, "KL estimator", name)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate [B, T] from `logp`, `ref_logp` [B, T] float; no mask applied.

    kind: k1 (alias kl), abs, k2 (alias mse), k3 (alias low_var_kl), k3+ (alias low_var_kl+).
    """
    return get_kl_estimator(kind)(logp, ref_logp)


def kl_penalized_rewards(
    scores: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kl_coef: float,
    *,
    kind: str = "k1",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token rewards with an in-reward KL penalty (InstructGPT): `scores - kl_coef * KL` elementwise.

    scores, old_logp, ref_logp: [B, T] float. The default k1 estimator gives exactly
    `scores - kl_coef * (old_logp - ref_logp)`; with `mask` [B, T] the penalty is 0 where the mask is 0.
    """
    kl = kl_estimate(old_logp, ref_logp, kind)
    if mask is not None:
        kl = zero_outside_mask(kl, mask)
    return scores - kl_coef * kl
