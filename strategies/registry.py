"""The one list of strategy names: name -> "module:Class", imported lazily so the driver never touches CUDA."""

from __future__ import annotations

import importlib
from typing import Any

STRATEGIES: dict[str, str] = {
    "megatron_train": "roll_backend.strategies.megatron.train:MegatronTrainStrategy",
    "megatron_infer": "roll_backend.strategies.megatron.infer:MegatronInferStrategy",
    "vllm_rollout": "roll_backend.strategies.vllm.strategy:VllmRolloutStrategy",
}

# The typed config class of each strategy (modules without heavy imports).
STRATEGY_CONFIGS: dict[str, str] = {
    "megatron_train": "roll_backend.strategies.megatron.config:MegatronTrainConfig",
    "megatron_infer": "roll_backend.strategies.megatron.config:MegatronInferConfig",
    "vllm_rollout": "roll_backend.strategies.vllm.config:VllmRolloutConfig",
}


# The memory planner of each strategy (a module with plan, planned_at and problems: strategies.base.MemoryPlanner).
STRATEGY_MEMORY: dict[str, str] = {
    "megatron_train": "roll_backend.strategies.megatron.memory_accounting",
    "megatron_infer": "roll_backend.strategies.megatron.memory_accounting",
    "vllm_rollout": "roll_backend.strategies.vllm.engine_memory",
}


class UnknownStrategyError(ValueError):
    """A strategy name that is not in STRATEGIES."""


def _load(path: str):
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _check_name(name: str, role: str | None = None) -> None:
    if name not in STRATEGIES:
        where = f" for {role}" if role else ""
        raise UnknownStrategyError(f"unknown strategy {name!r}{where}; known: {', '.join(sorted(STRATEGIES))}.")


def strategy_class(name: str, role: str | None = None) -> type:
    _check_name(name, role)
    return _load(STRATEGIES[name])


def config_class(name: str, role: str | None = None) -> type:
    _check_name(name, role)
    if name not in STRATEGY_CONFIGS:
        raise UnknownStrategyError(f"strategy {name!r} registers no config class in STRATEGY_CONFIGS")
    return _load(STRATEGY_CONFIGS[name])


def memory_planner(name: str):
    """Strategy `name`'s memory planner (strategies.base.MemoryPlanner), or None for one that plans nothing."""
    _check_name(name)
    return importlib.import_module(STRATEGY_MEMORY[name]) if name in STRATEGY_MEMORY else None


def create_strategy(name: str, config: Any, **kwargs: Any):
    """Instantiate strategy `name` with its typed `config` (and e.g. layout=, device=)."""
    cls = strategy_class(name)
    expected = config_class(name) if name in STRATEGY_CONFIGS else None
    if expected is not None and not isinstance(config, expected):
        raise TypeError(f"strategy {name!r} takes a {expected.__name__}, got {type(config).__name__}")
    return cls(config, **kwargs)
