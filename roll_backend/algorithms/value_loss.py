"""Critic loss: the clipped value-function loss of PPO."""

from __future__ import annotations

import math

import torch

from roll_backend.algorithms.aggregation import agg_loss
from roll_backend.algorithms.stats import masked_mean, zero_outside_mask


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss of PPO implementations (not in the PPO paper) -> (loss, clipfrac), 0-d.

    vpreds, returns, old_values, mask: [B, T] float. `0.5 * agg(max((v - R)^2, (v_clip - R)^2))` with
    v_clip = v kept within old_values +- clip_range: the pessimistic max gives gradient 0 where the
    clipped term wins. clipfrac: masked fraction where the clipped term is strictly larger. clip_range=None: no
    clipping (`0.5 * agg((v - R)^2)`, clipfrac 0; ROLL's `value_clip: null`).
    `agg_kwargs` (dp_size, batch_num_tokens, ...) go to `agg_loss`.
    """
    vpreds, returns, old_values = (zero_outside_mask(x, mask) for x in (vpreds, returns, old_values))
    if clip_range is None:
        clip_range = math.inf
    vpreds_clipped = torch.min(torch.max(vpreds, old_values - clip_range), old_values + clip_range)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.max(loss_unclipped, loss_clipped), mask, agg_mode, **agg_kwargs)
    clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), mask)
    return loss, clipfrac
