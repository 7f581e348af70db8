"""Response-level reward post-processing for pipelines: normalisation by batch or by group, then clipping.

Works on one score per response ([B]), before the score is placed on the last response token.
`REWARD_NORMALIZERS` is the only list of valid normalisation modes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll_backend.algorithms.registry import lookup
from roll_backend.algorithms.stats import group_stats

REWARD_NORM_EPS = 1e-6  # added to the std, as in GRPO


def clip_rewards(scores: torch.Tensor, clip: float | tuple[float, float]) -> torch.Tensor:
    """`scores` clamped to [-clip, clip] (or to [low, high] for a pair); any shape."""
    low, high = (-clip, clip) if isinstance(clip, (int, float)) else clip
    if not low <= high:
        raise ValueError(f"reward clip range must have low <= high, got ({low}, {high}); a scalar clip must be >= 0.")
    return torch.clamp(scores, min=low, max=high)


def _normalize(scores: torch.Tensor, group_ids, scale_by_std: bool, eps: float) -> torch.Tensor:
    stats = group_stats(scores, group_ids)
    centred = scores - stats.mean
    return centred / (stats.std + eps) if scale_by_std else centred


def _by_batch(scores: torch.Tensor, group_ids, scale_by_std: bool, eps: float) -> torch.Tensor:
    whole_batch = torch.zeros(scores.shape, dtype=torch.int64, device=scores.device)
    return _normalize(scores, whole_batch, scale_by_std, eps)


def _by_group(scores: torch.Tensor, group_ids, scale_by_std: bool, eps: float) -> torch.Tensor:
    if group_ids is None:
        raise ValueError("reward normalisation 'group' needs group_ids (the prompt uid of every response).")
    return _normalize(scores, group_ids, scale_by_std, eps)


REWARD_NORMALIZERS: dict[str, Callable[..., torch.Tensor]] = {
    "batch": _by_batch,
    "group": _by_group,
}
REWARD_NORM_MODES: tuple[str, ...] = tuple(REWARD_NORMALIZERS)


def normalize_rewards(
    scores: torch.Tensor,
    mode: str,
    group_ids=None,
    *,
    scale_by_std: bool = True,
    eps: float = REWARD_NORM_EPS,
) -> torch.Tensor:
    """`(score - mean) / (std + eps)` over the whole batch ('batch') or each prompt group ('group').

    scores: [B] float; group_ids: [B] int64 (or uid strings), needed for 'group'. Unbiased std; a
    group (or batch) of one keeps its score (mean 0, std 1); equal scores give exactly 0.
    `scale_by_std=False` only subtracts the mean.
    """
    return lookup(REWARD_NORMALIZERS, "reward normalisation", mode)(scores, group_ids, scale_by_std, eps)


def postprocess_rewards(
    scores: torch.Tensor,
    group_ids=None,
    *,
    norm: str | None = None,
    clip: float | tuple[float, float] | None = None,
    scale_by_std: bool = True,
    eps: float = REWARD_NORM_EPS,
) -> torch.Tensor:
    """Normalise (if `norm`), then clip (if `clip`) response scores [B]; returns a new [B] tensor."""
    if norm is not None:
        scores = normalize_rewards(scores, norm, group_ids, scale_by_std=scale_by_std, eps=eps)
    if clip is not None:
        scores = clip_rewards(scores, clip)
    return scores
