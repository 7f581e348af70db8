"""What every role that trains its model (actor, critic) shares: checkpoints of its training state."""

from __future__ import annotations

from roll_backend import roles
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.workers.strategy_host import StrategyWorker


class TrainedWorker(StrategyWorker):
    """A role whose strategy trains (a TrainStrategy): its checkpoints (model, optimizer, scheduler, RNG state)."""

    @register(Dispatch.ONE_TO_ALL, deadline=roles.CHECKPOINT)
    def save_checkpoint(self, path: str) -> None:
        self.strategy.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL, deadline=roles.CHECKPOINT)
    def load_checkpoint(self, path: str) -> None:
        self.strategy.load_checkpoint(path)
