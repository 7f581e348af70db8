"""Loss aggregation: reduce a per-token loss matrix to the scalar that is back-propagated.

Each mode is one entry of `AGG_MODES`, the only list of valid `agg_mode` names. A data-parallel
trainer passes the global normalisers (`batch_num_tokens`, `global_batch_size`) and `dp_size`, so
the gradient averaged over ranks equals the gradient of the global-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll_backend.algorithms.registry import lookup
from roll_backend.algorithms.stats import MEAN_EPS, masked_sum

AggFn = Callable[..., torch.Tensor]


def _token_mean(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    # No epsilon: a micro-batch without a single loss token is a caller bug and shows up as NaN.
    if batch_num_tokens is None:
        _require_local(dp_size, "batch_num_tokens", "token-mean")
        batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size


def _token_sum(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    return masked_sum(loss_mat, loss_mask) * dp_size


def _seq_mean(seq_losses, tokens_per_seq, dp_size, global_batch_size, mode):
    """Mean over sequences that have at least one loss token; fully masked rows are left out."""
    kept = (tokens_per_seq > 0).to(seq_losses.dtype)  # [B]
    if global_batch_size is None:
        _require_local(dp_size, "global_batch_size", mode)
        global_batch_size = kept.sum()
    return masked_sum(seq_losses, kept) / global_batch_size * dp_size


def _seq_mean_token_sum(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    return _seq_mean(seq_losses, loss_mask.sum(dim=-1), dp_size, global_batch_size, "seq-mean-token-sum")


def _seq_mean_token_mean(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    tokens_per_seq = loss_mask.sum(dim=-1)  # [B]
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / (tokens_per_seq + MEAN_EPS)
    return _seq_mean(seq_losses, tokens_per_seq, dp_size, global_batch_size, "seq-mean-token-mean")


def _seq_mean_token_sum_norm(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    # Dr.GRPO: a constant divisor (default: the padded length T, not the valid-token count) removes
    # the length bias of token-mean; keep it fixed through training.
    loss = _seq_mean_token_sum(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, None)
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return loss / loss_scale_factor


def _require_local(dp_size: int, normaliser: str, mode: str) -> None:
    if dp_size != 1:
        raise ValueError(
            f"agg_loss mode {mode!r} with dp_size={dp_size} needs the global {normaliser}; "
            f"pass {normaliser}= (computed over the whole data-parallel batch) or use dp_size=1."
        )


AGG_MODES: dict[str, AggFn] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
AGG_MODE_NAMES: tuple[str, ...] = tuple(AGG_MODES)


def get_agg_mode(name: str) -> AggFn:
    """The aggregation function registered as `name`; ValueError listing the known modes otherwise."""
    return lookup(AGG_MODES, "loss aggregation mode", name)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    dp_size: int | None = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a 0-d tensor (the token/sequence means of DAPO, Dr.GRPO, PPO).

    loss_mat: [B, T] float, may hold NaN/inf where `loss_mask` is 0; loss_mask: [B, T] float 0/1.
    mode: one of AGG_MODE_NAMES. token-mean: sum / N * dp (N = batch_num_tokens or the local token
    count, no epsilon); token-sum: sum * dp; seq-mean-token-sum / seq-mean-token-mean: mean over rows
    with at least one token of the row's token sum / token mean (G = global_batch_size or the number
    of such rows), times dp; seq-mean-token-sum-norm: seq-mean-token-sum / (loss_scale_factor or T).
    With dp_size > 1 the matching global normaliser is required.
    """
    aggregate = get_agg_mode(mode)
    dp_size = 1 if dp_size is None else dp_size
    return aggregate(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)


def token_mean_share(mean: torch.Tensor, mask: torch.Tensor, global_tokens: float | torch.Tensor) -> torch.Tensor:
    """A micro-batch's masked token mean (of `mask` [B, T]) as its share of the mean over `global_tokens` tokens: the
    shares of all micro-batches and DP ranks add up to the global token mean, however the rows were split."""
    return mean * mask.sum() / global_tokens
