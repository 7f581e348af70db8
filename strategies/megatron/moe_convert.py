"""Hugging Face <-> Megatron names and layouts of the mixture-of-experts and Qwen3 parameters.

Inside `decoder.layers.{i}.` (megatron-core local spec with SequentialMLP, i.e. moe_grouped_gemm=False):
- `self_attention.{q,k}_layernorm.weight` <- `self_attn.{q,k}_norm.weight` (Qwen3, replicated).
- `mlp.router.weight` <- `mlp.gate.weight` (replicated: every rank routes its own tokens).
- `mlp.shared_experts.linear_fc1/linear_fc2/gate_weight` <- Qwen2-MoE's `mlp.shared_expert.{gate,up,down}_proj`
  and `mlp.shared_expert_gate.weight`; split over TP like a dense MLP.
- `mlp.experts.local_experts.{j}.linear_fc1/linear_fc2` <- `mlp.experts.{e}.{gate,up,down}_proj` with
  e = (first expert of this EP rank) + j; split over expert-tensor-parallel (ETP) ranks, not TP.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

# Megatron suffix inside a decoder layer -> (kind, HF suffixes inside `model.layers.{i}.`).
LAYER_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    ),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_HF_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")


def expert_mapping(layer_suffix: str, layer_prefix: str, first_local_expert: int) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of a routed expert's weight, or None if `layer_suffix` is not one."""
    match = _EXPERT_RE.match(layer_suffix)
    if match is None:
        return None
    expert = f"{layer_prefix}mlp.experts.{first_local_expert + int(match.group(1))}."
    if match.group(2) == "1":
        return "gate_up", (expert + "gate_proj.weight", expert + "up_proj.weight")
    return "row", (expert + "down_proj.weight",)


def first_local_expert(model) -> int:
    """Global index of this rank's first routed expert (0 for dense models and EP=1)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):  # megatron-core's own offset (experts.py, sharded_state_dict)
            return module.ep_group.rank() * module.num_local_experts
    return 0


def with_expert_index(hf_name: str, expert: int) -> str:
    """`hf_name` of a routed expert's weight, renamed to expert number `expert`."""
    return _HF_EXPERT_RE.sub(f".mlp.experts.{expert}.", hf_name, count=1)


def expert_index(hf_name: str) -> int:
    return int(_HF_EXPERT_RE.search(hf_name).group(1))


def gather_expert_tensors(
    hf_names: tuple[str, ...],
    full_tensors: list[torch.Tensor],
    num_local_experts: int,
    all_gather_ep: Callable[[torch.Tensor], list[torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """This EP rank's full expert tensors -> the same local slot of every EP rank, named by global expert index.

    Local expert j of EP rank r is global expert r * num_local_experts + j (megatron-core's SequentialMLP).
    """
    for hf_name, tensor in zip(hf_names, full_tensors):
        local = expert_index(hf_name) % num_local_experts
        for ep_rank, gathered in enumerate(all_gather_ep(tensor)):
            yield with_expert_index(hf_name, ep_rank * num_local_experts + local), gathered
