"""The reward role for rule-based rewards: built-in names and user functions, weighted and summed, each rank
scoring its share of the batch."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from roll_backend import keys, roles
from roll_backend.config.schema import OverlongBufferConfig
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.worker import Worker
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import place_on_last_token
from roll_backend.rewards import code_tests
from roll_backend.rewards.function_host import RewardFunctionProcess
from roll_backend.rewards.overlong import overlong_penalty
from roll_backend.rewards.registry import REWARDS, RUNS_CODE, builtin_weights, get_reward_fn, score_answer
from roll_backend.rewards.source_routing import SourceRouting
from roll_backend.rewards.user_functions import ON_ERROR_CHOICES, RewardFunctionSpec, RewardRows


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
    by_source: Mapping[str, object] | str | None = None  # reward.by_source (rewards.source_routing)
    overlong_buffer: OverlongBufferConfig | None = None  # reward.overlong_buffer, its max_length resolved

    def __post_init__(self):
        agentic = self.env_weight is not None
        routed = self.by_source is not None  # rewards: null then means none outside the routing
        object.__setattr__(self, "rewards", builtin_weights(self.rewards, bool(self.functions) or agentic or routed))
        if not self.rewards and not self.functions and not agentic and not routed:
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
        if self.overlong_buffer is not None and self.overlong_buffer.max_length is None:
            raise ValueError("overlong_buffer.max_length must be resolved (the run's response_length)")
        labels = [spec.label for spec in self.functions]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(
                f"reward.functions: {repeated} appear more than once; each function's metrics need their own name"
            )
        unknown = sorted(self.routing().names() - set(REWARDS) - set(labels))
        if unknown:
            raise ValueError(
                f"reward.by_source names {unknown}: neither built-in rewards ({', '.join(sorted(REWARDS))}) nor "
                f"labels of reward.functions ({', '.join(labels) or 'none'})"
            )

    def routing(self) -> SourceRouting:
        """Which rewards (built-in names and function labels, with weights) score a row of each source."""
        everywhere = dict(self.rewards) | {spec.label: spec.weight for spec in self.functions}
        return SourceRouting.build(self.by_source, everywhere)


class RewardWorker(Worker):
    """One rank of the rule-based reward role: DP_MP_COMPUTE hands each rank its share of the batch."""

    megatron_grid = False
    poolable = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config is None:
            self.config = RewardWorkerConfig()
        if not isinstance(self.config, RewardWorkerConfig):
            raise TypeError(
                f"RewardWorker takes a RewardWorkerConfig as worker_config, got {type(self.config).__name__}"
            )
        # User code runs in a child process (rewards/function_host.py), loaded at its first call, so its import
        # errors travel like its other errors and this process never imports it.
        self.functions = RewardFunctionProcess(
            tuple(self.config.functions), self.config.on_function_error, self.config.function_timeout_s
        )
        self.routing = self.config.routing()

    @functools.cached_property
    def _code_runner(self):
        """How rewards that run the response's code (code_tests) run it: each program in a fresh bubblewrap sandbox
        with code_tests.TEST_LIMITS. Built at the first such row: SandboxUnavailable says what this machine lacks."""
        from roll_backend.agentic.sandbox import SandboxLimits, make_sandbox

        sandbox, limits = make_sandbox(), SandboxLimits(**code_tests.TEST_LIMITS)
        return lambda code, stdin: sandbox.run_python(code, limits, stdin=stdin)

    def release_role(self) -> bool:
        """Reusable: the user's code ran in the child, which stops here."""
        self.functions.shutdown()
        return True

    @register(Dispatch.DP_MP_COMPUTE, deadline=roles.REWARD_DEADLINE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """RESPONSE_TEXT + ANSWER + RESPONSE_MASK (+ DATA_SOURCE for reward.by_source) -> TOKEN_LEVEL_SCORES
        [B, T_resp] float32 (score on the last token). Each row is scored by the rewards its source routes to."""
        for name in (keys.RESPONSE_TEXT, keys.ANSWER):
            if name not in batch.non_tensor_batch:
                raise KeyError(f"compute_rewards needs the non-tensor column '{name}'")
        if keys.RESPONSE_MASK not in batch.batch.keys():
            raise KeyError(f"compute_rewards needs the tensor column '{keys.RESPONSE_MASK}'")
        columns = batch.non_tensor_batch
        sources = columns[keys.DATA_SOURCE] if keys.DATA_SOURCE in columns else np.full(len(batch), "", dtype=object)
        row_weights = [self.routing.weights_for(str(source)) for source in sources]
        real = _real_rows(batch)  # rows repeated by dispatch padding: not scored, not in the metrics
        scores, metrics = torch.zeros(len(batch)), {}
        texts, answers = columns[keys.RESPONSE_TEXT], columns[keys.ANSWER]
        for name in sorted({name for weights in row_weights for name in weights if name in REWARDS}):
            rows = [i for i in real if name in row_weights[i]]
            run_code = self._code_runner if name in RUNS_CODE else None
            values = [score_answer(name, str(texts[i]), answers[i], run_code) for i in rows]
            values = torch.tensor(values, dtype=torch.float32)
            scores[rows] += values * torch.tensor([row_weights[i][name] for i in rows], dtype=torch.float32)
            metrics[f"reward/{name}_mean"] = _mean(values)
        for index, spec in enumerate(self.config.functions):
            label = spec.label
            routed = np.array([i for i in real if label in row_weights[i]], dtype=np.int64)
            result = self.functions.score(index, reward_rows(batch, routed))
            values = torch.from_numpy(result.scores)
            scores[routed] += values * torch.tensor([row_weights[i][label] for i in routed], dtype=torch.float32)
            metrics[f"reward/{label}/mean"] = _mean(values)
            metrics |= {f"reward/{label}/{key}": float(np.mean(vals)) for key, vals in result.extras.items()}
            metrics[f"reward/{label}/error_count"] = float(result.error_count)
        scores += self._shaping(batch, real, metrics)
        metrics["reward/score_mean"] = _mean(scores[real])
        return DataProto.from_dict(
            tensors={keys.TOKEN_LEVEL_SCORES: place_on_last_token(scores, batch.batch[keys.RESPONSE_MASK])},
            meta_info={keys.META_METRICS: metrics},
        )

    def _shaping(self, batch: DataProto, real: np.ndarray, metrics: dict) -> torch.Tensor:
        """What every row gets on top of its rewards: the environment's reward (multi-turn), DAPO's overlong
        penalty (reward.overlong_buffer; not in validation, whose accuracy counts correct answers, as verl's acc)."""
        added = torch.zeros(len(batch))
        if self.config.env_weight is not None and keys.ENV_REWARDS in batch.batch.keys():
            env = batch.batch[keys.ENV_REWARDS].float()
            added += self.config.env_weight * env
            metrics["reward/env_mean"] = _mean(env[real])
        overlong = self.config.overlong_buffer
        if overlong is not None and not batch.meta_info.get(keys.META_VALIDATE, False):  # (validation: answers only)
            lengths = batch.batch[keys.RESPONSE_MASK].sum(-1)
            penalty = overlong_penalty(lengths, overlong.max_length, overlong.length, overlong.penalty_factor)
            added += penalty
            metrics["reward/overlong_penalty_mean"] = _mean(penalty[real])
            metrics["reward/overlong_fraction"] = _mean((penalty[real] < 0).float())
        return added


def _real_rows(batch: DataProto) -> np.ndarray:
    """Indices of the rows that are not dispatch padding."""
    return np.flatnonzero(~batch.padding_mask().numpy())


def reward_rows(batch: DataProto, indices: np.ndarray) -> RewardRows:
    """What user functions see of the given rows: prompt (for messages), response text, answer, data_source and
    extra_info (verl's), from the batch's non-tensor columns."""
    columns = batch.non_tensor_batch
    picked = lambda name, default: [columns[name][i] if name in columns else default for i in indices]  # noqa: E731
    prompts = picked(keys.PROMPT_TEXT, "")
    return RewardRows(
        prompts=[_prompt_text(p) for p in prompts],
        responses=[str(t) for t in picked(keys.RESPONSE_TEXT, "")],
        answers=list(picked(keys.ANSWER, None)),  # typed, as the data stored them
        data_sources=[str(s) for s in picked(keys.DATA_SOURCE, "")],
        extra_infos=[dict(e) if isinstance(e, dict) else {} for e in picked(keys.EXTRA_INFO, None)],
        messages=[[dict(m) for m in p] if _is_conversation(p) else [] for p in prompts],
    )


def _prompt_text(prompt) -> str:
    """Chat messages -> the last message's content; text stays text."""
    if _is_conversation(prompt):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


def _is_conversation(prompt) -> bool:
    return isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0 and isinstance(prompt[-1], dict)


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if len(values) else 0.0
