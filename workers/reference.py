"""`ReferenceWorker`: the frozen reference policy; it only computes log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roll_backend import roles
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.worker import Worker
from roll_backend.protocol import DataProto
from roll_backend.workers.strategy_host import start_strategy, strategy_call_context


@dataclass(frozen=True)
class ReferenceConfig:
    strategy: Any  # e.g. MegatronInferConfig
    strategy_name: str = "megatron_infer"


class ReferenceWorker(Worker):
    """One rank of the reference model. Call `init_model` once after the group starts. `compute_log_probs`
    receives its batch by the in-actor broadcast (DP_MP_DISPATCH_FIRST_BALANCED)."""

    def call_context(self):
        return strategy_call_context(self.config.strategy_name, self.device)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg: ReferenceConfig = self.config
        self.strategy = start_strategy(cfg.strategy_name, cfg.strategy, self.layout, self.device)

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.LOG_PROBS_DEADLINE)
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        """keys.LOG_PROBS [B, T_resp] under the reference weights (the driver stores them as REF_LOG_PROBS)."""
        return self.strategy.compute_log_probs(batch)
