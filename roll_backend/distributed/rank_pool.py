"""Warm rank processes handed from one actor group to the next (CPU ranks on one node).

Most of a rank's start-up is importing torch, megatron-core and transformers: seconds of a core per process, paid
again by every group a driver starts. A driver that starts many groups one after another (the test suite, a sweep, a
notebook) can keep the processes instead: with the pool on, a group's `shutdown` asks each rank to tear down what it
holds (`RankHost.release_rank`: its model and optimizer, its process groups) and keeps the processes that did; the
next group, of any worker class (every rank's actor is a RankHost: rank_host.py), takes them (`RankHost.reinit_rank`
builds the new rank in place) and starts only the rest. A group takes first the processes its own worker class left
(their imports are the ones it needs).

A process that died, was killed, broke its group, could not tear down within the deadline or ran user code in-process
(whose imports would stay) is never reused. GPU ranks and multi-node clusters are not pooled: a process's device and
node are fixed when it starts. Off by default: `ROLL_BACKEND_RANK_POOL=1` (or `enable_rank_pool()`) turns it on.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from typing import Any

import psutil
import ray

logger = logging.getLogger(__name__)

ENV_SWITCH = "ROLL_BACKEND_RANK_POOL"
RELEASE_TIMEOUT_S = 30.0  # a rank that takes longer to tear down is stopped instead
MAX_IDLE = 16  # idle processes kept at most (each holds its imports: ~0.3-0.7 GiB of host memory) ...
MIN_AVAILABLE = 0.35  # ... and only while this share of the host's memory is available (what runs next needs it)
ALIVE_TIMEOUT_S = 10.0  # an idle process that does not answer within this is stopped, not reused


class RankPool:
    """Idle rank processes of one Ray session, by the environment they started with (a rank's environment variables
    are fixed when its process starts), each with the worker class it last served."""

    def __init__(self, session: str):
        self.session = session
        self._idle: dict[tuple, list[tuple[Any, str]]] = defaultdict(list)
        # What the pool did (for a driver's summary): ranks asked for and served by an idle process; released
        # processes stopped because they did not come back clean (user code imported, a failed tear-down) or found
        # the pool full.
        self.asked = self.reused = self.unclean = self.overflow = 0

    def take(self, key: tuple, count: int, worker_cls: type) -> list:
        """Up to `count` idle processes for `key` that still answer, those `worker_cls` left first (one that died
        while idle, say to the OOM killer, is dropped: the group starts a new one in its place)."""
        idle = sorted(self._idle[key], key=lambda entry: entry[1] != worker_cls.__qualname__)  # (stable: oldest first)
        candidates, self._idle[key] = [handle for handle, _ in idle[:count]], idle[count:]
        answered, silent = _ask(candidates, "__ray_ready__", ALIVE_TIMEOUT_S)
        for handle in silent:
            _kill(handle)
        taken = [handle for handle, ok in answered if ok]
        self.asked += count
        self.reused += len(taken)
        return taken

    def give_back(self, key: tuple, handles: list, worker_cls: type) -> None:
        """Tear down each rank (`RankHost.release_rank`) and keep the processes that came back clean; stop the
        others."""
        room = max(MAX_IDLE - sum(map(len, self._idle.values())), 0) if _memory_to_spare() else 0
        answered, silent = _ask(handles[:room], "release_rank", RELEASE_TIMEOUT_S)
        self._idle[key] += [(handle, worker_cls.__qualname__) for handle, clean in answered if clean]
        unclean = silent + [handle for handle, clean in answered if not clean]
        self.unclean += len(unclean)
        self.overflow += len(handles[room:])
        for handle in handles[room:] + unclean:
            _kill(handle)

    def summary(self) -> str:
        return (
            f"rank pool: {self.reused} of {self.asked} pooled ranks took an idle process; stopped at release: "
            f"{self.unclean} not clean, {self.overflow} with the pool full ({MAX_IDLE} idle at most, while "
            f"{MIN_AVAILABLE:.0%} of the host's memory is available)"
        )

    def clear(self) -> None:
        for entries in self._idle.values():
            for handle, _ in entries:
                _kill(handle)
        self._idle.clear()


def _ask(handles: list, method: str, timeout_s: float) -> tuple[list, list]:
    """Call `method` on every process: ([(handle, its answer, or False where it raised)], [handles silent past
    `timeout_s`])."""
    refs = {getattr(handle, method).remote(): handle for handle in handles}
    ready, silent = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answered = []
    for ref in ready:
        try:
            answered.append((refs[ref], ray.get(ref) is not False))
        except ray.exceptions.RayError:
            answered.append((refs[ref], False))
    return answered, [refs[ref] for ref in silent]


def _memory_to_spare() -> bool:
    """The host has memory for more idle processes: at least MIN_AVAILABLE of it available now (the pool's processes
    and the run's other ranks on this node share it)."""
    memory = psutil.virtual_memory()
    return memory.available >= MIN_AVAILABLE * memory.total


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already gone with its node
        logger.debug("could not stop a pooled rank: %s", exc)


_enabled: bool | None = None
_pool: RankPool | None = None


def current_pool() -> RankPool | None:
    """The pool of this driver's current Ray session, if a group used one."""
    return _pool


def enable_rank_pool(on: bool = True) -> None:
    """Turn the pool on (or off, stopping its idle processes) for this driver process."""
    global _enabled
    _enabled = on
    if not on and _pool is not None:
        _pool.clear()


def pool_for(worker_cls, num_cpus: float, num_gpus: float) -> RankPool | None:
    """The pool a group of `worker_cls` ranks takes its processes from and gives them back to, or None where ranks
    are not pooled: the pool off, a worker class that cannot tear down in place (`Worker.poolable`), GPU ranks, ranks
    that use more than one thread (a pooled process keeps the one it started with), a cluster of more than one
    node."""
    global _pool
    enabled = _enabled if _enabled is not None else os.environ.get(ENV_SWITCH, "0") == "1"
    if not enabled or not getattr(worker_cls, "poolable", False) or num_gpus > 0 or math.floor(num_cpus) > 1:
        return None
    if len([node for node in ray.nodes() if node.get("Alive")]) != 1:
        return None
    session = ray.get_runtime_context().get_job_id()
    if _pool is None or _pool.session != session:  # a new Ray: the old handles are gone with it
        _pool = RankPool(session)
    return _pool
