"""Shared by the routing-replay tests: transformers' own routes of a batch, route comparison, and one recorded,
perturbed and replayed step on a group of any test worker with RouterTools."""

from __future__ import annotations

import torch
from router_tools import RouterTools

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.workers.actor import ActorWorker


@torch.no_grad()
def hf_routes(model_dir: str, tensors: dict[str, torch.Tensor], dtype=torch.float32):
    """[B, T, L, k] the experts transformers routes each real token to at each layer (top-k of the router logits),
    -1 at padding; with dtype=bfloat16 also the responses' log-probs [B, T_resp] (what a bf16 rollout samples with)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    attention = tensors[keys.ATTENTION_MASK]
    out = model(
        input_ids=tensors[keys.INPUT_IDS],
        attention_mask=attention,
        position_ids=tensors[keys.POSITION_IDS],
        output_router_logits=True,
    )
    k = model.config.num_experts_per_tok
    per_layer = [logits.float().topk(k, dim=-1).indices.view(*attention.shape, k) for logits in out.router_logits]
    routes = torch.stack(per_layer, dim=2).to(torch.int16).masked_fill(~attention.bool()[..., None, None], -1)
    if dtype == torch.float32:
        return routes
    width = tensors[keys.RESPONSES].shape[1]
    log_probs = out.logits[:, -width - 1 : -1].float().log_softmax(-1)
    return routes, log_probs.gather(-1, tensors[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)


def same_routes(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """The same set of experts at every real token and layer."""
    real = attention_mask.bool()
    return bool(torch.equal(a.sort(-1).values[real], b.sort(-1).values[real]))


def replay_step(group, tensors: dict, perturbation: float, meta: dict | None = None, seed: int = 3) -> dict:
    """The old-log-prob forward (R2 records), the routers moved by `perturbation` x noise, one train step on the
    recorded routes, the routers' gradients, and the log-probs after it."""
    meta = dict(meta or {})
    first = group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors, meta_info=meta))
    batch = {**tensors, keys.OLD_LOG_PROBS: first.batch[keys.LOG_PROBS]}
    recorded = first.batch[keys.RECORDED_ROUTES] if keys.RECORDED_ROUTES in first.batch.keys() else None
    if recorded is not None:
        batch[keys.RECORDED_ROUTES] = recorded
    group.call(RouterTools.perturb_routers, perturbation, seed)
    step = group.call(ActorWorker.train_step, DataProto.from_dict(tensors=batch, meta_info=meta))
    grads = {}
    for per_rank in group.call(RouterTools.router_grads):
        for layer, grad in per_rank.items():
            grads.setdefault(layer, grad)
    after = group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors, meta_info=meta))
    return {
        "recorded": recorded,
        "metrics": next(m for m in step if m is not None),
        "router_grads": grads,
        "after": after.batch[keys.LOG_PROBS],
    }
