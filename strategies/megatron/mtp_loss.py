"""The multi-token-prediction loss as a token mean over the whole global batch and the real vocabulary, so that it
(and the step it drives) is the same at every TP/PP/CP/DP layout and micro-batch split.

megatron-core 0.16.1 computes the MTP loss of each micro-batch inside the model's post-process: cross-entropy over
the TP-padded vocabulary (the padded columns' logits count in the softmax, so TP changes the loss whenever TP does
not divide the vocabulary), masked, then divided by the micro-batch's own token count on this CP rank (so the micro-
batch split, DP and CP change the weights of tokens). Its gradient is further scaled by 1 / num_microbatches and
averaged over DP x CP by DDP. Here:
- a depth's loss mask is the rolled response mask at positions that are themselves real tokens: position i of depth
  d joins its hidden state with the embeddings of tokens i+1..i+d, so a left-padding position before a one-token
  prompt would predict the first response token from padding (a value that moves with the micro-batch's width);
- the model is fed a loss mask of ones, so Megatron's divisor is the (never zero) count of rolled positions on
  this rank, `passed`;
- `compute_language_model_loss` is replaced on the head's chunk: padded vocabulary columns are left out of the
  softmax, and each position's cross-entropy is weighted by `rolled loss mask * K * passed / N`, with N the depth's
  loss tokens in the global batch and K = DP x CP; Megatron's 1 / num_microbatches is undone around the schedule.
The gradient is then `scaling_factor / depths * sum over every loss token of CE / N`, and Megatron's tracker holds
the global token mean per depth (its average over DP x CP of K-scaled shares).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from roll_backend.strategies.megatron.cp import slice_for_this_cp_rank

if TYPE_CHECKING:
    from roll_backend.strategies.megatron.micro_batches import MicroBatch


def rolled(mask: torch.Tensor, depth: int) -> torch.Tensor:
    """The loss mask of MTP depth `depth` (1-based) over full [b, T] rows: Megatron rolls labels and mask left once
    per depth, filling the end with zeros."""
    out = torch.zeros_like(mask)
    if depth < mask.shape[-1]:
        out[:, : mask.shape[-1] - depth] = mask[:, depth:]
    return out


def depth_mask(micro: MicroBatch, depth: int) -> torch.Tensor:
    """[b, T] loss mask of MTP depth `depth` over the micro-batch's full rows: the rolled response mask, at real
    token positions only."""
    return rolled(micro.loss_mask, depth) * micro.token_mask.to(micro.loss_mask.dtype)


def token_counts(micro: MicroBatch, depths: int) -> torch.Tensor:
    """[depths] float64: loss tokens each MTP depth predicts in the micro-batch."""
    return torch.stack([depth_mask(micro, d).sum() for d in range(1, depths + 1)]).double()


class MtpLoss:
    """Per-rank state of the MTP loss (see the module docstring). `head_chunk`: the unwrapped model chunk that holds
    the output layer and MTP layers, or None on ranks without them (they only pass labels and mask along)."""

    def __init__(self, head_chunk, depths: int, vocab_size: int):
        self.depths, self.vocab_size = depths, vocab_size
        self.global_tokens: torch.Tensor | None = None  # [depths] for the current train step; None: forward only
        self._weights: list[torch.Tensor] = []
        if head_chunk is not None and getattr(head_chunk, "mtp_process", False) and head_chunk.post_process:
            head_chunk.compute_language_model_loss = self._per_token_loss

    @contextlib.contextmanager
    def training(self, micro_batches: list[MicroBatch]):
        """Around one train step's schedule: counts each depth's loss tokens over this rank's micro-batches (full
        rows) and the DP group, and undoes Megatron's 1 / num_microbatches on the MTP gradient (the weights already
        make the micro-batches add up to the global token mean)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        local = sum(token_counts(micro, self.depths) for micro in micro_batches)
        dist.all_reduce(local, group=mpu.get_data_parallel_group())
        original = MTPLossAutoScaler.__dict__["set_loss_scale"]
        num_micro_batches = len(micro_batches)
        MTPLossAutoScaler.set_loss_scale = staticmethod(lambda scale: original.__func__(scale * num_micro_batches))
        self.global_tokens = local
        try:
            yield
        finally:
            self.global_tokens, self._weights = None, []
            MTPLossAutoScaler.set_loss_scale = original

    def reported(self) -> float | None:
        """The step's MTP loss (the global token mean, averaged over depths) from Megatron's tracker, which it
        resets; None on ranks without the MTP head or before any train step."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return None
        MTPLossLoggingHelper.reduce_loss_in_tracker()  # the average over DP x CP of the K-scaled shares
        value = float(tracker["values"].sum()) / self.depths
        MTPLossLoggingHelper.clean_loss_in_tracker()
        return value

    def inputs(self, micro: MicroBatch) -> dict[str, torch.Tensor]:
        """The model's `labels` and `loss_mask` for one micro-batch (full rows, before the CP split); queues the
        per-position weights of each depth for the head's loss."""
        ones = torch.ones_like(micro.loss_mask)
        self._weights = []
        if self.global_tokens is not None:
            scale = _dp_cp_size()
            for depth in range(1, self.depths + 1):
                true_mask = slice_for_this_cp_rank({"m": depth_mask(micro, depth)})["m"]
                passed = slice_for_this_cp_rank({"m": rolled(ones, depth)})["m"].sum()
                total = float(self.global_tokens[depth - 1])
                self._weights.append(true_mask * (scale * passed / total) if total > 0 else torch.zeros_like(true_mask))
        return {"labels": micro.labels, "loss_mask": ones}

    def _per_token_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Replaces LanguageModule.compute_language_model_loss: labels [b, s], logits [s, b, V/TP] -> [b, s]."""
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        local_vocab = logits.shape[-1]
        start = mpu.get_tensor_model_parallel_rank() * local_vocab
        valid = max(0, min(local_vocab, self.vocab_size - start))
        if valid < local_vocab:  # padded columns: out of the softmax at every TP size
            padded = torch.arange(local_vocab, device=logits.device) >= valid
            logits = logits.masked_fill(padded, float("-inf"))
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)
        weight = self._weights.pop(0) if self._weights else torch.zeros_like(loss)
        return loss * weight.to(loss.dtype)


def _dp_cp_size() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_world_size(with_context_parallel=True)
