"""Losses of the offline pipelines: SFT's token-mean negative log-likelihood, the Bradley-Terry loss of a reward
model, DPO (sigmoid with label smoothing, and IPO), and the per-row weights that train a pair loss without pairs
sharing a micro-batch (`pair_loss_row_weights`). Pure torch; chosen/rejected tensors are [P], one entry per pair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "ipo")


def sft_loss(log_probs: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens, summed and divided by `num_tokens` (default: the mask's count;
    a micro-batch passes the global count so its share adds up to the step's mean)."""
    count = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=log_probs.dtype)
    return -(log_probs * mask).sum() / count.clamp(min=1)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """[P] -log sigmoid(chosen - rejected - margin): the reward model's pairwise loss (margin 0 without one)."""
    gap = chosen_scores - rejected_scores
    return -F.logsigmoid(gap if margin is None else gap - margin)


@dataclass(frozen=True)
class DPOLoss:
    """Per pair: the loss and the implicit rewards beta * (log pi - log pi_ref) of chosen and rejected."""

    losses: torch.Tensor  # [P]
    chosen_rewards: torch.Tensor  # [P], detached
    rejected_rewards: torch.Tensor  # [P], detached


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> DPOLoss:
    """DPO on sequence log-probs (sums over response tokens).

    sigmoid: -(1 - eps) log s(beta h) - eps log s(-beta h) with h the difference of the two log-ratios and eps the
    label smoothing (conservative DPO: the preference label is wrong with probability eps). ipo: (h' - 1/(2 beta))^2,
    h' the difference of the per-token log-ratios (each sequence's log-ratio over its response length, as TRL and the
    IPO authors do), so it needs `chosen_tokens` and `rejected_tokens` [P].
    """
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        logits = beta * (chosen_ratio - rejected_ratio)
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss averages each log-ratio over its tokens: pass chosen_tokens/rejected_tokens")
        gap = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (gap - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of {', '.join(DPO_LOSSES)}")
    return DPOLoss(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


def pair_loss_row_weights(
    row_values: torch.Tensor, mean_pair_loss: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[float, torch.Tensor]:
    """(the loss, d loss / d row value) for a loss of per-row values ([2P] rows: chosen 2i, rejected 2i+1).

    Training with sum(weight_row * value_row) as the loss gives the pair loss's exact gradient at the weights the
    values were computed with: the chain rule through the row values, whose gradients the model supplies. So a
    pair's two rows may land in different micro-batches, DP ranks or packs (the split and balancing stay free), for
    one extra forward pass that computes the values.
    """
    leaf = row_values.detach().double().requires_grad_(True)
    loss = mean_pair_loss(leaf)
    (weights,) = torch.autograd.grad(loss, leaf)
    return float(loss.detach()), weights.to(row_values.dtype)
