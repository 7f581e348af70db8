"""What every role that runs a strategy shares: starting it on the rank, and the context its calls need."""

from __future__ import annotations

import contextlib
from typing import Any

from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.worker import Worker
from roll_backend.strategies.registry import create_strategy, strategy_class


def start_strategy(worker: Worker, name: str, config: Any):
    """Build strategy `name` with its typed `config` on `worker`'s rank and load its model or engine. A start that
    fails keeps the process out of the rank pool: what a half-started engine set up in the process (vLLM's parallel
    groups) is out of its tear-down's reach."""
    strategy = create_strategy(name, config, layout=worker.layout, device=worker.device)
    try:
        strategy.initialize()
    except BaseException:
        worker.poolable = False
        raise
    return strategy


def strategy_call_context(name: str, device: str) -> contextlib.AbstractContextManager:
    """The context strategy `name` needs around every call on `device` (Megatron on CPU: its device mode)."""
    return strategy_class(name).call_context(device)


class StrategyWorker(Worker):
    """A role whose ranks each run one strategy: `config.strategy_name` built from `config.strategy`. Call
    `init_model` once after the group starts; every call runs in the strategy's context."""

    poolable = True  # (its strategy's models and optimizer go with the strategy object)

    def call_context(self):
        return strategy_call_context(self.config.strategy_name, self.device)

    def release_role(self) -> bool:
        self.strategy = None
        return True

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.check_config()
        self.strategy = start_strategy(self, self.config.strategy_name, self.config.strategy)

    @register(Dispatch.ONE_TO_ALL)
    def measured_memory(self) -> dict:
        """This rank's measured memory (InferStrategy.measured_memory) and its pipeline stage, one entry per rank."""
        return {**self.strategy.measured_memory(), "pp_rank": self.coords.pp if self.coords else 0}

    def check_config(self) -> None:
        """A role's own rule on its strategy's config, before the model is built (none by default)."""
