"""Test-only worker methods on a MoE model's routers (mixed into test workers): switch routing replay on the loaded
model, move every router's weights by the same noise at every layout, read the routers' gradients."""

from __future__ import annotations

import dataclasses

import torch

from roll_backend.distributed.dispatch import Dispatch, register


class RouterTools:
    @register(Dispatch.ONE_TO_ALL)
    def set_router_replay(self, mode: str | None) -> None:
        """The loaded model's router_replay (R2, R3 or None), as if configured."""
        self.strategy.config = dataclasses.replace(self.strategy.config, router_replay=mode)

    @register(Dispatch.ONE_TO_ALL)
    def perturb_routers(self, scale: float, seed: int) -> None:
        """Add noise to each router's weight, drawn by its global layer number (the same at every layout)."""
        for layer, router in self._routers():
            noise = torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(seed + layer))
            with torch.no_grad():
                router.weight.add_(scale * noise.to(router.weight.device, router.weight.dtype))

    @register(Dispatch.ONE_TO_ALL)
    def router_grads(self) -> dict[int, torch.Tensor]:
        """{global layer number: the gradient of that router's weight in the last train step} on this rank."""
        return {layer: router.weight.main_grad.detach().float().cpu().clone() for layer, router in self._routers()}

    def _routers(self):
        from megatron.core.transformer.moe.router import TopKRouter

        from roll_backend.strategies.megatron.builder import unwrap

        for chunk in self.strategy.model:
            for module in unwrap(chunk).modules():
                if isinstance(module, TopKRouter):
                    yield module.layer_number, module


def tie_routers(model_dir, spread: float) -> None:
    """Rewrite a saved HF MoE model's routers so every expert's logit is the first expert's plus `spread` times its
    own difference: top-k margins shrink to the order of float32 rounding, so two implementations of the same
    float32 model (vLLM, Megatron) choose different experts for some tokens, as bf16 numerics do at scale."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    for path in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(path)
        for name, weight in tensors.items():
            if name.endswith(".mlp.gate.weight"):
                tensors[name] = (weight[:1] + spread * (weight - weight[:1])).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
