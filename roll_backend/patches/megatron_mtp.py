"""A guard for megatron-core's MTP loss when a micro-batch part has no loss tokens (all devices, 0.16.x).

GPTModel divides each MTP depth's masked loss by `num_tokens`, the sum of the rolled loss mask of this rank's
part of the sequence. In RL the mask covers only response tokens, so under context parallelism a CP rank whose
chunks hold only prompt tokens, or an all-padding micro-batch (the interleaved schedule needs a multiple of PP
micro-batches), has num_tokens = 0: 0/0 makes the loss NaN and its backward NaN in every weight. Megatron
clamps the main loss's token count the same way (schedules.forward_step); this clamps MTP's, which changes
nothing where a part has loss tokens.
"""

from __future__ import annotations

import functools

_applied = False


def apply() -> None:
    """Wrap the `roll_tensor` GPTModel uses so the token count it returns is at least 1 (idempotent)."""
    global _applied
    if _applied:
        return
    from megatron.core.models.gpt import gpt_model

    original = gpt_model.roll_tensor

    @functools.wraps(original)
    def roll_tensor_with_nonzero_count(*args, **kwargs):
        rolled, total = original(*args, **kwargs)
        return rolled, total.clamp(min=1)

    gpt_model.roll_tensor = roll_tensor_with_nonzero_count
    _applied = True
