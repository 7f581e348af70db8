"""`MegatronEngine`: one rank's Megatron model and what runs it, under every Megatron role (the trainer, the
forward-only reference / reward model / teacher, the critic, the offline trainers, LoRA).

It owns the model chunks (one per virtual pipeline stage; DDP-wrapped where the role trains), the HF architecture
they were built from, the head capture, the MTP loss and the MoE route replayer. `forward_backward` is the one way a
phase runs the model (Megatron's schedule over micro-batches, forward-only or with backward); `forward` gives the
per-token log-probs, entropies or values of a batch on top of it. A training strategy adds its optimizer and
scheduler around the engine; helpers take the engine (or what they need of it), not the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.perf.memory import PhasePeaks
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron import lora, schedule
from roll_backend.strategies.megatron import micro_batches as mb
from roll_backend.strategies.megatron.builder import HFArch, unwrap
from roll_backend.strategies.megatron.log_probs import per_token_outputs
from roll_backend.strategies.megatron.micro_batches import MicroBatch
from roll_backend.strategies.megatron.model_setup import set_train_mode
from roll_backend.strategies.megatron.moe import ExpertLoad
from roll_backend.strategies.megatron.mtp_loss import MtpLoss
from roll_backend.strategies.megatron.router_replay import RouteCall, RouteReplayer, join_stages, route_call
from roll_backend.strategies.megatron.shared_micro_batches import split_shared

GREEDY_TEMPERATURE = 1e-5  # a rollout temperature below this is greedy decoding (vLLM's own threshold)


def measures_memory(batch: DataProto) -> bool:
    """The call asks its phases to count their memory (keys.META_MEASURE_MEMORY)."""
    return bool(batch.meta_info.get(keys.META_MEASURE_MEMORY))


LossFunc = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class OutputSpec:
    """What a forward reads off the head for each response token: values (a value head) or log-probs at
    `temperature`, with their entropies when `entropy`."""

    value_head: bool
    temperature: float
    entropy: bool


class MegatronEngine:
    """The model chunks of one rank and everything a phase needs to run them (see the module docstring)."""

    def __init__(
        self,
        config,
        layout: ParallelLayout,
        device: str,
        chunks: list,
        arch: HFArch,
    ):
        self.config, self.layout, self.device = config, layout, device
        self.chunks = chunks  # what the schedule runs (DDP-wrapped when training)
        self.arch = arch
        depths = config.mtp_num_layers
        self.capture = schedule.HeadCapture(chunks, copy=depths > 0)
        self.mtp_loss = MtpLoss(unwrap(chunks[-1]), depths, arch.vocab_size) if depths else None
        moe = arch.moe
        self.route_replayer = (
            None if moe is None else RouteReplayer([unwrap(c) for c in chunks], arch.num_layers, moe.topk, device)
        )
        self.memory = PhasePeaks(device)  # what each phase allocated at its peak ("train", "forward")

    def output_spec(self, batch: DataProto, value_head: bool) -> OutputSpec:
        """This call's outputs: the config's temperature unless batch.meta_info overrides it. A greedy rollout's
        (temperature 0) log-probs are of the logits as they are, as vLLM reports them."""
        temperature = float(batch.meta_info.get(keys.META_TEMPERATURE, self.config.temperature))
        if temperature < GREEDY_TEMPERATURE:
            temperature = 1.0
        return OutputSpec(value_head, temperature, bool(self.config.compute_entropy))

    def outputs(self, micro: MicroBatch, head_output: torch.Tensor, spec: OutputSpec) -> dict[str, torch.Tensor]:
        """The micro-batch's per-response-token outputs ([b, T_resp] each) from the head's output."""
        return per_token_outputs(micro, head_output, self.arch, spec.temperature, spec.value_head, spec.entropy)

    def split(self, batch: DataProto, what: str, routes: RouteCall | None) -> tuple[list[MicroBatch], int]:
        """The batch in micro-batches by the config's plan (fixed rows, token budget or packing), with the routes
        each replays; and the batch's row count."""
        plan = mb.batching_plan(self, batch)
        if not plan.share_prompts:
            return mb.split(batch, plan, self.device, what, routes.routes if routes is not None else None)
        micro_batches, num_rows = split_shared(batch, plan, self.device, what)
        mb.attach_routes(micro_batches, routes.routes if routes is not None else None, self.device)
        return micro_batches, num_rows

    def forward_backward(
        self,
        micro_batches: list[MicroBatch],
        loss_func: LossFunc,
        forward_only: bool,
        routes: RouteCall | None,
        measure: bool = False,
    ) -> list[dict]:
        """Megatron's schedule over the micro-batches (see schedule.forward_backward): the loss_func dicts on the
        last pipeline stage, [] elsewhere. Its memory peak goes to `self.memory` (on a CPU rank when `measure`)."""
        if measure and self.device == "cpu":  # count the scores' buffer in every measured phase, as the plan does
            from megatron.core import parallel_state as mpu

            mpu.get_global_memory_buffer().buffer.clear()
        # Each distinct micro-batch (a token budget's differ in tokens, width and response positions read): the plan
        # takes the largest of theirs (memory_accounting.planned_at_micro_batches).
        shape = {"micro_batches": sorted({_plan_shape(m) for m in micro_batches}), "count": len(micro_batches)}
        # (a MoE rank's experts compute what every EP rank routes to them: the plan is compared at the load measured)
        expert_load = ExpertLoad(self.chunks) if measure and self.arch.moe is not None else None
        with self.memory.measure("forward" if forward_only else "train", measure, shape):
            try:
                return schedule.forward_backward(
                    self.chunks, self.capture, micro_batches, forward_only, self.mtp_loss, loss_func, routes
                )
            finally:
                if expert_load is not None:
                    expert_load.close()
                    shape["expert_load"] = expert_load.summary()

    # ---- forward only ------------------------------------------------------------------------------------
    def forward(self, batch: DataProto, value_head: bool, what: str) -> DataProto | None:
        """Forward-only per-token outputs of the batch's responses, in its row order (log-probs and entropies, or
        values): a DataProto on the last PP stage, else None. meta_info[META_BASE_MODEL] runs a LoRA model's base;
        a MoE model's recorded routes come back as keys.RECORDED_ROUTES, its route metrics in meta_info."""
        config = self.config
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
            base = lora.adapters_disabled(self.chunks)
        with base:
            return self._forward(batch, self.output_spec(batch, value_head), what)

    def _forward(self, batch: DataProto, spec: OutputSpec, what: str) -> DataProto | None:
        routes = route_call(self, batch, training=False)
        micro_batches, num_rows = self.split(batch, what, routes)

        def collect(micro: MicroBatch, head_output: torch.Tensor):
            outputs = self.outputs(micro, head_output, spec)
            return torch.zeros((), device=head_output.device), {k: v.detach() for k, v in outputs.items()}

        set_train_mode(self.chunks, False)
        with torch.no_grad():
            stored = self.forward_backward(micro_batches, collect, True, routes, measures_memory(batch))
            recorded = self._recorded_routes(routes, micro_batches, batch) if routes is not None else None
        metrics = routes.replayer.pop_metrics("moe/log_probs_") if routes is not None else {}
        for micro in micro_batches:
            for name, count in micro.token_counts().items():
                metrics[name] = metrics.get(name, 0.0) + count
        if not schedule.is_last_stage():
            return None
        tensors = mb.collect_rows(micro_batches, stored, num_rows)
        if recorded is not None:
            tensors[keys.RECORDED_ROUTES] = recorded
        return DataProto.from_dict(tensors=tensors, meta_info={keys.META_METRICS: metrics})

    def _recorded_routes(self, routes: RouteCall, micro_batches: list[MicroBatch], batch: DataProto):
        """[B, T, L, k] the live routes of a recording forward at each token of the batch (-1 at padding), every
        stage's layers joined; None when the call did not record."""
        if not routes.record:
            return None
        per_micro = [
            routes.replayer.recorded_micro_routes(i, tuple(micro.input_ids.shape))
            for i, micro in enumerate(micro_batches)
        ]
        attention = batch.batch[keys.ATTENTION_MASK]
        shape = (*attention.shape, routes.replayer.num_layers, routes.replayer.topk)
        placed = mb.place_per_token(micro_batches, per_micro, shape, -1)
        placed = join_stages(placed, self.device)
        return placed.masked_fill(~attention.bool()[..., None, None], -1)


def _plan_shape(micro: MicroBatch) -> tuple[int, int, int, int, bool]:
    """(rows, width, response width, sequences, response positions gathered) of a micro-batch, as the plan reads it
    (a packed row holds several sequences)."""
    rows, width = micro.input_ids.shape
    sequences, response_width = micro.responses.shape
    return rows, width, response_width, sequences, micro.gather is not None
