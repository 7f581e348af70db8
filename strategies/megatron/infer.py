"""`MegatronInferStrategy`: forward-only megatron-core (TP/PP/CP, interleaved PP) for reference log-probs, critic
values and reward-model scores, on a MegatronEngine.
"""

from __future__ import annotations

import logging

from roll_backend.protocol import DataProto
from roll_backend.strategies.base import InferStrategy
from roll_backend.strategies.megatron.config import MegatronInferConfig
from roll_backend.strategies.megatron.engine import MegatronEngine
from roll_backend.strategies.megatron.model_setup import MegatronStrategyBase, build_model_chunks

logger = logging.getLogger(__name__)


class MegatronInferStrategy(MegatronStrategyBase, InferStrategy):
    """Holds one pipeline stage of a model and runs Megatron's schedules forward-only in micro-batches.

    Results (a DataProto of [B, T_resp] tensors) come from the last PP stage; other stages return None.
    """

    config_class = MegatronInferConfig

    def initialize(self) -> None:
        # One model chunk per virtual pipeline stage (a single one without vpp).
        chunks, arch = build_model_chunks(self.config, self.layout, self.device)
        self.engine = MegatronEngine(self.config, self.layout, self.device, chunks, arch)

    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        return self.ready("compute_log_probs").forward(batch, value_head=False, what="compute_log_probs")

    def compute_values(self, batch: DataProto) -> DataProto | None:
        return self.ready("compute_values").forward(batch, value_head=True, what="compute_values")
