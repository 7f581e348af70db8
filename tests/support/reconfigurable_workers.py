"""Test-only workers that load another model into a running group (a new group per model costs seconds of
spawning; a tiny model builds in milliseconds)."""

from __future__ import annotations

import functools

from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.protocol import DataProto
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.critic import CriticConfig, critic_loss


class ReconfigurableActor(ActorWorker):
    """An ActorWorker whose model and strategy config can be replaced after the group started; with a CriticConfig
    it is a critic (compute_values, critic_train_step)."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model_with(self, config: ActorConfig | CriticConfig) -> None:
        self.config = config
        self.init_model()

    # The critic's train call (workers/critic.py; compute_values is the actor's), so one group per layout serves
    # actor and critic checks.
    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED)
    def critic_train_step(self, batch: DataProto) -> dict[str, float] | None:
        return self.strategy.train_step(batch, functools.partial(critic_loss, self.config.loss))
