"""Hugging Face <-> Megatron weight conversion for Qwen2/Llama-family models, with TP sharding and PP stages.

Layout facts (megatron-core local and TE specs):
- `linear_qkv` is, per kv group, [that group's q heads, k, v]; TP splits it by whole groups.
- `linear_fc1` is [gate; up]; under TP gate and up are split separately, so each rank holds [gate_r; up_r].
- `linear_proj` and `linear_fc2` are row-parallel (split on dim 1); embedding and output on the vocab dim.
MTP layers map to `model.mtp_layers.{i}.*` (see mtp.py); a folder without them gets them initialised from
the seed, the same at every layout. A critic's value head has no Hugging Face causal-LM counterpart: it keeps its
initialisation on load, or loads the `score` head of a *ForSequenceClassification reward model (one label, no bias;
the value head's bias stays 0); weight sync skips it, and an HF export writes its weight as that `score` head
(`include_value_head`). Qwen3's q/k norms and the mixture-of-experts parameters (router, shared expert, routed
experts split over EP and ETP) are mapped in `moe_convert`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from roll_backend.strategies.megatron import lora, moe_convert, mtp
from roll_backend.strategies.megatron.builder import HFArch
from roll_backend.strategies.megatron.hf_files import SCORE_HEAD, SafetensorsReader, score_head_problem
from roll_backend.strategies.megatron.layers import ValueHead

logger = logging.getLogger(__name__)

# Megatron suffix inside a decoder layer -> (kind, HF suffixes inside `model.layers.{i}.`).
LAYER_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),  # TE spec
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),  # TE spec
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter of this stage and the HF tensors it is made of."""

    megatron_name: str
    kind: str  # replicated | qkv | row | gate_up | vocab | mtp_input_proj
    hf_names: tuple[str, ...]
    expert: bool = False  # a routed expert's weight: split over expert-tensor-parallel ranks, one expert per EP slot


def param_mapping(
    megatron_name: str, arch: HFArch, layer_offset: int, first_local_expert: int = 0
) -> ParamMapping | None:
    """The HF counterpart of a Megatron parameter name (local layer index + `layer_offset`, local expert index +
    `first_local_expert`); None if it has none."""
    if megatron_name == "embedding.word_embeddings.weight":
        return ParamMapping(megatron_name, "vocab", ("model.embed_tokens.weight",))
    if megatron_name == "output_layer.weight":
        source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return ParamMapping(megatron_name, "vocab", (source,))
    if megatron_name == "decoder.final_layernorm.weight":
        return ParamMapping(megatron_name, "replicated", ("model.norm.weight",))
    mtp_mapping = mtp.mtp_param_mapping(megatron_name, LAYER_MAP)
    if mtp_mapping is not None:
        return ParamMapping(megatron_name, *mtp_mapping)
    match = _LAYER_RE.match(megatron_name)
    if match is None:
        return None
    prefix = f"model.layers.{layer_offset + int(match.group(1))}."
    suffix = match.group(2)
    if suffix in LAYER_MAP or suffix in moe_convert.LAYER_MAP:
        kind, suffixes = LAYER_MAP.get(suffix) or moe_convert.LAYER_MAP[suffix]
        return ParamMapping(megatron_name, kind, tuple(prefix + s for s in suffixes))
    expert = moe_convert.expert_mapping(suffix, prefix, first_local_expert)
    if expert is not None:
        return ParamMapping(megatron_name, expert[0], expert[1], expert=True)
    return None


def _mapped(
    model, megatron_name: str, arch: HFArch, offset: int, first_expert: int = 0, include_value_head: bool = False
) -> ParamMapping | None:
    """param_mapping, except for a critic's value head (which replaces the LM head): with `include_value_head` its
    weight is a *ForSequenceClassification model's `score.weight` [1, H] (replicated over TP); else, and always for
    its bias (the score head has none), no HF counterpart."""
    if megatron_name.startswith("output_layer.") and isinstance(getattr(model, "output_layer", None), ValueHead):
        if include_value_head and megatron_name == "output_layer.weight":
            return ParamMapping(megatron_name, "replicated", (SCORE_HEAD,))
        return None
    return param_mapping(megatron_name, arch, offset, first_expert)


def stage_layer_offset(model) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def shard_from_hf(
    kind: str, hf_tensors: list[torch.Tensor], arch: HFArch, tp_rank: int, tp_size: int, swap_gate_up: bool = False
) -> torch.Tensor:
    """HF tensors -> this TP rank's shard of the Megatron parameter."""
    if kind == "replicated":
        return hf_tensors[0]
    if kind == "row":
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "vocab":
        full = hf_tensors[0]
        padded = arch.padded_vocab_size(tp_size)
        if padded > full.shape[0]:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "gate_up":
        gate, up = hf_tensors
        if swap_gate_up:  # deliberately wrong mapping, used only by a test that proves parity tests catch it
            gate, up = up, gate
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    if kind == "mtp_input_proj":  # column-parallel; HF's input halves are Megatron's swapped
        return mtp.swap_input_halves(hf_tensors[0]).chunk(tp_size, dim=0)[tp_rank]
    if kind == "qkv":
        q, k, v = hf_tensors
        groups, d = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
        )
        return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *rest)
    raise ValueError(f"unknown parameter kind {kind!r}")


def hf_from_shards(kind: str, shards: list[torch.Tensor], arch: HFArch) -> list[torch.Tensor]:
    """All TP shards of a Megatron parameter (in TP rank order) -> the full HF tensors."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == "mtp_input_proj":
        return [mtp.swap_input_halves(torch.cat(shards, dim=0))]
    if kind == "qkv":
        groups, d = arch.num_kv_heads, arch.head_dim
        q_width = arch.num_heads // groups * d
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        per_group = full.reshape(groups, q_width + 2 * d, *rest)
        q, k, v = per_group.split([q_width, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    raise ValueError(f"unknown parameter kind {kind!r}")


def _full_hf_shapes(mapping: ParamMapping, param: torch.Tensor, arch: HFArch, tp_size: int) -> list[tuple[int, ...]]:
    """Shapes of the full HF tensors behind this rank's shard `param` (computed on meta tensors)."""
    fake = torch.empty(param.shape, dtype=param.dtype, device="meta")
    shards = [fake] if mapping.kind == "replicated" else [fake] * tp_size
    return [tuple(t.shape) for t in hf_from_shards(mapping.kind, shards, arch)]


def _hf_sources(
    reader: SafetensorsReader,
    mapping: ParamMapping,
    param: torch.Tensor,
    arch: HFArch,
    tp_size: int,
    seed: int,
    model_config,
) -> tuple[list[torch.Tensor], bool]:
    """The full HF tensors of one parameter and whether they were freshly initialised (MTP weights the folder lacks)."""
    present = [n in reader for n in mapping.hf_names]
    if all(present) or not mtp.is_mtp_param(mapping.megatron_name):
        return [reader.get(n) for n in mapping.hf_names], False
    if any(present):
        raise ValueError(
            f"the checkpoint at {reader.model_dir} has only some of {list(mapping.hf_names)}; "
            "an MTP parameter needs all of them or none (none: initialised from the seed)"
        )
    shapes = _full_hf_shapes(mapping, param, arch, tp_size)
    return [
        mtp.initial_hf_tensor(n, shape, seed, model_config.init_method_std, model_config.num_layers)
        for n, shape in zip(mapping.hf_names, shapes)
    ], True


@torch.no_grad()
def load_hf_weights(
    model,
    model_dir: str | Path,
    arch: HFArch,
    tp_rank: int,
    tp_size: int,
    swap_gate_up: bool = False,
    etp_rank: int | None = None,
    etp_size: int | None = None,
    seed: int = 0,
    value_head_from_score: bool = False,
) -> list[str]:
    """Copy HF weights into this rank's stage `model` (an unwrapped GPTModel); returns the names left as initialised.

    Routed experts are split over the expert-tensor-parallel ranks (`etp_rank`/`etp_size`, default: TP's). MTP
    weights the folder does not carry are initialised from `seed` on their full shape (see mtp.py).
    `value_head_from_score`: the value head (last stage) takes the reward model's `score.weight` (replicated over TP);
    else it starts from `seed` on its full shape, the same at every layout.
    """
    reader = SafetensorsReader(model_dir)
    offset = stage_layer_offset(model)
    first_expert = moe_convert.first_local_expert(model)
    untouched, fresh = [], []
    for name, param in model.named_parameters():
        if name == "output_layer.weight" and isinstance(model.output_layer, ValueHead):
            param.copy_(_value_head_weight(reader, model_dir, value_head_from_score, param, seed, model.config))
            continue
        mapping = _mapped(model, name, arch, offset, first_expert)
        if mapping is None:
            untouched.append(name)
            continue
        rank, size = (tp_rank, tp_size) if not mapping.expert or etp_size is None else (etp_rank, etp_size)
        hf_tensors, initialised = _hf_sources(reader, mapping, param, arch, tp_size, seed, model.config)
        if initialised:
            fresh.append(name)
        shard = shard_from_hf(mapping.kind, hf_tensors, arch, rank, size, swap_gate_up)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: converted shard has shape {tuple(shard.shape)}, the model expects {tuple(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))
    if untouched:
        logger.info("parameters without a Hugging Face counterpart keep their initialisation: %s", untouched)
    if fresh:
        logger.info("MTP parameters not in %s, initialised from seed %d: %s", model_dir, seed, fresh)
    return untouched


def _value_head_weight(reader, model_dir: str, from_score: bool, param, seed: int, config) -> torch.Tensor:
    """The reward model's `score.weight`, or a fresh draw seeded by (seed, name) on the full [1, H] shape: Megatron's
    own initialisation would depend on how much of the random stream the rank's other layers used (TP, PP)."""
    if from_score:
        problem = score_head_problem(model_dir)
        if problem:
            raise ValueError(problem)
        return reader.get(SCORE_HEAD).to(param.dtype)
    return mtp.seeded_normal("value_head.weight", tuple(param.shape), seed, config.init_method_std).to(param.dtype)


def export_mappings(
    model, arch: HFArch, include_mtp: bool = False, include_value_head: bool = False
) -> list[ParamMapping]:
    """The parameters of this stage that go to a HF checkpoint: a tied output layer is left to the embedding, the
    embedding copy an MTP stage keeps at PP > 1 to the first stage, MTP layers only with `include_mtp` and a value
    head (as `score.weight`) only with `include_value_head`."""
    offset = stage_layer_offset(model)
    first_expert = moe_convert.first_local_expert(model)
    mappings = []
    for name, _ in model.named_parameters():
        mapping = _mapped(model, name, arch, offset, first_expert, include_value_head)
        if mapping is None:
            continue
        if name == "output_layer.weight" and mapping.kind == "vocab" and arch.tie_word_embeddings:
            continue
        if name == "embedding.word_embeddings.weight" and not model.pre_process:
            continue
        if mtp.is_mtp_param(name) and not include_mtp:
            continue
        mappings.append(mapping)
    return mappings


Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def _single(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def iter_stage_hf_tensors(
    model,
    arch: HFArch,
    all_gather_tp: Gather,
    all_gather_etp: Gather = _single,
    all_gather_ep: Gather = _single,
    ep_size: int = 1,
    include_mtp: bool = False,
    include_value_head: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of this stage; each `all_gather_*(shard)` returns every rank's shard of its group
    (TP, expert TP, expert parallel) in rank order. Routed experts come out for every EP rank; MTP layers
    only with `include_mtp`, a value head only with `include_value_head` (see export_mappings)."""
    params = dict(model.named_parameters())
    for mapping in export_mappings(model, arch, include_mtp, include_value_head):
        # (with LoRA adapters, the base weight merged with their update; the base itself is left as it is)
        shard = lora.merged_shard(model, mapping.megatron_name, params[mapping.megatron_name].detach())
        gather = all_gather_etp if mapping.expert else all_gather_tp
        full = hf_from_shards(mapping.kind, [shard] if mapping.kind == "replicated" else gather(shard), arch)
        del shard  # (a merged base and the gathered shards go before the tensors are handed on: sync_plan.py)
        if mapping.expert:
            yield from moe_convert.gather_expert_tensors(
                mapping.hf_names, full, arch.moe.num_experts // ep_size, all_gather_ep
            )
        else:
            yield from zip(mapping.hf_names, full)
        del full  # (what the consumer let go of goes now, not after the next parameter is made)


def stage_hf_metadata(
    model,
    arch: HFArch,
    tp_size: int,
    etp_size: int = 1,
    ep_size: int = 1,
    include_mtp: bool = False,
    include_value_head: bool = False,
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the HF tensors `iter_stage_hf_tensors` yields, computed without communication."""
    params = dict(model.named_parameters())
    meta = []
    for mapping in export_mappings(model, arch, include_mtp, include_value_head):
        param = params[mapping.megatron_name]
        fake = torch.empty(param.shape, dtype=param.dtype, device="meta")
        parts = etp_size if mapping.expert else tp_size
        shards = [fake] if mapping.kind == "replicated" else [fake] * parts
        full = hf_from_shards(mapping.kind, shards, arch)
        if mapping.expert:
            gather_ep = lambda tensor: [tensor] * ep_size  # noqa: E731 (shapes only)
            named = list(
                moe_convert.gather_expert_tensors(mapping.hf_names, full, arch.moe.num_experts // ep_size, gather_ep)
            )
        else:
            named = list(zip(mapping.hf_names, full))
        meta.extend((hf_name, tuple(tensor.shape), param.dtype) for hf_name, tensor in named)
    return meta
