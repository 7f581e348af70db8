"""The reward role for rule-based rewards: built-in names and user functions, weighted and summed, each rank
scoring its share of the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from roll_backend import keys, roles
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.worker import Worker
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import place_on_last_token
from roll_backend.rewards.registry import builtin_weights, get_reward_fn
from roll_backend.rewards.user_functions import ON_ERROR_CHOICES, FunctionScorer, RewardFunctionSpec, RewardRows


@dataclass(frozen=True)
class RewardWorkerConfig:
    """Built-in reward names (roll_backend.rewards.registry) and user functions, each with its weight.

    `on_function_error`: "raise" stops the run at a user function that raises, returns a non-number or misses
    `function_timeout_s`; "zero" scores such rows 0 and counts them in `reward/<label>/error_count`.
    """

    rewards: Mapping[str, float] | None = None  # None: {"math_verify": 1.0} without functions, else none
    functions: Sequence[RewardFunctionSpec] = ()
    on_function_error: str = "raise"
    function_timeout_s: float = 60.0
    # Multi-turn rollouts: the weight of the batch's ENV_REWARDS (the environment's reward) in the sum; None: none.
    env_weight: float | None = None

    def __post_init__(self):
        agentic = self.env_weight is not None
        object.__setattr__(self, "rewards", builtin_weights(self.rewards, bool(self.functions) or agentic))
        if not self.rewards and not self.functions and not agentic:
            raise ValueError(
                "no rewards: name a built-in in reward.rewards (e.g. {'math_verify': 1.0}) or add reward.functions."
            )
        for name in self.rewards:
            get_reward_fn(name)  # an unknown name fails here, before any actor starts
        if self.on_function_error not in ON_ERROR_CHOICES:
            raise ValueError(
                f"reward.on_function_error={self.on_function_error!r}; choose one of {', '.join(ON_ERROR_CHOICES)}"
            )
        if not self.function_timeout_s > 0:
            raise ValueError(f"reward.function_timeout_s={self.function_timeout_s} must be > 0")
        labels = [spec.label for spec in self.functions]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(
                f"reward.functions: {repeated} appear more than once; each function's metrics need their own name"
            )


class RewardWorker(Worker):
    """One rank of the rule-based reward role: DP_MP_COMPUTE hands each rank its share of the batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config is None:
            self.config = RewardWorkerConfig()
        if not isinstance(self.config, RewardWorkerConfig):
            raise TypeError(
                f"RewardWorker takes a RewardWorkerConfig as worker_config, got {type(self.config).__name__}"
            )
        # User code is loaded on the first call (in this process), so its import errors travel like its other errors.
        self.scorers = [
            FunctionScorer(spec, self.config.on_function_error, self.config.function_timeout_s)
            for spec in self.config.functions
        ]

    @register(Dispatch.DP_MP_COMPUTE, deadline=roles.REWARD_DEADLINE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """RESPONSE_TEXT + ANSWER + RESPONSE_MASK -> TOKEN_LEVEL_SCORES [B, T_resp] float32 (score on the last
        token).
        """
        for name in (keys.RESPONSE_TEXT, keys.ANSWER):
            if name not in batch.non_tensor_batch:
                raise KeyError(f"compute_rewards needs the non-tensor column '{name}'")
        if keys.RESPONSE_MASK not in batch.batch.keys():
            raise KeyError(f"compute_rewards needs the tensor column '{keys.RESPONSE_MASK}'")
        texts, answers = batch.non_tensor_batch[keys.RESPONSE_TEXT], batch.non_tensor_batch[keys.ANSWER]
        per_reward = {  # name -> [B] float32
            name: torch.tensor(
                [get_reward_fn(name)(str(t), str(a)) for t, a in zip(texts, answers)], dtype=torch.float32
            )
            for name in self.config.rewards
        }
        metrics = {f"reward/{name}_mean": _mean(values) for name, values in per_reward.items()}
        scores = sum(
            (weight * per_reward[name] for name, weight in self.config.rewards.items()), torch.zeros(len(batch))
        )
        if self.scorers:
            real = _real_rows(batch)  # rows repeated by dispatch padding are not sent to user code
            rows = reward_rows(batch, real)
            for scorer in self.scorers:
                result = scorer.score(rows)
                values = torch.zeros(len(batch))
                values[real] = torch.from_numpy(result.scores)
                scores = scores + scorer.spec.weight * values
                label = scorer.spec.label
                metrics[f"reward/{label}/mean"] = _mean(values[real])
                metrics |= {f"reward/{label}/{key}": float(np.mean(vals)) for key, vals in result.extras.items()}
                metrics[f"reward/{label}/error_count"] = float(result.error_count)
        if self.config.env_weight is not None and keys.ENV_REWARDS in batch.batch.keys():
            env = batch.batch[keys.ENV_REWARDS].float()
            scores = scores + self.config.env_weight * env
            metrics["reward/env_mean"] = _mean(env)
        metrics["reward/score_mean"] = _mean(scores)
        return DataProto.from_dict(
            tensors={keys.TOKEN_LEVEL_SCORES: place_on_last_token(scores, batch.batch[keys.RESPONSE_MASK])},
            meta_info={keys.META_METRICS: metrics},
        )


def _real_rows(batch: DataProto) -> np.ndarray:
    """Indices of the rows that are not dispatch padding."""
    return np.flatnonzero(~batch.padding_mask().numpy())


def reward_rows(batch: DataProto, indices: np.ndarray) -> RewardRows:
    """What user functions see of the given rows: prompt (for messages), response text, answer, data_source and
    extra_info (verl's), from the batch's non-tensor columns."""
    columns = batch.non_tensor_batch
    picked = lambda name, default: [columns[name][i] if name in columns else default for i in indices]  # noqa: E731
    prompts = [_prompt_text(p) for p in picked(keys.PROMPT_TEXT, "")]
    return RewardRows(
        prompts=prompts,
        responses=[str(t) for t in picked(keys.RESPONSE_TEXT, "")],
        answers=[str(a) for a in picked(keys.ANSWER, "")],
        data_sources=[str(s) for s in picked(keys.DATA_SOURCE, "")],
        extra_infos=[dict(e) if isinstance(e, dict) else {} for e in picked(keys.EXTRA_INFO, None)],
    )


def _prompt_text(prompt) -> str:
    """Chat messages -> the last message's content; text stays text."""
    if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if len(values) else 0.0
