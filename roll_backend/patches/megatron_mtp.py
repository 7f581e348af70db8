"""Megatron-core's MTP loss normalisation made layout-independent (all devices, 0.16.x).

GPTModel divides each MTP depth's masked loss by `num_tokens`, the sum of the rolled loss mask of this rank's
part of the sequence (the second value `roll_tensor` returns), then gradients and the logged loss are averaged
over DP x CP. Two problems in RL, where the mask covers only response tokens:
- under context parallelism the CP ranks hold different numbers of loss tokens, so the mean of per-rank means
  is not the sequence's mean: the MTP loss and its gradient would depend on CP. Returning the CP group's total
  divided by the CP size makes every rank's share `local_sum * cp / total`, whose CP average is the mean over
  the whole sequence, as at CP1;
- a CP rank or an all-padding micro-batch (the interleaved schedule needs a multiple of PP micro-batches) can
  have no loss tokens: 0/0 makes the loss NaN and its backward NaN in every weight. Megatron clamps the main
  loss's count the same way (schedules.forward_step); the count here is at least 1.
"""

from __future__ import annotations

import functools

_applied = False


def apply() -> None:
    """Wrap the `roll_tensor` GPTModel uses so the count it returns is CP-global (per CP rank) and >= 1 (idempotent)."""
    global _applied
    if _applied:
        return
    import torch.distributed as dist
    from megatron.core.models.gpt import gpt_model

    original = gpt_model.roll_tensor

    @functools.wraps(original)
    def roll_tensor_with_sequence_count(*args, cp_group=None, **kwargs):
        rolled, total = original(*args, cp_group=cp_group, **kwargs)
        if cp_group is not None and cp_group.size() > 1:
            total = total.detach().clone()
            dist.all_reduce(total, group=cp_group)
            return rolled, total.clamp(min=1) / cp_group.size()
        return rolled, total.clamp(min=1)

    gpt_model.roll_tensor = roll_tensor_with_sequence_count
    _applied = True
