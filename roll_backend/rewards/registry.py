"""The one list of rule-based reward names: name -> pure `score(response_text, answer) -> float`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from roll_backend.rewards import copy_digit, exact_match, format_rules, math_answer

RewardFn = Callable[[str, str], float]

REWARDS: Mapping[str, RewardFn] = {
    "math_verify": math_answer.score,
    "exact_match": exact_match.score,
    "format_boxed": format_rules.boxed_score,
    "format_think_answer": format_rules.think_answer_score,
    "copy_digit": copy_digit.score,  # the default demo's synthetic task (roll_backend.pipelines.data.synthetic_tasks)
}


DEFAULT_REWARDS = {"math_verify": 1.0}


def builtin_weights(rewards: Mapping[str, float] | None, has_functions: bool) -> dict[str, float]:
    """The built-in rewards a reward section asks for: as given, else math_verify alone unless user functions are
    set.
    """
    if rewards is not None:
        return dict(rewards)
    return {} if has_functions else dict(DEFAULT_REWARDS)


def get_reward_fn(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward '{name}'; known: {', '.join(sorted(REWARDS))}.") from None


def weighted_score(weights: Mapping[str, float], response_text: str, answer: str) -> float:
    """Sum of weight * score over the named rewards, e.g. {"math_verify": 1.0, "format_boxed": 0.1}."""
    return float(sum(weight * get_reward_fn(name)(response_text, answer) for name, weight in weights.items()))
