"""The pipelined forward/backward of a Megatron strategy: Megatron's schedule over the micro-batches (interleaved
with several model chunks), the head's output captured for the loss, and forward-only per-token outputs."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron import lora
from roll_backend.strategies.megatron import micro_batches as mb
from roll_backend.strategies.megatron.builder import HFArch, unwrap
from roll_backend.strategies.megatron.cp import slice_for_this_cp_rank
from roll_backend.strategies.megatron.log_probs import per_token_outputs
from roll_backend.strategies.megatron.micro_batches import MicroBatch
from roll_backend.strategies.megatron.model_setup import set_train_mode
from roll_backend.strategies.megatron.moe import router_padding_mask
from roll_backend.strategies.megatron.mtp_loss import MtpLoss
from roll_backend.strategies.megatron.router_replay import RouteCall, RouteReplayer, join_stages, route_call


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


def route_replayer(strategy, chunks: list) -> RouteReplayer | None:
    """A MoE model's RouteReplayer (route metrics always, replay as configured); None for a dense model."""
    moe = strategy.arch.moe
    return None if moe is None else RouteReplayer(chunks, strategy.arch.num_layers, moe.topk, strategy.device)


def attach_head(strategy) -> None:
    """Give a Megatron strategy its HeadCapture and, with MTP, its MtpLoss (both hook into the head's chunk)."""
    depths = strategy.config.mtp_num_layers
    strategy.capture = HeadCapture(strategy.model, copy=depths > 0)
    strategy.mtp_loss = MtpLoss(unwrap(strategy.model[-1]), depths, strategy.arch.vocab_size) if depths else None


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


def forward_per_token(
    model,
    capture: HeadCapture,
    batch: DataProto,
    arch: HFArch,
    plan,
    device: str,
    temperature: float,
    value_head: bool,
    with_entropy: bool,
    mtp: MtpLoss | None,
    what: str,
    routes: RouteCall | None = None,
) -> DataProto | None:
    """Forward-only per-token outputs of the batch's responses, in its row order; a DataProto on the last PP
    stage, else None. `plan`: a micro_batches.BatchingPlan (fixed rows, token budget or packing). `routes`: a MoE
    model's routes plan; recorded routes come back as keys.RECORDED_ROUTES, route metrics in meta_info."""
    micro_batches, num_rows = mb.split(batch, plan, device, what, routes.routes if routes is not None else None)
    temperature = float(batch.meta_info.get(keys.META_TEMPERATURE, temperature))

    def collect(micro: MicroBatch, head_output: torch.Tensor):
        outputs = per_token_outputs(micro, head_output, arch, temperature, value_head, with_entropy)
        return torch.zeros((), device=head_output.device), {k: v.detach() for k, v in outputs.items()}

    set_train_mode(model, False)
    with torch.no_grad():
        stored = forward_backward(model, capture, micro_batches, True, mtp, collect, routes)
        recorded = recorded_routes(routes, micro_batches, batch, device) if routes is not None else None
    metrics = routes.replayer.pop_metrics("moe/log_probs_") if routes is not None else {}
    if not is_last_stage():
        return None
    tensors = mb.collect_rows(micro_batches, stored, num_rows)
    if recorded is not None:
        tensors[keys.RECORDED_ROUTES] = recorded
    return DataProto.from_dict(tensors=tensors, meta_info={keys.META_METRICS: metrics} if metrics else None)


def recorded_routes(routes: RouteCall, micro_batches: list[MicroBatch], batch: DataProto, device: str):
    """[B, T, L, k] the live routes of a recording forward at each token of the batch (-1 at padding), every
    stage's layers joined; None when the call did not record."""
    if not routes.record:
        return None
    per_micro = [
        routes.replayer.recorded_micro_routes(i, tuple(micro.input_ids.shape)) for i, micro in enumerate(micro_batches)
    ]
    attention = batch.batch[keys.ATTENTION_MASK]
    shape = (*attention.shape, routes.replayer.num_layers, routes.replayer.topk)
    placed = mb.place_per_token(micro_batches, per_micro, shape, -1)
    placed = join_stages(placed, device)
    return placed.masked_fill(~attention.bool()[..., None, None], -1)


def strategy_forward(strategy, batch: DataProto, value_head: bool, what: str) -> DataProto | None:
    """Forward-only per-token outputs for a Megatron strategy (infer or train): log-probs or values."""
    if strategy.model is None:
        raise RuntimeError(f"{what}: the strategy is not initialised; call initialize() first")
    config = strategy.config
    if value_head != config.value_head:
        kind = "a value head" if value_head else "an LM head"
        raise ValueError(f"{what} needs {kind}; this strategy has value_head={config.value_head}")
    base = contextlib.nullcontext()
    if batch.meta_info.get(keys.META_BASE_MODEL):
        if getattr(config, "lora", None) is None:
            raise ValueError(
                f"{what}: meta_info[{keys.META_BASE_MODEL!r}] asks for the base model of LoRA adapters, "
                "and this strategy has no lora"
            )
        base = lora.adapters_disabled(strategy.model)
    with base:
        return _forward(strategy, batch, value_head, what)


def _forward(strategy, batch: DataProto, value_head: bool, what: str) -> DataProto | None:
    config = strategy.config
    return forward_per_token(
        strategy.model,
        strategy.capture,
        batch,
        strategy.arch,
        mb.batching_plan(strategy, batch),
        strategy.device,
        config.temperature,
        value_head,
        config.compute_entropy,
        strategy.mtp_loss,
        what,
        route_call(strategy, batch, training=False),
    )
