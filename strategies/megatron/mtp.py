"""Multi-token prediction (MTP) weights: their Hugging Face names and an initialisation that no layout changes.

HF naming follows Xiaomi MiMo's public MTP checkpoints (the layout vLLM's `mimo_mtp` model loads): Megatron's
`mtp.layers.{i}.` becomes `model.mtp_layers.{i}.` with
- `enorm` (norm of the next tokens' embedding)  -> `token_layernorm`
- `hnorm` (norm of the previous hidden state)   -> `hidden_layernorm`
- `eh_proj` [H, 2H] applied to cat(embedding, hidden) -> `input_proj` [H, 2H] applied to cat(hidden, embedding):
  the same matrix with its two input halves swapped
- `transformer_layer.*` -> the decoder layer's names (`self_attn.*`, `mlp.*`, `input_layernorm`,
  `post_attention_layernorm`)
- `final_layernorm` -> `final_layernorm`
An exported config carries `num_nextn_predict_layers` (MiMo's key for the number of MTP layers).

Initialisation: an MTP weight the HF folder does not carry is drawn on its full HF shape from a generator seeded
by (seed, HF name), then sharded like a loaded weight. The draw depends on neither TP, PP, CP nor vpp (nor on how
many layers the rank built before), so every layout starts from the same MTP weights. Distribution as Megatron's:
norms 1, biases 0, the residual-branch outputs (o_proj, down_proj) N(0, std / sqrt(2 * num_layers)), the rest
N(0, std).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping

import torch

MEGATRON_PREFIX = "mtp."
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# Megatron suffix inside `mtp.layers.{i}.` -> (kind, HF suffix inside `model.mtp_layers.{i}.`)
_OWN_PARAMS = {
    "enorm.weight": ("replicated", "token_layernorm.weight"),
    "hnorm.weight": ("replicated", "hidden_layernorm.weight"),
    "eh_proj.weight": ("mtp_input_proj", "input_proj.weight"),
    "final_layernorm.weight": ("replicated", "final_layernorm.weight"),
}
_TRANSFORMER_LAYER = "transformer_layer."
HF_CONFIG_KEY = "num_nextn_predict_layers"


def is_mtp_param(megatron_name: str) -> bool:
    return megatron_name.startswith(MEGATRON_PREFIX)


def hf_prefix(depth: int) -> str:
    return f"model.mtp_layers.{depth}."


def mtp_param_mapping(megatron_name: str, decoder_layer_map: Mapping[str, tuple[str, tuple[str, ...]]]):
    """(kind, HF names) of an MTP parameter, or None if `megatron_name` is not one we know. `decoder_layer_map`:
    a decoder layer's Megatron suffix -> (kind, HF suffixes) (convert.LAYER_MAP), which an MTP layer's
    `transformer_layer` shares."""
    match = _MTP_LAYER_RE.match(megatron_name)
    if not match:
        return None
    prefix, suffix = hf_prefix(int(match.group(1))), match.group(2)
    if suffix in _OWN_PARAMS:
        kind, hf_suffix = _OWN_PARAMS[suffix]
        return kind, (prefix + hf_suffix,)
    if suffix.startswith(_TRANSFORMER_LAYER) and suffix[len(_TRANSFORMER_LAYER) :] in decoder_layer_map:
        kind, hf_suffixes = decoder_layer_map[suffix[len(_TRANSFORMER_LAYER) :]]
        return kind, tuple(prefix + s for s in hf_suffixes)
    return None


def swap_input_halves(weight: torch.Tensor) -> torch.Tensor:
    """eh_proj <-> input_proj: swap the two halves of the input dimension (its own inverse)."""
    first, second = weight.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def _seed_for(seed: int, hf_name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(hf_name.encode())) % (2**63)


def seeded_normal(hf_name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """N(0, std) on the full shape from a generator seeded by (seed, name): the same at every layout."""
    generator = torch.Generator().manual_seed(_seed_for(seed, hf_name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def initial_hf_tensor(
    hf_name: str, shape: tuple[int, ...], seed: int, init_std: float, num_layers: int
) -> torch.Tensor:
    """The fresh float32 value of one full HF-named MTP tensor: a function of (seed, name, shape) only."""
    if hf_name.endswith("norm.weight"):
        return torch.ones(shape)
    if hf_name.endswith(".bias"):
        return torch.zeros(shape)
    residual_output = hf_name.endswith(("o_proj.weight", "down_proj.weight"))
    return seeded_normal(hf_name, shape, seed, init_std / math.sqrt(2.0 * num_layers) if residual_output else init_std)


def drop_unused_output_weight(model) -> None:
    """A tied model's MTP stage at PP > 1 computes its logits with the embedding copy it keeps for MTP, yet
    megatron-core 0.16.1 also allocates `output_layer.weight` there: a parameter no forward uses, which
    `tie_embeddings_and_output_weights_state_dict` refuses to checkpoint (it asserts the key is absent).
    Remove it, as the first stage does for a tied output layer."""
    if (
        getattr(model, "mtp_process", False)
        and model.post_process
        and not model.pre_process
        and model.share_embeddings_and_output_weights
        and model.output_layer.weight is not None
    ):
        model.output_layer.weight = None
