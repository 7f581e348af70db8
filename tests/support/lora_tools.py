"""Test-only worker methods for LoRA (mixed into test workers): a digest of the frozen base, the merged HF weights."""

from __future__ import annotations

import torch

from roll_backend.distributed.dispatch import Dispatch, register


class LoraTools:
    @register(Dispatch.ONE_TO_ALL)
    def base_weights(self) -> dict[str, torch.Tensor]:
        """This rank's frozen parameters (copies), by name."""
        return {
            name: param.detach().cpu().clone()
            for chunk in self.strategy.model
            for name, param in chunk.named_parameters()
            if not param.requires_grad
        }

    @register(Dispatch.ONE_TO_ALL)
    def merged_hf_weights(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights the rollout would receive (the base merged with the adapters' update)."""
        return {name: t.cpu().clone() for bucket in self.strategy.iter_hf_weights(1 << 40) for name, t in bucket}

    @register(Dispatch.ONE_TO_ALL)
    def optimizer_parameter_names(self) -> list[str]:
        """The names of the parameters this rank's optimizer updates."""
        trained = {id(p) for group in self.strategy.optimizer.param_groups for p in group["params"]}
        return sorted(n for chunk in self.strategy.model for n, p in chunk.named_parameters() if id(p) in trained)
