"""The one list of rule-based reward names: name -> pure `score(response_text, answer) -> float`, and how a typed
reference answer (text, a number, a list of accepted answers) reaches them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from roll_backend.rewards import code_tests, copy_digit, exact_match, format_rules, gsm8k, math_answer, multiple_choice

RewardFn = Callable[[str, str], float]
CodeRunner = code_tests.CodeRunner

REWARDS: Mapping[str, RewardFn] = {
    "math_verify": math_answer.score,  # MATH-style answers (a \boxed{} one preferred), equivalence by math-verify
    "math_dapo": math_answer.dapo_score,  # the same judgement on DAPO's scale: +1 right, -1 wrong (verl's math_dapo)
    "exact_match": exact_match.score,
    "gsm8k": gsm8k.score,  # the number after `####` (verl's strict gsm8k scorer)
    "gsm8k_flexible": gsm8k.flexible_score,  # the response's last number
    "multiple_choice": multiple_choice.score,  # the chosen letter A-J; the reference a letter or an option index
    "format_boxed": format_rules.boxed_score,
    "format_think_answer": format_rules.think_answer_score,
    "code_tests": code_tests.score,  # the fraction of the reference's test cases the response's code passes
    "copy_digit": copy_digit.score,  # the default demo's synthetic task (roll_backend.pipelines.data.synthetic_tasks)
}
# Rewards that judge the response alone: rows need no reference answer for them.
ANSWER_FREE = frozenset({"format_boxed", "format_think_answer"})
# Rewards that take the reference as stored (multiple_choice reads an option index); the others get text.
TYPED_ANSWER = frozenset({"multiple_choice"})
# Rewards that run the response's code: their caller gives them a runner (code_tests.CodeRunner; the reward worker's
# is the sandbox), so no code is run where nobody chose how. Their reference is taken whole, as stored (a list is
# one set of test cases, not a list of accepted answers), and a missing one is an error, not a 0.
RUNS_CODE = frozenset({"code_tests"})

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


def score_answer(name: str, response_text: str, answer: Any, run_code: CodeRunner | None = None) -> float:
    """Reward `name` of a response against a reference kept as the data stored it: a list (or array) of accepted
    answers scores its best match, a missing answer scores 0 (an answer-free reward ignores it). `run_code`: how
    the rewards in RUNS_CODE run the response's code."""
    fn = get_reward_fn(name)
    if name in RUNS_CODE:
        if run_code is None:
            raise ValueError(f"reward {name!r} runs the response's code: pass run_code (e.g. the sandbox's runner)")
        return float(fn(str(response_text), answer, run_code))
    if name in ANSWER_FREE:
        return float(fn(str(response_text), ""))
    if answer is None:
        return 0.0
    if isinstance(answer, (list, tuple, np.ndarray)):
        return max((score_answer(name, response_text, item) for item in answer), default=0.0)
    return float(fn(str(response_text), answer if name in TYPED_ANSWER else str(answer)))


def weighted_score(weights: Mapping[str, float], response_text: str, answer: Any) -> float:
    """Sum of weight * score over the named rewards, e.g. {"math_verify": 1.0, "format_boxed": 0.1}."""
    return float(sum(weight * score_answer(name, response_text, answer) for name, weight in weights.items()))
