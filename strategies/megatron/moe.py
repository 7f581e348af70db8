"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE) on megatron-core: the architecture facts of a Hugging Face
config, the TransformerConfig settings that reproduce its routing, layout checks, and router metrics.

Routing as Hugging Face computes it, in Megatron's terms:
- Qwen3-MoE (`norm_topk_prob=True`): softmax over all experts, top-k, renormalise the k weights. That equals
  top-k on the logits followed by a softmax over the k, which is Megatron's default (`moe_router_pre_softmax=False`).
- Qwen2-MoE (`norm_topk_prob=False`): softmax over all experts, then top-k without renormalising:
  `moe_router_pre_softmax=True`. Its shared expert is scaled by sigmoid(gate(x)): `moe_shared_expert_gate=True`.

Token dispatcher: megatron-core 0.16.1's `alltoall` dispatcher creates a `torch.cuda.Stream` in its constructor,
so it cannot run on CPU; the `allgather` dispatcher runs over gloo (CPU) and NCCL (GPU) alike, and is what we use
on CPU. On cuda we use `alltoall`, Megatron's choice for expert parallelism at scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from roll_backend.strategies.megatron.config import MOE_MODEL_TYPES, expert_layout_problems, hf_model_problems


@dataclass(frozen=True)
class MoEArch:
    """The routed-experts part of a Hugging Face MoE config."""

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    norm_topk_prob: bool
    aux_loss_coef: float
    shared_expert_ffn_hidden_size: int | None = None  # Qwen2-MoE: one always-on expert behind a sigmoid gate

    @classmethod
    def from_hf_config(cls, hf_config) -> MoEArch | None:
        """None for a dense model; a clear error for MoE layouts we do not convert (dense layers between MoE ones)."""
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in MOE_MODEL_TYPES:
            return None
        problems = hf_model_problems(
            {
                "model_type": model_type,
                "decoder_sparse_step": getattr(hf_config, "decoder_sparse_step", 1),
                "mlp_only_layers": getattr(hf_config, "mlp_only_layers", None),
            }
        )
        if problems:
            raise ValueError("; ".join(problems) + ".")
        shared = getattr(hf_config, "shared_expert_intermediate_size", None) or None
        return cls(
            num_experts=hf_config.num_experts,
            topk=hf_config.num_experts_per_tok,
            expert_ffn_hidden_size=hf_config.moe_intermediate_size,
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
            shared_expert_ffn_hidden_size=shared if model_type == "qwen2_moe" else None,
        )

    def layout_problems(self, tp: int, ep: int, etp: int) -> list[str]:
        """What megatron-core requires of (tp, ep, etp) for these experts; [] when the layout fits."""
        return expert_layout_problems(
            self.num_experts, self.expert_ffn_hidden_size, self.shared_expert_ffn_hidden_size, tp, ep, etp
        )


def token_dispatcher_type(device: str) -> str:
    """`allgather` on CPU (gloo; 0.16.1's alltoall dispatcher needs CUDA streams), `alltoall` on cuda."""
    return "alltoall" if device == "cuda" else "allgather"


def transformer_config_kwargs(moe: MoEArch, tp: int, ep: int, etp: int, device: str) -> dict:
    """TransformerConfig fields for `moe` at this layout.

    Megatron's MoE layer refuses to train with TP > 1 unless sequence parallelism is on, so MoE models turn it on
    whenever tp > 1 (every norm in our local spec marks its weight for the TP gradient reduction this needs).
    """
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coef,
        moe_token_dispatcher_type=token_dispatcher_type(device),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_ffn_hidden_size is not None,
        moe_grouped_gemm=False,  # SequentialMLP: one MLP per local expert, exact on CPU
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
    )


def allow_router_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router GEMM reads `te_general_gemm`, a name it defines only when TransformerEngine
    imports; without TE (CPU, or GPU without TE) it raises NameError. Define it as None so the torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mark_expert_params(model) -> None:
    """Mark every routed expert's weight as expert-parallel (`allreduce=False`) at every EP size.

    megatron-core marks them only when ep > 1, so at EP1 experts share the dense optimizer and the checkpoint's
    optimizer state has another structure (one optimizer instead of [dense, expert]) than at EP2: a checkpoint
    would not load across EP sizes. Marked, DDP reduces their gradients over the expert-data-parallel group
    (at EP1 with etp == tp that is the data-parallel group: the same numbers) and the optimizer is always chained.
    """
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def router_padding_mask(model, padding_mask: torch.Tensor) -> torch.Tensor:
    """The [b, s] padding mask (True = padding) a GPTModel chunk takes for its MoE routers.

    megatron-core 0.16.1 cuts the mask to this rank's part of the sequence under sequence parallelism only in a
    chunk that embeds (pre_process); a later pipeline stage's chunk would route [s/TP] tokens against the whole
    mask, so it gets the cut mask here.
    """
    if model.pre_process or not model.config.sequence_parallel:
        return padding_mask
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


class RouterMetrics:
    """Router statistics of a train step: the load-balancing loss and the token load per expert.

    Token load counts the (token, expert) assignments of every router during training forwards, real tokens only
    (the schedule gives the routers the micro-batch's padding mask), so it is the same at every layout and
    micro-batch split; `pop` reduces it over all ranks and reports, per layer, each expert's load relative to the
    layer's mean (1.0 = perfectly balanced): min and max over layers and experts, and the imbalance (max / mean,
    averaged over layers). The aux loss comes from Megatron's tracker, reduced the way Megatron's own logging
    reduces it: a mean over micro-batches of a per-micro-batch objective (Megatron's and Hugging Face's
    definition), padding left out, so it is the same at every model-parallel layout for the same micro-batches.
    """

    def __init__(self, model_chunks: list, num_layers: int, num_experts: int, aux_loss_coef: float, device: str):
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        from megatron.core.transformer.moe.router import TopKRouter

        # Megatron's tracker is process-global and sized by the first model's layers: a new model starts it afresh.
        get_moe_layer_wise_logging_tracker().clear()
        self.aux_loss_coef = aux_loss_coef
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._hook)

    def _hook(self, router, args, output):
        if router.training and router.layer_number is not None and router.layer_number <= self.counts.shape[0]:
            _, routing_map = output
            padding = args[1] if len(args) > 1 else None  # [s, b] True = padding, in routing_map's token order
            if padding is not None:
                routing_map = routing_map[~padding.reshape(-1)]
            self.counts[router.layer_number - 1] += routing_map.detach().sum(dim=0).to(self.counts.dtype)

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()

    def pop(self, num_micro_batches: int) -> dict[str, float]:
        """Metrics of the step (every rank must call: it communicates); resets the counters."""
        from megatron.core.transformer.moe.moe_utils import (
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        dist.all_reduce(self.counts)
        per_layer = self.counts / self.counts.mean(dim=1, keepdim=True).clamp(min=1e-12)
        metrics = {
            "moe/expert_load_min": float(per_layer.min()),
            "moe/expert_load_max": float(per_layer.max()),
            "moe/expert_load_imbalance": float(per_layer.max(dim=1).values.mean()),
        }
        tracker = get_moe_layer_wise_logging_tracker()
        if "load_balancing_loss" in tracker:
            reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
            per_layer_loss = tracker["load_balancing_loss"]["values"] / num_micro_batches
            metrics["moe/load_balancing_loss"] = float(per_layer_loss.mean())
            # What the step adds to the objective: coefficient x the sum over layers (mean over micro-batches, DP).
            metrics["moe/aux_loss"] = float(per_layer_loss.sum()) * self.aux_loss_coef
        self.reset()
        return metrics


class ExpertLoad:
    """The tokens each MoE layer's local experts computed in a call, relative to what the layer's own tokens route
    (its tokens over the whole sequence of its TP group, times top-k): 1.0 without EP, and under EP 1.0 for balanced
    routing, up to EP for a router that sends every rank's tokens to this rank's experts. The memory plan takes it
    (activation_plan.PlanOptions.expert_load) to compare its counts with a measured phase's."""

    def __init__(self, model_chunks: list):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        # per layer, (own routed tokens, load, skew) of the call's micro-batch with the most tokens (the one the plan
        # takes; of equal ones the busiest), skew being the busiest local expert's tokens over the local experts' mean
        self.loads: dict[int, tuple[int, float, float]] = {}
        self._own: dict[int, int] = {}
        self._handles = []
        for chunk in model_chunks:
            for layer in (m for m in chunk.modules() if isinstance(m, MoELayer)):
                self._handles.append(layer.register_forward_pre_hook(self._layer_input))
                self._handles.append(layer.experts.register_forward_pre_hook(self._expert_input(layer)))

    def _layer_input(self, layer, args):
        hidden = args[0]  # [s, b, h]: this rank's part of the sequence under sequence parallelism
        tp = layer.attn_tp_group.size() if layer.config.sequence_parallel else 1
        self._own[id(layer)] = hidden.shape[0] * hidden.shape[1] * tp * layer.config.moe_router_topk

    def _expert_input(self, layer):
        def hook(experts, args):
            own, received = self._own[id(layer)], args[0].shape[0]
            per_expert = args[1].tolist() if isinstance(args[1], torch.Tensor) else list(args[1])
            skew = max(per_expert) * len(per_expert) / received if received else 1.0
            load = (own, received / max(1, own), skew)
            self.loads[id(layer)] = max(load, self.loads.get(id(layer), (0, 0.0, 0.0)))

        return hook

    def summary(self) -> dict[str, float] | None:
        """{"busiest": the largest layer's load, "mean": the layers' mean, "skew": the largest busiest-expert share
        relative to an even one}; None without MoE layers."""
        if not self.loads:
            return None
        loads = [load for _, load, _ in self.loads.values()]
        skew = max(skew for *_, skew in self.loads.values())
        return {"busiest": max(loads), "mean": sum(loads) / len(loads), "skew": skew}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
