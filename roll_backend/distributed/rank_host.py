"""`RankHost`: the Ray actor behind every rank of every group. It runs one `Worker` at a time; the group calls the
worker's methods through it by name. A process is then not tied to one worker class: with the rank pool on
(rank_pool.py) a process an actor rank left can serve a rollout, reward or test rank next, and only the imports that
role adds are paid again, not torch's and transformers'.

What a released rank could leave in its process besides its objects is put back as the process started: the
environment variables (an engine sets its own, which a later engine of another config would inherit). A process that
imported a user's module (`user_functions.import_user_module`: reward functions, environments, tools and agents, which
a role's ranks leave to their children) is not reused: the module would stay in it."""

from __future__ import annotations

import os
import sys
from typing import Any

from roll_backend.rewards.user_functions import USER_MODULES


class RankHost:
    """One rank's process: `worker_cls(*args)` built in it, its methods run by `call`."""

    def __init__(self, worker_cls: type, *args: Any):
        self._started_env = dict(os.environ)
        self.worker = worker_cls(*args)

    def __repr__(self) -> str:  # Ray prefixes the rank's log lines with it
        worker = getattr(self, "worker", None)
        if worker is None:
            return "idle rank"
        return f"{type(worker).__name__} {worker.role} rank {worker.rank}"

    def call(self, method_name: str, args: tuple, kwargs: dict):
        """Run the worker's `method_name` (a registered method, or the set-up the group drives)."""
        return getattr(self.worker, method_name)(*args, **kwargs)

    def reinit_rank(self, worker_cls: type, *args: Any) -> None:
        """Become a rank of a new group (after `release_rank`), of any worker class: as a new actor's constructor."""
        self.worker = worker_cls(*args)
        _relabel_logs(repr(self))

    def release_rank(self) -> bool:
        """Tear the worker's rank down (`Worker.release_rank`) and put the process back as it started; True when the
        process is clean to serve another group."""
        worker, self.worker = self.worker, None
        if not worker.release_rank() or USER_MODULES:
            return False
        os.environ.clear()
        os.environ.update(self._started_env)
        _relabel_logs(repr(self))
        return True


def _relabel_logs(name: str) -> None:
    """Ray's log monitor names a process's later lines by the last such marker (it prints one at an actor's start)."""
    from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME

    for stream in (sys.stdout, sys.stderr):
        print(f"{LOG_PREFIX_ACTOR_NAME}{name}", file=stream, flush=True)
