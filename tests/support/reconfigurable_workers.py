"""Test-only workers that load another model into a running group (a new group per model costs seconds of
spawning; a tiny model builds in milliseconds)."""

from __future__ import annotations

from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.workers.actor import ActorConfig, ActorWorker


class ReconfigurableActor(ActorWorker):
    """An ActorWorker whose model and strategy config can be replaced after the group started."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model_with(self, config: ActorConfig) -> None:
        self.config = config
        self.init_model()
