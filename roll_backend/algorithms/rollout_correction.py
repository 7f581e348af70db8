"""Rollout-mismatch correction: importance weights and rejection masks between the sampling (rollout) policy and
the trainer's old policy, from log r_t = old_t - rollout_t (truncated IS, Yao et al. 2025; geometric-mean
rejection as in verl's rollout_corr). Every output is detached: the weights scale the policy loss, never train.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from roll_backend.algorithms.kl import kl_estimate
from roll_backend.algorithms.stats import masked_mean, masked_sum, zero_outside_mask

IS_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "sequence")


def rollout_log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r_t = old_t - rollout_t [B, T], detached; 0 outside `mask` (NaN/inf there never leak)."""
    return zero_outside_mask((old_logp - rollout_logp).detach(), mask)


def token_truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated IS: w_t = min(exp(log r_t), C) [B, T]; 0 outside `mask`.

    Computed as exp(min(log r_t, log C)), equal and overflow-free.
    """
    return zero_outside_mask(torch.exp(torch.clamp(log_ratio, max=math.log(cap))), mask)


def sequence_truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence-level truncated IS: w = min(exp(sum_t m_t log r_t), C) [B]; a row with an empty mask gets 1."""
    return torch.exp(torch.clamp(masked_sum(log_ratio, mask, dim=-1), max=math.log(cap)))


def sequence_geometric_mean_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Geometric-mean rejection: keep [B] bool, True where exp(mean_t log r_t) lies in [1/C_rs, C_rs].

    A row with an empty mask has ratio 1 and is kept (it has no tokens to mask anyway).
    """
    mean_log_ratio = masked_mean(log_ratio, mask, dim=-1)
    return mean_log_ratio.abs() <= math.log(threshold)


def token_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Token-level rejection: keep [B, T] bool, True on response tokens whose r_t lies in [1/C_rs, C_rs]."""
    return mask.bool() & (log_ratio.abs() <= math.log(threshold))


class RolloutCorrection(NamedTuple):
    """`weights` [B, T] multiply each token's policy loss (0 on rejected and padding tokens); `metrics` 0-d."""

    weights: torch.Tensor
    metrics: dict[str, torch.Tensor]


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str | None = None,
    is_cap: float = 2.0,
    rejection: str | None = None,
    rejection_threshold: float = 2.0,
) -> RolloutCorrection:
    """Truncated IS (`is_level` token|sequence, cap C) and/or rejection (`rejection` token|sequence, [1/C_rs, C_rs])
    of the rollout/trainer mismatch -> per-token loss weights and metrics.

    old_logp, rollout_logp, mask: [B, T] float. Rejected tokens (all of a rejected sequence's) get weight 0;
    the rest get their IS weight, or 1 without IS. Metrics: k3 KL(rollout || old) over response tokens,
    mean/max IS weight over the kept tokens (sequence level: over kept non-empty sequences), the fraction of
    response tokens masked and of non-empty sequences left with no token. Empty masks give 0 metrics, never NaN.
    """
    if is_level not in (None, *IS_LEVELS):
        raise ValueError(f"rollout correction is_level={is_level!r}; use one of {IS_LEVELS} or None")
    if rejection not in (None, *REJECTION_LEVELS):
        raise ValueError(f"rollout correction rejection={rejection!r}; use one of {REJECTION_LEVELS} or None")
    if is_level is not None and not is_cap >= 1.0:
        raise ValueError(f"rollout correction is_cap={is_cap} must be >= 1 (weights are truncated at it)")
    if rejection is not None and not rejection_threshold > 1.0:
        raise ValueError(f"rollout correction rejection_threshold={rejection_threshold} must be > 1 (keeps [1/C, C])")
    mask = mask.float()
    log_ratio = rollout_log_ratio(old_logp, rollout_logp, mask)
    non_empty = mask.sum(-1) > 0  # [B]

    keep = mask.bool()  # [B, T]
    if rejection == "sequence":
        keep = keep & sequence_geometric_mean_keep(log_ratio, mask, rejection_threshold)[:, None]
    elif rejection == "token":
        keep = keep & token_keep(log_ratio, mask, rejection_threshold)
    kept = keep.float()

    if is_level == "token":
        is_weights = token_truncated_is_weights(log_ratio, mask, is_cap)
        weight_mean, weight_max = masked_mean(is_weights, kept), _masked_max(is_weights, kept)
    elif is_level == "sequence":
        sequence_weights = sequence_truncated_is_weights(log_ratio, mask, is_cap)  # [B]
        is_weights = sequence_weights[:, None].expand_as(mask)
        kept_rows = (keep.any(-1) & non_empty).float()
        weight_mean, weight_max = masked_mean(sequence_weights, kept_rows), _masked_max(sequence_weights, kept_rows)
    else:
        is_weights = torch.ones_like(mask)
        weight_mean = weight_max = torch.ones(())
    weights = zero_outside_mask(is_weights, kept)

    rejected = mask.bool() & ~keep
    rows = non_empty.float().sum()
    metrics = {
        "kl_k3": masked_mean(kl_estimate(rollout_logp.detach(), old_logp.detach(), "k3"), mask),
        "weight_mean": weight_mean,
        "weight_max": weight_max,
        "masked_token_fraction": rejected.float().sum() / mask.sum().clamp(min=1),
        "masked_sequence_fraction": (non_empty & ~keep.any(-1)).float().sum() / rows.clamp(min=1),  # no token kept
    }
    return RolloutCorrection(weights.detach(), {k: v.detach() for k, v in metrics.items()})


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest `values` where `mask` is set; 0 for an empty mask."""
    if not bool(mask.bool().any()):
        return torch.zeros(())
    return values[mask.bool()].max()
