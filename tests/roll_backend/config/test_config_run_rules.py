"""Rules a strategy enforces when its ranks start, checked by `validate` before Ray starts (issue 27): each used to
pass validation and fail later with a traceback on a rank."""

from __future__ import annotations

import pytest
from test_config_errors import CONFIG, base, problems_of  # noqa: F401  (base: a fixture)

from roll_backend.config.loader import load_config


def test_a_zero_response_length_is_refused_before_any_rank_starts(base):
    problems = problems_of(base + ["response_length=0"])
    assert "response_length=0 must be >= 1 (the most tokens a response may have)" in problems
    # the rollout's own rule (its sampling takes max_tokens from the run) says so too, naming the role
    assert any(p.startswith("actor_infer.strategy: ") and "max_tokens=0" in p for p in problems), problems


@pytest.mark.parametrize("lr, min_lr", [(-1e-3, -2e-3), (-1e-3, 0.0), (1e-3, -1e-4)])
def test_negative_learning_rates_are_refused(base, lr, min_lr):
    problems = problems_of(
        base + [f"actor_train.strategy.optimizer.lr={lr}", f"actor_train.strategy.optimizer.min_lr={min_lr}"]
    )
    expected = [
        f"optimizer.{name}={value} must be >= 0" for name, value in (("lr", lr), ("min_lr", min_lr)) if value < 0
    ]
    for message in expected:
        assert any(message in p and p.startswith("actor_train.strategy") for p in problems), (message, problems)


def test_a_model_path_that_is_a_file_says_so(base, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    problems = problems_of(base + ["build_tiny_model=null", f"model_path={weights}"])
    assert problems[0] == (
        f"model_path={str(weights)!r} is a file; point it at the folder that holds the model "
        "(config.json, weights, tokenizer)"
    )
    assert not any("does not exist" in p for p in problems)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_baselines_need_more_than_one_response_per_prompt(base, estimator):
    [problem] = problems_of(
        base
        + [
            f"algorithm.adv_estimator={estimator}",
            "num_return_sequences_in_group=1",
            "rollout_batch_size=64",
            "algorithm.ppo_mini_batch_size=null",
        ]
    )
    assert problem.startswith(f"algorithm.adv_estimator={estimator} compares each response with the others")
    assert "num_return_sequences_in_group=1" in problem and "set num_return_sequences_in_group >= 2" in problem


def test_estimators_without_a_group_baseline_take_one_response_per_prompt(base):
    config = load_config(
        CONFIG,
        base
        + [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "num_return_sequences_in_group=1",
            "rollout_batch_size=64",
            "algorithm.ppo_mini_batch_size=null",
        ],
    )
    assert config.num_return_sequences_in_group == 1
