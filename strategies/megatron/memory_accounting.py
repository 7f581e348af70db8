"""The memory plan of a Megatron rank, before anything starts: its parameters counted from the Hugging Face config at
its layout, the model state they make (gradients, Adam's state, sharded by the distributed optimizer; a LoRA base
frozen), and the activations of its largest micro-batch under the pipeline schedule.

Parameters are counted as builder.py builds them (embedding and output layer padded to a multiple of TP, norms
replicated, routed experts split over EP and ETP, MTP layers and value heads on the last stage), so the plan's model
state is the measured one. Activations are what one layer keeps for backward, counted tensor by tensor:

- the local spec (CPU, or a GPU without TransformerEngine; `local_layer`), derived from what its modules save and
  checked against the tensors a CPU rank counts (tests/strategies/megatron/test_memory_plan.py): two RMSNorms (their
  scaled output and the input times its inverse root), two residuals, the attention's query after RoPE, key and
  value repeated to every query head (GQA) or the fused QKV output, its context, the float32 softmax of the scores
  (batch x heads x sequence^2: the local spec's attention is not flash attention), and the SwiGLU MLP's fc1 output,
  activation, product (or the routed experts' permuted tokens and their MLPs);
- TransformerEngine (`te_layer`): the same layer with fused norms and flash attention (no scores kept), counted the
  same way from TE's saved tensors; not measured here (no GPU in the suite), so marked an estimate.

On top of a micro-batch's layers, the last stage holds the head's buffers: the logits and, at the end of forward,
the float32 log-prob / entropy buffers of the response positions (vocab-parallel: V/TP wide), or in the head's
backward the logits' gradient and the output layer's weight gradient; the peak is the larger. Pipeline schedules keep
several micro-batches in flight (1F1B: pp - stage on a stage; interleaved: Megatron's warm-up count of chunks).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roll_backend import roles
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.strategies.megatron.activation_plan import (
    DTYPE_BYTES,
    FP32,
    MicroShape,
    PlanOptions,
    activation_terms,
)
from roll_backend.strategies.megatron.builder import HFArch, flex_attention_for
from roll_backend.strategies.megatron.moe import token_dispatcher_type
from roll_backend.strategies.megatron.stage_splits import default_stage_split

ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq, float32 each


def arch_of(fields: Mapping[str, Any]) -> HFArch:
    """The architecture of a Hugging Face config's fields (config.json as a dict)."""
    defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "vocab_size": 32000}
    aliases = {"num_experts": fields.get("num_local_experts")}  # (transformers 5 writes Qwen3-MoE's so)
    known = {name: value for name, value in aliases.items() if value is not None and name not in fields}
    return HFArch.from_hf_config(types.SimpleNamespace(**{**defaults, **known, **fields}))


@dataclass(frozen=True)
class StageParams:
    """Parameter counts of one pipeline rank: all it holds, those that train, and of each the routed experts'."""

    total: int
    trainable: int
    expert_total: int = 0
    expert_trainable: int = 0


# ---- parameters -----------------------------------------------------------------------------------------------
def layers_per_stage(num_layers: int, layout: ParallelLayout, first: int | None, last: int | None) -> list[int]:
    """Decoder layers on each pipeline rank (all its vpp chunks together)."""
    pp = layout.pp
    if first is None and last is None:
        first, last = default_stage_split(num_layers, pp, layout.vpp)
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        return [num_layers // pp] * pp
    first = num_layers // pp if first is None else first
    last = num_layers // pp if last is None else last
    middle = (num_layers - first - last) // (pp - 2) if pp > 2 else 0
    return [first, *[middle] * (pp - 2), last]


def _lora_count(arch: HFArch, lora, tp: int, etp: int, ep: int, experts: bool) -> tuple[int, int]:
    """LoRA adapter parameters of one decoder layer on a rank: (dense part, routed experts' part); lora.py's shapes
    (column bases: A whole, B split; row bases: A split, B whole)."""
    r, h = lora.rank, arch.hidden_size
    targets = set(lora.target_modules)
    out = {"q_proj": arch.num_heads * arch.head_dim, "k_proj": arch.num_kv_heads * arch.head_dim}
    out["v_proj"] = out["k_proj"]
    dense = sum(r * h + out[m] // tp * r for m in ("q_proj", "k_proj", "v_proj") if m in targets)
    if "o_proj" in targets:
        dense += r * arch.num_heads * arch.head_dim // tp + h * r

    def mlp(ffn: int, split: int) -> int:
        count = sum(r * h + ffn // split * r for m in ("gate_proj", "up_proj") if m in targets)
        return count + (r * ffn // split + h * r if "down_proj" in targets else 0)

    moe = arch.moe
    if moe is None:
        return dense + mlp(arch.ffn_hidden_size, tp), 0
    shared = mlp(moe.shared_expert_ffn_hidden_size, tp) if moe.shared_expert_ffn_hidden_size else 0
    routed = moe.num_experts // ep * mlp(moe.expert_ffn_hidden_size, etp) if experts else 0
    return dense + shared, routed


def layer_params(arch: HFArch, layout: ParallelLayout) -> tuple[int, int]:
    """(dense, routed-expert) parameters of one decoder layer on a rank."""
    h, d, tp = arch.hidden_size, arch.head_dim, layout.tp
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    dense = 2 * h + h * qkv // tp + (qkv // tp if arch.qkv_bias else 0) + arch.num_heads * d * h // tp
    dense += 2 * d if arch.qk_norm else 0
    moe = arch.moe
    if moe is None:
        return dense + 3 * h * arch.ffn_hidden_size // tp, 0
    dense += moe.num_experts * h  # the router, replicated
    if moe.shared_expert_ffn_hidden_size:
        dense += 3 * h * moe.shared_expert_ffn_hidden_size // tp + h  # the shared expert and its gate
    routed = moe.num_experts // layout.ep * 3 * h * moe.expert_ffn_hidden_size // layout.expert_tp
    return dense, routed


def stage_params(
    arch: HFArch, layout: ParallelLayout, layers: int, stage: int, value_head: bool, mtp_layers: int, lora
) -> StageParams:
    """Parameters of pipeline rank `stage` holding `layers` decoder layers."""
    h, tp = arch.hidden_size, layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    vocab = arch.padded_vocab_size(tp) // tp * h
    dense, routed = layer_params(arch, layout)
    body = layers + (mtp_layers if last else 0)
    total_dense = body * dense + (vocab if first else 0)
    if last:
        total_dense += h  # final norm
        if value_head:
            total_dense += h + 1
        elif not (arch.tie_word_embeddings and first):
            total_dense += vocab  # the output layer (with pp > 1 a tied model keeps a copy on the last stage)
        total_dense += mtp_layers * (2 * h + 2 * h * h // tp + h)  # each MTP depth's norms, input projection, norm
        if mtp_layers and not first and not arch.tie_word_embeddings:
            total_dense += vocab  # the embedding the MTP depths read the next tokens through (tied: the output's)
    total_routed = body * routed
    if lora is None:
        return StageParams(total_dense + total_routed, total_dense + total_routed, total_routed, total_routed)
    lora_dense, lora_routed = _lora_count(arch, lora, tp, layout.expert_tp, layout.ep, experts=arch.moe is not None)
    trained_dense = body * lora_dense + (h + 1 if value_head and last else 0)
    trained_routed = body * lora_routed
    return StageParams(
        total_dense + total_routed + trained_dense + trained_routed,
        trained_dense + trained_routed,
        total_routed + trained_routed,
        trained_routed,
    )


def model_state(
    params: StageParams, params_dtype: str, trains: bool, distributed_optimizer: bool, layout: ParallelLayout, world
) -> dict[str, int]:
    """Bytes of a rank's parameters, gradients (DDP's float32 buffer) and optimizer state (Adam's moments, and float32
    main copies of 16-bit parameters; a 1/DP shard of each with the distributed optimizer)."""
    width = DTYPE_BYTES[params_dtype]
    state = {"params": params.total * width, "grads": 0, "optimizer": 0}
    if not trains:
        return state
    state["grads"] = params.trainable * FP32
    per_param = ADAM_MOMENTS * FP32 + (FP32 if width != FP32 else 0)
    dense = params.trainable - params.expert_trainable
    dp = max(1, world // (layout.tp * layout.pp * layout.cp))
    expert_dp = max(1, world // (layout.expert_tp * layout.ep * layout.pp))
    shards = (dp, expert_dp) if distributed_optimizer else (1, 1)
    state["optimizer"] = math.ceil(dense * per_param / shards[0]) + math.ceil(
        params.expert_trainable * per_param / shards[1]
    )
    return state


def plans_transformer_engine(cfg, device: str) -> bool:
    """Whether the ranks will run TransformerEngine's layers, as builder.transformer_engine_for decides on the rank:
    on a GPU `auto` is taken to find TE installed there (the driver planning may not have it)."""
    if cfg.transformer_impl == "local" or getattr(cfg, "share_prompts", False):
        return False
    return device == "cuda"


def plan_options(cfg, arch: HFArch, layout: ParallelLayout, device: str, trains: bool):
    """The activation plan's view of a Megatron config (activation_plan.PlanOptions)."""
    return PlanOptions(
        gathering_dispatcher=token_dispatcher_type(device) == "allgather",
        params_dtype=cfg.params_dtype,
        lora=getattr(cfg, "lora", None) is not None,
        value_head=cfg.value_head,
        recompute=trains and getattr(cfg, "recompute_activations", False),
        entropy=bool(cfg.compute_entropy),
        mtp_layers=cfg.mtp_num_layers,
        transformer_engine=plans_transformer_engine(cfg, device),
        flex_attention=flex_attention_for(cfg, device),
        sequence_parallel=layout.tp > 1 and (arch.moe is not None or bool(cfg.sequence_parallel)),  # (builder.py)
    )


def plan_stage(
    cfg,
    arch: HFArch,
    layout: ParallelLayout,
    world: int,
    device: str,
    stage: int,
    micro: MicroShape,
    micro_batches: int,
    sync=None,
    routing: Mapping[str, float] | None = None,
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(model state by part, {phase: its terms}) of pipeline rank `stage` of a role running Megatron config `cfg`:
    a training config's "train" and "forward" phases, a forward-only one's "forward", and "weight_sync" where the
    run (`sync`: its RunFacts) has the role send weights to a rollout engine; a MoE model's experts at `routing`
    (PlanOptions' expert_load and expert_skew; by default balanced over EP, a busy expert twice its share)."""
    from roll_backend.strategies.megatron.stage_splits import stage_split

    trains = hasattr(cfg, "optimizer")
    first, last = stage_split(cfg, arch.num_layers, layout)
    layers = layers_per_stage(arch.num_layers, layout, first, last)[stage]
    lora = getattr(cfg, "lora", None)
    params = stage_params(arch, layout, layers, stage, cfg.value_head, cfg.mtp_num_layers, lora)
    distributed = trains and cfg.optimizer.use_distributed_optimizer
    state = model_state(params, cfg.params_dtype, trains, distributed, layout, world)
    options = dataclasses.replace(plan_options(cfg, arch, layout, device, trains), **(routing or {}))
    phases = {"forward": activation_terms(arch, layout, micro, options, layers, stage, micro_batches, False)}
    if trains:
        phases["train"] = activation_terms(arch, layout, micro, options, layers, stage, micro_batches, True)
    if sync is not None and sync.weight_sync_bucket:
        phases[roles.WEIGHT_SYNC] = weight_sync_terms(cfg, arch, layout, stage, sync, device)
    return state, phases


def largest_hf_tensor(arch: HFArch) -> int:
    """Elements of the model's largest Hugging Face tensor (the embedding, an MLP projection, a fused attention
    projection's widest part or one expert's projection)."""
    h = arch.hidden_size
    widths = [arch.vocab_size, arch.ffn_hidden_size, arch.num_heads * arch.head_dim]
    if arch.moe is not None:
        widths += [arch.moe.expert_ffn_hidden_size, arch.moe.shared_expert_ffn_hidden_size or 0]
    return max(widths) * h


def weight_sync_terms(cfg, arch: HFArch, layout: ParallelLayout, stage: int, run, device: str) -> dict[str, int]:
    """Pipeline rank `stage`'s transient bytes while it sends its weights to the rollout (iter_hf_weights): a bucket
    of full Hugging Face tensors and what making the next one takes (sync_plan.py), and
    with the minimal sync on a GPU the comparison on the device of the largest tensor with the copy the engine holds
    (brought up from host memory) and a one-byte mask per element."""
    from roll_backend.strategies.megatron.stage_splits import stage_split
    from roll_backend.strategies.megatron.sync_plan import sync_peak, sync_sequence

    layers = layers_per_stage(arch.num_layers, layout, *stage_split(cfg, arch.num_layers, layout))
    lora = getattr(cfg, "lora", None)
    targets = frozenset(lora.target_modules) if lora is not None else frozenset()
    sequence = sync_sequence(arch, layout, layers, stage, cfg.params_dtype, targets)
    terms = {"weight-sync bucket": sync_peak(sequence, run.weight_sync_bucket)}
    if run.weight_sync_delta and device == "cuda":
        terms["weight-sync comparison"] = largest_hf_tensor(arch) * (DTYPE_BYTES[cfg.params_dtype] + 1)
    return terms


HINTS = {
    "params": "tp / pp (ep, etp for experts) shard it; params_dtype: bfloat16 halves it",
    "grads": "tp / pp shard it; lora trains adapters only",
    "optimizer": "optimizer.use_distributed_optimizer: true shards it over data parallelism; lora trains adapters only",
    "activations": (
        "micro_batch_size / max_tokens_per_microbatch; recompute_activations: true; tp, cp (and pp) split it"
    ),
    "logits and log-prob buffers": "micro_batch_size / max_tokens_per_microbatch; tp splits the vocabulary",
    "a layer's backward": (
        "micro_batch_size / max_tokens_per_microbatch; tp; at long sequences cp, or transformer_impl: "
        "transformer_engine (its attention's backward keeps no [sq, sk] scores)"
    ),
    "attention scores buffer": "transformer_impl: transformer_engine (flash attention keeps no scores); cp",
    "MTP heads": "mtp_num_layers; micro_batch_size / max_tokens_per_microbatch",
    "the embedding's weight gradient": "tp splits the vocabulary; lora leaves the embedding frozen",
    "weight-sync bucket": "weight_sync_bucket_bytes (a tensor bigger than it still goes whole)",
    "weight-sync comparison": "weight_sync_delta: false sends whole tensors without comparing",
}


def planned_micro_shape(cfg, run) -> MicroShape:
    """The largest micro-batch a run gives this config: rows of the longest prompt + response (rounded as the
    micro-batches round their width), as many as micro_batch_size or the token budget allow; packed, one row of the
    budget."""
    from roll_backend.strategies.megatron.micro_batches import SEQUENCE_MULTIPLE, round_up

    multiple = math.lcm(SEQUENCE_MULTIPLE, 2 * run.layout.cp)  # (as micro_batches.batching_plan rounds)
    width = round_up((run.max_prompt_length or 0) + run.response_length, multiple)
    budget = cfg.max_tokens_per_microbatch
    if budget is None:
        return MicroShape(cfg.micro_batch_size, width, run.response_length)
    if cfg.use_sequence_packing:
        packed = round_up(budget, multiple)
        sequences = max(1, packed // width)
        return MicroShape(1, packed, run.response_length, packed=True, sequences=sequences, gathered=True)
    return MicroShape(max(1, budget // width), width, run.response_length, gathered=True)


def plan(cfg, run) -> list:
    """A Megatron config's memory plan in this run (MemoryPlanner.plan): one RankMemory per pipeline stage."""
    from roll_backend.strategies.base import RankMemory, host_weight_copy_note

    if not run.model_config:
        return []
    try:
        arch = arch_of(run.model_config)
    except (ValueError, AttributeError, KeyError):  # a model the backend cannot build: its own check says why
        return []
    layout, world = run.layout, run.world_size
    micro = planned_micro_shape(cfg, run)
    dp = max(1, world // (layout.tp * layout.pp * layout.cp))
    per_rank = -(-(run.train_batch_size or micro.rows) // dp)
    micro_batches = max(1, -(-per_rank // micro.rows))
    notes = [f"largest micro-batch {micro.rows} x {micro.width} tokens" + (" (packed)" if micro.packed else "")]
    if run.max_prompt_length is None:
        notes.append("data.max_prompt_length is not set: prompts counted as 0 tokens")
    if plans_transformer_engine(cfg, run.device):
        notes.append(
            "activations of TransformerEngine's layers (an estimate: the suite measures the local spec on CPU); "
            "without TE on the GPUs the local spec also keeps the attention scores"
        )
    whole = stage_params(arch, ParallelLayout(), arch.num_layers, 0, False, 0, None).total
    copy_note = host_weight_copy_note(run, whole * DTYPE_BYTES[cfg.params_dtype])
    notes += [copy_note] if copy_note else []
    if arch.moe is not None and layout.ep > 1:
        notes.append(
            f"experts planned at {run.expert_load:g}x the tokens a rank's own tokens route (1 = balanced routing); "
            "a skewed router sends one rank's experts more: memory_plan_expert_load plans that (the run logs the "
            "load measured at step 1)"
        )
    hints = dict(HINTS)
    if getattr(getattr(cfg, "optimizer", None), "use_distributed_optimizer", False):
        hints["optimizer"] = "more data-parallel ranks shard it further (the distributed optimizer is on)"
    plans = []
    for stage in range(layout.pp):
        state, phases = plan_stage(
            cfg, arch, layout, world, run.device, stage, micro, micro_batches, run, {"expert_load": run.expert_load}
        )
        ranks = "every rank" if layout.pp == 1 else f"pp stage {stage} of {layout.pp}"
        plans.append(RankMemory(ranks, state, phases, cfg.offloaded_parts, hints=hints, notes=tuple(notes)))
    return plans


def measured_micro_shapes(shape) -> tuple[list[MicroShape], int]:
    """(the distinct micro-batches, the call's micro-batch count) a rank recorded (MegatronEngine.forward_backward)."""
    micros = [
        MicroShape(rows, width, response_width, sequences=sequences, gathered=bool(gathered))
        for rows, width, response_width, sequences, gathered in shape["micro_batches"]
    ]
    return micros, shape["count"]


def measured_routing(shape, phase: str) -> dict[str, float]:
    """The routing a rank measured in a phase (moe.ExpertLoad) as the plan of that phase takes it (PlanOptions'
    expert_load and expert_skew): a forward without gradients peaks inside one layer (the busiest), a train phase
    keeps every layer's (their mean); nothing for a dense model."""
    load = shape.get("expert_load")
    if not load:
        return {}
    return {"expert_load": load["busiest" if phase == "forward" else "mean"], "expert_skew": load["skew"]}


def planned_at_micro_batches(cfg, arch, layout, world, device, stage, shape, phase) -> tuple[dict, dict[str, int]]:
    """(model state, `phase`'s terms) planned at the micro-batches of a recorded `shape`: each runs on its own, so the
    phase's peak is that of the one whose plan is largest (the widest body and the most response positions read may
    belong to different ones)."""
    micros, count = measured_micro_shapes(shape)
    routing = measured_routing(shape, phase)
    plans = [plan_stage(cfg, arch, layout, world, device, stage, micro, count, routing=routing) for micro in micros]
    state, phases = max(plans, key=lambda plan: sum(plan[1][phase].values()))
    return state, phases[phase]


def planned_at(cfg, run, measured) -> dict[str, int]:
    """The plan of the rank that measured `measured` (StrategyWorker.measured_memory) at the micro-batches that ran:
    {"model_state": bytes, <phase>: bytes on top}."""
    arch = arch_of(run.model_config)
    out = {}
    for phase, shape in measured["micro_batches"].items():
        if phase == roles.WEIGHT_SYNC:  # at the bucket size the sync ran with
            at = dataclasses.replace(run, weight_sync_bucket=shape["bucket_bytes"])
            terms = weight_sync_terms(cfg, arch, run.layout, measured["pp_rank"], at, run.device)
            out[phase] = sum(terms.values())
            continue
        state, terms = planned_at_micro_batches(
            cfg, arch, run.layout, run.world_size, run.device, measured["pp_rank"], shape, phase
        )
        out["model_state"], out[phase] = sum(state.values()), sum(terms.values())
    return out


def problems(cfg, run, planned: list) -> list[str]:
    """(A Megatron rank has no rule of its own beyond fitting the device, which the run's plan checks.)"""
    return []
