"""Masked statistics over per-token tensors (sum, mean, variance, whitening) and per-group score statistics.

Entries where the mask is 0 never reach a result, even when they hold NaN or inf: they are
selected away with `torch.where` before any arithmetic (`x * 0` would still be NaN).
Group statistics match, bit for bit, `torch.mean` / `torch.std` of each group's scores stacked in row
order, which is how the reference trainer computes them one group at a time. That matters: with
near-identical rewards an ulp in the mean is amplified by `1 / (std + eps)`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

MEAN_EPS = 1e-8  # added to the token count of a masked mean, so an empty mask gives 0
WHITEN_EPS = 1e-8  # added to the variance before the inverse square root


def zero_outside_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where `mask` is nonzero, 0 elsewhere (NaN/inf there included); gradient 0 there."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values * mask` treating masked entries as 0.

    values, mask: [B, T] float (any equal shapes); dim: None (every element, 0-d result) or -1 ([B]).
    """
    kept = zero_outside_mask(values, mask) * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`masked_sum / (sum(mask) + 1e-8)`: 0-d for dim=None, per-row [B] for dim=-1; empty rows give 0.

    values, mask: [B, T] float.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of `values` [B, T] as a 0-d tensor.

    Mean over all masked elements, then the masked mean of squared deviations; `unbiased` multiplies
    by n/(n-1) (Bessel), which needs n >= 2 masked elements.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        num_tokens = float(count)
        if num_tokens < 2:
            raise ValueError(
                f"an unbiased masked variance needs at least 2 unmasked elements, got {num_tokens:g}; "
                "pass a mask with more valid tokens or use unbiased=False."
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whole-batch whitening `(x - mu) / sqrt(var + 1e-8)` of `values` [B, T], applied to every element.

    `mu` and the Bessel-corrected `var` come from the masked elements only (n >= 2 required). With
    `shift_mean=False` the mean is added back, so only the scale changes.
    """
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask, unbiased=True)
    # rsqrt rather than 1/sqrt: the convention of the reference trainer (differs by at most an ulp).
    whitened = (values - mean) * torch.rsqrt(variance + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# Per-group statistics of response scores (GRPO/RLOO baselines), vectorised over groups.


class GroupStats(NamedTuple):
    """Statistics of each row's group, broadcast back to rows."""

    mean: torch.Tensor  # [B] float, group mean (0 for a singleton group)
    std: torch.Tensor  # [B] float, unbiased group std (1 for a singleton group, 0 for identical scores)
    size: torch.Tensor  # [B] int64, number of responses in the group


def as_group_ids(group_ids, device: torch.device | None = None) -> torch.Tensor:
    """An int64 [B] tensor of group ids from a tensor, or from any sequence of hashable ids (e.g. uid strings)."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex:
            raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}.")
        return group_ids.to(device=device, dtype=torch.int64)
    ids = np.asarray(group_ids)
    if ids.dtype.kind in "iub":
        return torch.as_tensor(ids, dtype=torch.int64, device=device)
    _, inverse = np.unique(ids.astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.int64, device=device)


def group_stats(scores: torch.Tensor, group_ids) -> GroupStats:
    """Mean, unbiased std and size of the group of every response.

    scores: [B] float, one score per response; group_ids: [B] int64 (or ids `as_group_ids` accepts),
    equal ids share a group, groups may be interleaved and of any size.
    Singleton groups get mean 0 and std 1. A group whose scores are all equal gets exactly that score
    as mean and std 0 (`torch.mean` of equal float32 values can be an ulp off, which would turn into
    a spurious advantage of order 0.1 after dividing by `std + 1e-6`).
    """
    group_ids = as_group_ids(group_ids, scores.device)
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be [B]; "
            f"got scores {tuple(scores.shape)}, group_ids {tuple(group_ids.shape)}."
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    members_in_order = torch.argsort(inverse, stable=True)  # rows grouped, row order kept inside a group
    starts = torch.cumsum(counts, 0) - counts

    group_sum = scores.new_zeros(num_groups)
    all_equal = torch.zeros(num_groups, dtype=torch.bool, device=scores.device)
    # One [G_n, n] reduction per distinct group size: the same kernel (and summation order) as
    # torch.sum over one group's stacked scores, without a Python loop over rows or groups.
    for size in torch.unique(counts).tolist():
        groups = torch.nonzero(counts == size).squeeze(1)
        offsets = torch.arange(size, device=scores.device)
        member_scores = scores[members_in_order[starts[groups].unsqueeze(1) + offsets]]  # [G_n, n]
        group_sum[groups] = member_scores.sum(dim=-1)
        all_equal[groups] = member_scores.amax(dim=-1) == member_scores.amin(dim=-1)
    group_mean = group_sum / counts

    # torch.std of a float32 vector on CPU: float32 mean, then squared deviations summed in float64.
    deviation = scores.double() - group_mean.double()[inverse]
    sum_sq = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    sum_sq.index_add_(0, inverse, deviation * deviation)
    group_std = torch.sqrt(sum_sq / (counts - 1)).to(scores.dtype)

    singleton = counts == 1
    first_score = scores[members_in_order[starts]]
    group_mean = torch.where(all_equal, first_score, group_mean)
    group_std = torch.where(all_equal, torch.zeros_like(group_std), group_std)
    group_mean = torch.where(singleton, torch.zeros_like(group_mean), group_mean)
    group_std = torch.where(singleton, torch.ones_like(group_std), group_std)
    return GroupStats(group_mean[inverse], group_std[inverse], counts[inverse])
