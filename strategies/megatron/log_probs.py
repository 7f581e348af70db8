"""Per-token outputs of the model's head: vocab-parallel log-probs and entropy (no gathered vocabulary), or a
critic's values, for each response token in token order on every CP rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from roll_backend import keys
from roll_backend.strategies.megatron import cp
from roll_backend.strategies.megatron.builder import HFArch
from roll_backend.strategies.megatron.micro_batches import MicroBatch


def vocab_parallel_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[label] and the entropy of softmax(logits), without gathering the vocabulary.

    logits: [b, t, V/TP] this rank's vocabulary slice (columns past `vocab_size` are padding and ignored);
    labels: [b, t] int64 global token ids. Returns float32 [b, t] tensors, differentiable w.r.t. logits.
    Max is all-reduced without gradient (it only stabilises); sums use Megatron's reduce (identity backward).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = mpu.get_tensor_model_parallel_rank()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    valid = max(0, min(local_vocab, vocab_size - start))
    logits = logits[..., :valid].float()
    with torch.no_grad():
        if valid:
            row_max = logits.max(dim=-1).values
        else:
            row_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_sum_exp = sum_exp.log()
    local_label = labels - start
    in_range = (local_label >= 0) & (local_label < valid)
    index = local_label.clamp(0, max(valid - 1, 0)).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1) if valid else torch.zeros_like(row_max)
    picked = reduce_from_tensor_model_parallel_region(picked * in_range)
    log_probs = picked - log_sum_exp
    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v z_v, with z shifted by the max (H is shift-invariant).
        expected_logit = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1)) / sum_exp
        entropy = log_sum_exp - expected_logit
    return log_probs, entropy


def per_token_outputs(
    micro: MicroBatch, head_output: torch.Tensor, arch: HFArch, temperature: float, value_head: bool, with_entropy: bool
) -> dict[str, torch.Tensor]:
    """Response-side tensors from the head's output [T, b, ...] (under CP: this rank's [T/CP, b, ...] in
    Megatron's chunk order): {LOG_PROBS, ENTROPY} or {VALUES}, each [b, T_resp] in token order on every CP rank.
    Token-budget and packed micro-batches (`micro.gather`) pick each response token's output position."""
    cp_size = cp.cp_group_and_size()[1]
    if cp_size == 1:
        if micro.gather is None:
            positions = head_output[micro.response_slice].transpose(0, 1)  # [b, T_resp, V/TP] or [b, T_resp, 1]
        else:
            positions = micro.gather.take(head_output.transpose(0, 1))
        labels = micro.responses
    else:  # every local position, gathered into token order after the per-token reduction
        positions = head_output.transpose(0, 1)
        labels = cp.slice_for_this_cp_rank({"labels": micro.labels})["labels"]

    def to_responses(per_position: torch.Tensor) -> torch.Tensor:  # -> [b, T_resp]
        if cp_size == 1:
            return per_position
        full = cp.gather_sequence(per_position, dim=1)  # [b, T] in token order
        return full[:, micro.response_slice] if micro.gather is None else micro.gather.take(full)

    if value_head:
        out = {keys.VALUES: to_responses(positions[..., 0].float())}
    else:
        log_probs, entropy = vocab_parallel_log_probs(positions / temperature, labels, arch.vocab_size, with_entropy)
        out = {keys.LOG_PROBS: to_responses(log_probs)}
        if entropy is not None:
            out[keys.ENTROPY] = to_responses(entropy)
    if micro.gather is not None:  # columns the micro-batch did not keep: 0, as they are outside every loss mask
        valid = micro.gather.valid
        out = {name: torch.where(valid, value, torch.zeros_like(value)) for name, value in out.items()}
    return out
