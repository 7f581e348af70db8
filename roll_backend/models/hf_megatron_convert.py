"""Hugging Face <-> Megatron weight conversion for Qwen2/Llama-family models, with TP sharding and PP stages.

Layout facts (megatron-core local and TE specs):
- `linear_qkv` is, per kv group, [that group's q heads, k, v]; TP splits it by whole groups.
- `linear_fc1` is [gate; up]; under TP gate and up are split separately, so each rank holds [gate_r; up_r].
- `linear_proj` and `linear_fc2` are row-parallel (split on dim 1); embedding and output on the vocab dim.
MTP layers and a critic's value head have no Hugging Face counterpart: they keep their initialisation on load
and are skipped on export.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from roll_backend.models.megatron_builder import HFArch

logger = logging.getLogger(__name__)

# Megatron suffix inside a decoder layer -> (kind, HF suffixes inside `model.layers.{i}.`).
_LAYER_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),  # TE spec
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
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
    kind: str  # replicated | qkv | row | gate_up | vocab
    hf_names: tuple[str, ...]


def param_mapping(megatron_name: str, arch: HFArch, layer_offset: int) -> ParamMapping | None:
    """The HF counterpart of a Megatron parameter name (local layer index + `layer_offset`); None if it has none."""
    if megatron_name == "embedding.word_embeddings.weight":
        return ParamMapping(megatron_name, "vocab", ("model.embed_tokens.weight",))
    if megatron_name == "output_layer.weight":
        source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return ParamMapping(megatron_name, "vocab", (source,))
    if megatron_name == "decoder.final_layernorm.weight":
        return ParamMapping(megatron_name, "replicated", ("model.norm.weight",))
    match = _LAYER_RE.match(megatron_name)
    if match and match.group(2) in _LAYER_MAP:
        kind, suffixes = _LAYER_MAP[match.group(2)]
        prefix = f"model.layers.{layer_offset + int(match.group(1))}."
        return ParamMapping(megatron_name, kind, tuple(prefix + s for s in suffixes))
    return None


def _mapped(model, megatron_name: str, arch: HFArch, offset: int) -> ParamMapping | None:
    """param_mapping, except that a critic's value head (which replaces the LM head) has no HF counterpart."""
    from roll_backend.models.megatron_builder import ValueHead

    if megatron_name.startswith("output_layer.") and isinstance(getattr(model, "output_layer", None), ValueHead):
        return None
    return param_mapping(megatron_name, arch, offset)


def stage_layer_offset(model) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def shard_from_hf(kind: str, hf_tensors: list[torch.Tensor], arch: HFArch, tp_rank: int, tp_size: int,
                  swap_gate_up: bool = False) -> torch.Tensor:
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
    if kind == "qkv":
        q, k, v = hf_tensors
        groups, d = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1)
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
    if kind == "qkv":
        groups, d = arch.num_kv_heads, arch.head_dim
        q_width = arch.num_heads // groups * d
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        per_group = full.reshape(groups, q_width + 2 * d, *rest)
        q, k, v = per_group.split([q_width, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    raise ValueError(f"unknown parameter kind {kind!r}")


class SafetensorsReader:
    """Reads named tensors lazily from a Hugging Face checkpoint folder (single file or sharded index)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").exists():
            with safe_open(model_dir / "model.safetensors", framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors(.index.json) in {model_dir}; export the model as safetensors.")
        self._dir = model_dir
        self._weight_map = weight_map
        self._open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self._dir}")
        with self._open(self._dir / self._weight_map[name], framework="pt") as f:
            return f.get_tensor(name)


@torch.no_grad()
def load_hf_weights(model, model_dir: str | Path, arch: HFArch, tp_rank: int, tp_size: int,
                    swap_gate_up: bool = False) -> list[str]:
    """Copy HF weights into this rank's stage `model` (an unwrapped GPTModel); returns the names left as initialised."""
    reader = SafetensorsReader(model_dir)
    offset = stage_layer_offset(model)
    untouched = []
    for name, param in model.named_parameters():
        mapping = _mapped(model, name, arch, offset)
        if mapping is None:
            untouched.append(name)
            continue
        shard = shard_from_hf(mapping.kind, [reader.get(n) for n in mapping.hf_names], arch, tp_rank, tp_size, swap_gate_up)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: converted shard has shape {tuple(shard.shape)}, the model expects {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
    if untouched:
        logger.info("parameters without a Hugging Face counterpart keep their initialisation: %s", untouched)
    return untouched


def export_mappings(model, arch: HFArch) -> list[ParamMapping]:
    """The parameters of this stage that go to a HF checkpoint (a tied output layer is left to the embedding)."""
    offset = stage_layer_offset(model)
    mappings = []
    for name, _ in model.named_parameters():
        mapping = _mapped(model, name, arch, offset)
        if mapping is None or (name == "output_layer.weight" and arch.tie_word_embeddings):
            continue
        mappings.append(mapping)
    return mappings


def iter_stage_hf_tensors(model, arch: HFArch, all_gather_tp: Callable[[torch.Tensor], list[torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of this stage; `all_gather_tp(shard)` returns every TP rank's shard in rank order."""
    params = dict(model.named_parameters())
    for mapping in export_mappings(model, arch):
        shard = params[mapping.megatron_name].detach()
        shards = [shard] if mapping.kind == "replicated" else all_gather_tp(shard)
        yield from zip(mapping.hf_names, hf_from_shards(mapping.kind, shards, arch))


def stage_hf_metadata(model, arch: HFArch, tp_size: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the HF tensors `iter_stage_hf_tensors` yields, computed without communication."""
    params = dict(model.named_parameters())
    meta = []
    for mapping in export_mappings(model, arch):
        param = params[mapping.megatron_name]
        fake = torch.empty(param.shape, dtype=param.dtype, device="meta")
        shards = [fake] if mapping.kind == "replicated" else [fake] * tp_size
        for hf_name, tensor in zip(mapping.hf_names, hf_from_shards(mapping.kind, shards, arch)):
            meta.append((hf_name, tuple(tensor.shape), param.dtype))
    return meta
