"""What every role that runs a strategy shares: starting it on the rank, and the context its calls need."""

from __future__ import annotations

import contextlib
from typing import Any

from roll_backend.strategies.registry import create_strategy, strategy_class


def start_strategy(name: str, config: Any, layout, device: str):
    """Build strategy `name` with its typed `config` on this rank and load its model or engine."""
    strategy = create_strategy(name, config, layout=layout, device=device)
    strategy.initialize()
    return strategy


def strategy_call_context(name: str, device: str) -> contextlib.AbstractContextManager:
    """The context strategy `name` needs around every call on `device` (Megatron on CPU: its device mode)."""
    return strategy_class(name).call_context(device)
