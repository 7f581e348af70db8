"""Helpers for tests about processes that must end (orphans, killed drivers)."""

from __future__ import annotations

import time

import psutil


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_gone(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive after polling for up to `within_s` (an upper bound, not a synchronisation)."""
    deadline = time.monotonic() + within_s
    remaining = [pid for pid in pids if alive(pid)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.5)
        remaining = [pid for pid in remaining if alive(pid)]
    return remaining


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out
