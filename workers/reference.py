"""`ReferenceWorker`: the frozen reference policy; it only computes log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roll_backend import roles
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.protocol import DataProto
from roll_backend.workers.strategy_host import StrategyWorker


@dataclass(frozen=True)
class ReferenceConfig:
    strategy: Any  # e.g. MegatronInferConfig
    strategy_name: str = "megatron_infer"


class ReferenceWorker(StrategyWorker):
    """One rank of the reference model. Call `init_model` once after the group starts. `compute_log_probs`
    receives its batch by the in-actor broadcast (DP_MP_DISPATCH_FIRST_BALANCED)."""

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.LOG_PROBS_DEADLINE)
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        """keys.LOG_PROBS [B, T_resp] under the reference weights (the driver stores them as REF_LOG_PROBS)."""
        return self.strategy.compute_log_probs(batch)
