"""Name lookup shared by the algorithm registries: one error format for every unknown name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], kind: str, name: str) -> T:
    """`table[name]`, or a ValueError naming the kind, the value seen and every known name."""
    try:
        return table[name]
    except (KeyError, TypeError):
        known = ", ".join(table)
        raise ValueError(f"unknown {kind} {name!r}; known: {known}.") from None
