"""An ActorWorker that holds several models (one Megatron strategy per name), so one actor group per parallel
layout serves every model family a test checks; `use_model` picks the one the ActorWorker methods act on."""

from __future__ import annotations

from lora_tools import LoraTools
from router_tools import RouterTools

from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.strategies.registry import create_strategy
from roll_backend.workers.actor import ActorWorker


class MultiModelActorWorker(LoraTools, RouterTools, ActorWorker):
    @register(Dispatch.ONE_TO_ALL)
    def init_models(self, configs: dict) -> None:
        """{name: MegatronTrainConfig}: build and load every model on this rank."""
        self.strategies = {}
        for name, config in configs.items():
            strategy = create_strategy("megatron_train", config, layout=self.layout, device=self.device)
            strategy.initialize()
            self.strategies[name] = strategy

    @register(Dispatch.ONE_TO_ALL)
    def use_model(self, name: str) -> None:
        self.strategy = self.strategies[name]
