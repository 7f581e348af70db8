"""The reward role for rule-based rewards: scores response text against the reference answer, in parallel over ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from roll_backend import keys
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.worker import Worker
from roll_backend.protocol import DataProto
from roll_backend.rewards.registry import get_reward_fn


@dataclass(frozen=True)
class RewardWorkerConfig:
    """The `reward` role section: reward names (from roll_backend.rewards.registry) and their weights."""

    rewards: Mapping[str, float] = field(default_factory=lambda: {"math_verify": 1.0})

    def __post_init__(self):
        if not self.rewards:
            raise ValueError("reward.rewards is empty; name at least one reward, e.g. {'math_verify': 1.0}.")
        for name in self.rewards:
            get_reward_fn(name)  # an unknown name fails here, before any actor starts


def last_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place one score per sequence on its last response token.

    scores [B] float32, response_mask [B, T_resp] int -> [B, T_resp] float32, zero elsewhere. A response
    with no tokens gets its score on column 0.
    """
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = (response_mask.bool() * positions).argmax(dim=1)  # last index where the mask is 1
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    token_level[torch.arange(len(scores)), last] = scores.to(torch.float32)
    return token_level


class RewardWorker(Worker):
    """One rank of the rule-based reward role: DP_MP_COMPUTE hands each rank its share of the batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config is None:
            self.config = RewardWorkerConfig()
        if not isinstance(self.config, RewardWorkerConfig):
            raise TypeError(f"RewardWorker takes a RewardWorkerConfig as worker_config, got {type(self.config).__name__}")

    @register(Dispatch.DP_MP_COMPUTE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """RESPONSE_TEXT + ANSWER + RESPONSE_MASK -> TOKEN_LEVEL_SCORES [B, T_resp] float32 (score on the last token)."""
        for name in (keys.RESPONSE_TEXT, keys.ANSWER):
            if name not in batch.non_tensor_batch:
                raise KeyError(f"compute_rewards needs the non-tensor column '{name}'")
        if keys.RESPONSE_MASK not in batch.batch.keys():
            raise KeyError(f"compute_rewards needs the tensor column '{keys.RESPONSE_MASK}'")
        texts, answers = batch.non_tensor_batch[keys.RESPONSE_TEXT], batch.non_tensor_batch[keys.ANSWER]
        per_reward = {  # name -> [B] float32
            name: torch.tensor([get_reward_fn(name)(str(t), str(a)) for t, a in zip(texts, answers)], dtype=torch.float32)
            for name in self.config.rewards
        }
        scores = sum(weight * per_reward[name] for name, weight in self.config.rewards.items())  # [B]
        metrics = {f"reward/{name}_mean": _mean(values) for name, values in per_reward.items()}
        metrics["reward/score_mean"] = _mean(scores)
        return DataProto.from_dict(
            tensors={keys.TOKEN_LEVEL_SCORES: last_token_scores(scores, batch.batch[keys.RESPONSE_MASK])},
            meta_info={keys.META_METRICS: metrics},
        )


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if len(values) else 0.0
