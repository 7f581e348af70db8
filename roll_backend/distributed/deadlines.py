"""Deadlines for group calls: one deadline for a whole call (all its ranks together), and a scope that gives
every group call made inside it the scope's deadline and name (the pipeline's phases use it)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """An absolute point in time (monotonic clock) and what it belongs to, for messages."""

    at: float
    seconds: float
    label: str = ""

    @classmethod
    def after(cls, seconds: float | None, label: str = "") -> Deadline | None:
        return None if seconds is None else cls(time.monotonic() + seconds, float(seconds), label)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def describe(self) -> str:
        where = f" of {self.label}" if self.label else ""
        return f"the deadline{where} ({self.seconds:g}s)"


_scope: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("roll_backend_deadline", default=None)


@contextlib.contextmanager
def deadline_scope(seconds: float | None, label: str):
    """Group calls made inside get this scope's deadline (the earlier one when scopes nest); None: no limit."""
    outer = _scope.get()
    inner = Deadline.after(seconds, label)
    chosen = inner if outer is None or (inner is not None and inner.at < outer.at) else outer
    token = _scope.set(chosen)
    try:
        yield chosen
    finally:
        _scope.reset(token)


def call_deadline(timeout_s: float | None) -> Deadline | None:
    """The deadline of a call starting now: its own `timeout_s`, the enclosing scope's, whichever ends first."""
    own = Deadline.after(timeout_s, "the call")
    scoped = _scope.get()
    if own is None or (scoped is not None and scoped.at < own.at):
        return scoped
    return own


def earliest(*deadlines: Deadline | None) -> Deadline | None:
    present = [d for d in deadlines if d is not None]
    return min(present, key=lambda d: d.at) if present else None
