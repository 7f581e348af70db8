"""Token-level math: response masks from EOS, log-probabilities and entropy from logits (where a value sits in a row
is protocol.sequences')."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roll_backend.algorithms.aggregation import agg_loss


def response_mask_from_eos(response_ids: torch.Tensor, eos_ids: int | Sequence[int]) -> torch.Tensor:
    """int64 [B, T] mask: 1 up to and including the first token of `response_ids` [B, T] whose id is in
    `eos_ids`, 0 after it; a row without EOS is all ones."""
    eos = torch.as_tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), dtype=response_ids.dtype)
    if eos.numel() == 0:
        return torch.ones_like(response_ids, dtype=torch.int64)
    is_eos = torch.isin(response_ids, eos.to(response_ids.device)).to(torch.int64)
    eos_before = is_eos.cumsum(dim=-1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).to(torch.int64)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)` at `labels`: logits [B, T, V] float, labels [B, T] int64 -> [B, T]; no mask."""
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy `logsumexp(z) - sum(softmax(z) * z)` over the last dim: [..., V] -> [...].

    Both terms are shift-invariant and computed from max-subtracted exponentials, so logits of
    magnitude ~80 and uniform rows are exact to float32 rounding.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def entropy_loss(
    logits: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: str = "token-mean",
    **agg_kwargs,
) -> torch.Tensor:
    """Aggregated token entropy (the entropy bonus of PPO), 0-d: logits [B, T, V], mask [B, T] float.

    `agg_kwargs` (dp_size, batch_num_tokens, ...) go to `agg_loss`; by default the local normalisers.
    """
    return agg_loss(entropy_from_logits(logits), mask, agg_mode, **agg_kwargs)
