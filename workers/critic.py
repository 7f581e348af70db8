"""`CriticWorker`: the value model. Values and clipped value-loss train steps via its strategy."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from roll_backend import keys, roles
from roll_backend.algorithms.aggregation import token_mean_share
from roll_backend.algorithms.value_loss import value_loss
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.protocol import DataProto
from roll_backend.workers.trained import TrainedWorker


@dataclass(frozen=True)
class CriticLossConfig:
    clip_range: float | None = 0.5  # None: the value loss is not clipped


@dataclass(frozen=True)
class CriticConfig:
    """A critic's strategy (with value_head=True) and loss."""

    strategy: Any  # e.g. MegatronTrainConfig(value_head=True)
    strategy_name: str = "megatron_train"
    loss: CriticLossConfig = field(default_factory=CriticLossConfig)


def critic_loss(cfg: CriticLossConfig, per_token: dict[str, torch.Tensor], micro_batch: DataProto):
    """LossFn of the critic: clipped value loss on VALUES (old values), RETURNS and RESPONSE_MASK."""
    batch = micro_batch.batch
    loss, clipfrac = value_loss(
        per_token[keys.VALUES],
        batch[keys.RETURNS],
        batch[keys.VALUES],
        batch[keys.RESPONSE_MASK].float(),
        clip_range=cfg.clip_range,
        agg_mode="token-mean",
        dp_size=1,
        batch_num_tokens=micro_batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT],
    )
    mask, global_tokens = batch[keys.RESPONSE_MASK].float(), micro_batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT]
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": token_mean_share(clipfrac.detach(), mask, global_tokens)}


class CriticWorker(TrainedWorker):
    """One rank of the critic. Call `init_model` once after the group starts. `compute_values` and `train_step`
    receive their batch by the in-actor broadcast (DP_MP_DISPATCH_FIRST_BALANCED)."""

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.LOG_PROBS_DEADLINE)
    def compute_values(self, batch: DataProto) -> DataProto | None:
        """keys.VALUES [B, T_resp]."""
        return self.strategy.compute_values(batch)

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.TRAIN_DEADLINE)
    def train_step(self, batch: DataProto) -> dict[str, float] | None:
        metrics = self.strategy.train_step(batch, functools.partial(critic_loss, self.config.loss))
        return metrics  # reduced over DP already; the group call returns one dict per DP rank
