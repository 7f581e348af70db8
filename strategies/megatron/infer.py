"""`MegatronInferStrategy`: forward-only megatron-core (TP/PP/CP, interleaved PP) for reference log-probs and critic
values.
"""

from __future__ import annotations

import logging

from roll_backend.distributed.parallel import ParallelLayout
from roll_backend.protocol import DataProto
from roll_backend.strategies.base import InferStrategy
from roll_backend.strategies.megatron import schedule
from roll_backend.strategies.megatron.config import MegatronInferConfig
from roll_backend.strategies.megatron.model_setup import MegatronCallContext, build_model_chunks

logger = logging.getLogger(__name__)


class MegatronInferStrategy(MegatronCallContext, InferStrategy):
    """Holds one pipeline stage of a model and runs Megatron's schedules forward-only in micro-batches.

    Results (a DataProto of [B, T_resp] tensors) come from the last PP stage; other stages return None.
    """

    config_class = MegatronInferConfig

    def __init__(self, config: MegatronInferConfig, layout: ParallelLayout, device: str):
        self.config = config
        self.layout = layout
        self.device = device
        self.model = None

    def initialize(self) -> None:
        # One model chunk per virtual pipeline stage (a single one without vpp).
        self.model, self.arch, self.hf_config = build_model_chunks(self.config, self.layout, self.device)
        schedule.attach_head(self)
        self.route_replayer = schedule.route_replayer(self, self.model)

    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        return schedule.strategy_forward(self, batch, value_head=False, what="compute_log_probs")

    def compute_values(self, batch: DataProto) -> DataProto | None:
        return schedule.strategy_forward(self, batch, value_head=True, what="compute_values")
