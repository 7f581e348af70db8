"""The pipelined forward/backward of Megatron model chunks: Megatron's schedule over the micro-batches (interleaved
with several model chunks) and the head's output captured for the loss. MegatronEngine (engine.py) runs every phase
through `forward_backward`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from roll_backend.strategies.megatron.builder import unwrap
from roll_backend.strategies.megatron.cp import slice_for_this_cp_rank
from roll_backend.strategies.megatron.micro_batches import MicroBatch
from roll_backend.strategies.megatron.moe import router_padding_mask
from roll_backend.strategies.megatron.mtp_loss import MtpLoss
from roll_backend.strategies.megatron.router_replay import RouteCall
from roll_backend.strategies.megatron.shared_micro_batches import rope_at_positions


class HeadCapture:
    """Holds the last output of the model's head (vocab-parallel logits [S, B, V/TP] or values [S, B, 1]).

    GPTModel returns a loss instead of logits whenever labels are passed, and with MTP labels must be passed
    (0.16.1 crashes on labels=None); a forward hook on the head gives the logits in both cases. The head is
    called for each MTP depth first and for the main logits last, so the last call wins. With labels, Megatron's
    vocab_parallel_cross_entropy then overwrites the logits in place (exp, normalise), so `copy=True` (needed
    with MTP) keeps a copy; the copy is part of the autograd graph (clone's backward is the identity).
    """

    def __init__(self, chunks: list, copy: bool = False):
        self.output: torch.Tensor | None = None
        self.copy = copy
        self.head_chunk = unwrap(chunks[-1])  # the head sits in the last model chunk of the last stage
        self.enabled = self.head_chunk.post_process
        if self.enabled:
            self.head_chunk.output_layer.register_forward_hook(self._hook)

    def applies_to(self, chunk) -> bool:
        return self.enabled and unwrap(chunk) is self.head_chunk

    def _hook(self, module, args, output):
        output = output[0] if isinstance(output, tuple) else output
        self.output = output.clone() if self.copy else output

    def pop(self) -> torch.Tensor:
        if self.output is None:
            raise RuntimeError("the model's head produced no output in this forward pass")
        output, self.output = self.output, None
        return output


def forward_backward(
    chunks: list,
    capture: HeadCapture,
    micro_batches: list[MicroBatch],
    forward_only: bool,
    mtp: MtpLoss | None,
    loss_func: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]],
    routes: RouteCall | None = None,
) -> list[dict]:
    """Run Megatron's schedule (interleaved with several model chunks) over the micro-batches; returns the
    loss_func dicts (last PP stage only, else []). Under CP each rank feeds the model its chunks of the sequence.
    `mtp`: the model's MTP loss (labels and mask go to every chunk; the head's chunk computes it), None without.
    `routes`: a MoE model's routes plan (replayed, compared and recorded per micro-batch and chunk), None without."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        micro = next(data_iterator)
        inputs, micro_routes = _chunk_inputs(micro, chunk, mtp, routed)
        key = (chunk_index[id(chunk)], micro_index[id(micro)])
        if routes is not None:
            routes.replayer.before_chunk(*key, micro_routes)
        # (this rank's positions: under CP its chunks of the sequence)
        rope = rope_at_positions(unwrap(chunk), inputs["position_ids"]) if micro.rope_positions else None
        with rope or contextlib.nullcontext():
            output = chunk(**inputs)
        if capture.applies_to(chunk):
            output = capture.pop()
        if routes is not None:
            output = routes.replayer.after_chunk(*key, output)
        return output, functools.partial(loss_func, micro)

    # MoE routers leave padding out of their load-balancing loss, z-loss and token counts.
    routed = bool(unwrap(chunks[0]).config.num_moe_experts)
    chunk_index = {id(chunk): i for i, chunk in enumerate(chunks)}
    micro_index = {id(micro): i for i, micro in enumerate(micro_batches)}
    first = micro_batches[0]
    iterators = [iter(micro_batches) for _ in chunks]  # the interleaved schedule reads one per model chunk
    if len({tuple(m.input_ids.shape) for m in micro_batches}) > 1:
        # Token-budget / packed micro-batches differ in shape: pipeline stages then exchange shapes before
        # activations (the schedule's seq_length and micro_batch_size only size fixed-shape receives).
        for chunk in chunks:
            unwrap(chunk).config.variable_seq_lengths = True
    training_mtp = mtp is not None and not forward_only
    if routes is not None:
        routes.replayer.begin(replay=routes.replay, record=routes.record)
    with (
        mtp.training(micro_batches) if training_mtp else contextlib.nullcontext(),
        routes.replayer.active() if routes is not None else contextlib.nullcontext(),
    ):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=list(chunks),
            num_microbatches=len(micro_batches),
            seq_length=first.input_ids.shape[1],
            micro_batch_size=first.input_ids.shape[0],
            forward_only=forward_only,
        )


def _chunk_inputs(micro: MicroBatch, chunk, mtp: MtpLoss | None, routed: bool):
    """(GPTModel.forward's keyword arguments for this rank's part of the micro-batch, its [b, T_cp, L, k] routes or
    None): CP-sliced, with MTP's labels and masks and, for MoE routers, the padding mask cut like their input."""
    inputs = {
        "input_ids": micro.input_ids,
        "position_ids": micro.position_ids,
        "attention_mask": micro.attention_mask,
    }
    if mtp is not None:
        inputs.update(mtp.inputs(micro))
    if routed:
        inputs["padding_mask"] = ~micro.token_mask
    if micro.routes is not None:
        inputs["routes"] = micro.routes
    inputs = slice_for_this_cp_rank(inputs)
    micro_routes = inputs.pop("routes", None)
    if routed:
        inputs["padding_mask"] = router_padding_mask(unwrap(chunk), inputs["padding_mask"])
    if micro.packed_seq_params is not None:
        inputs["packed_seq_params"] = micro.packed_seq_params
    return inputs, micro_routes


def is_last_stage() -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.is_pipeline_last_stage(ignore_virtual=True)
