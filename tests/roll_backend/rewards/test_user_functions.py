"""User reward functions without Ray: loading (file, module, callable), verl's per-row and batched call forms,
return values, the errors' messages, on_error=zero, the per-call deadline and the config checks."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from roll_backend.config.loader import load_config
from roll_backend.config.typed import ConfigError
from roll_backend.errors import UserCodeError
from roll_backend.rewards.user_functions import FunctionScorer, RewardFunctionSpec, RewardRows, as_score, check_spec

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "reward_functions.py")
CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml")

USER_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {
        "score": float(solution_str == ground_truth),
        "level": extra_info["level"],
        "src_is_math": float(data_source == "math"),
    }

def divide(data_source, solution_str, ground_truth, extra_info=None):
    return 1 / int(solution_str)

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "good" if solution_str == "x" * 200 else 1.0

def slow(data_source, solution_str, ground_truth, extra_info=None):
    import time
    time.sleep(30)
    return 1.0

def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0]
"""


def rows(responses=("7", "0", "3"), answers=("7", "1", "3")) -> RewardRows:
    n = len(responses)
    return RewardRows(
        prompts=[f"copy {a}" for a in answers],
        responses=list(responses),
        answers=list(answers),
        data_sources=["math", "gsm8k", "math"][:n],
        extra_infos=[{"level": float(i)} for i in range(n)],
    )


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user_rewards") / "my_rewards.py"
    path.write_text(USER_FILE)
    return str(path)


def test_verl_signature_with_dict_returns_and_extra_info(user_file):
    out = FunctionScorer(RewardFunctionSpec(path=user_file)).score(rows())
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.extras == {"level": [0.0, 1.0, 2.0], "src_is_math": [1.0, 0.0, 1.0]} and out.error_count == 0


def test_batched_form_and_the_example_file():
    per_row = FunctionScorer(RewardFunctionSpec(path=EXAMPLE, name="compute_score")).score(rows(("7 and", "0", "3")))
    assert per_row.scores.tolist() == [1.0, 0.0, 1.0] and per_row.extras["response_chars"] == [5.0, 1.0, 1.0]
    batched = FunctionScorer(RewardFunctionSpec(path=EXAMPLE, name="length_penalty", batched=True)).score(
        rows(("7 and", "0", "3"))
    )
    assert np.allclose(batched.scores, [-0.04, 0.0, 0.0])


def test_module_name_and_callable_load_the_same_function(monkeypatch, user_file):
    monkeypatch.syspath_prepend(str(Path(user_file).parent))
    by_module = FunctionScorer(RewardFunctionSpec(path="my_rewards")).score(rows())
    by_callable = FunctionScorer(
        RewardFunctionSpec(
            fn=lambda data_source, solution_str, ground_truth, extra_info=None: float(solution_str == ground_truth)
        )
    ).score(rows())
    assert by_module.scores.tolist() == by_callable.scores.tolist() == [1.0, 0.0, 1.0]


def test_a_function_gets_its_kwargs_on_every_call_row_by_row_or_batched():
    """verl's custom_reward_function.reward_kwargs: extra keyword arguments on every call."""

    def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, bonus=0.0):
        return scale * float(solution_str == ground_truth) + bonus

    def scaled_batch(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]

    per_row = FunctionScorer(RewardFunctionSpec(fn=scaled, kwargs={"scale": 2.0, "bonus": 0.5})).score(rows())
    assert per_row.scores.tolist() == [2.5, 0.5, 2.5]
    batched = FunctionScorer(RewardFunctionSpec(fn=scaled_batch, batched=True, kwargs={"scale": 3.0})).score(rows())
    assert batched.scores.tolist() == [3.0, 0.0, 3.0]
    clash = check_spec(RewardFunctionSpec(fn=scaled, kwargs={"ground_truth": "x", "scale": 1}), "reward.functions[0]")
    assert clash == [
        "reward.functions[0].kwargs names ['ground_truth'], which every call passes itself; rename them in the function"
    ]


def test_return_values():
    assert as_score(1) == (1.0, {}) and as_score(np.float32(0.5)) == (0.5, {})
    assert as_score({"score": 2, "acc": True, "note": "text"}) == (2.0, {"acc": 1.0})
    for bad, message in (
        (None, "returned NoneType"),
        ("1.0", "returned str"),
        ({"acc": 1}, "without a 'score'"),
        (float("nan"), "finite number"),
    ):
        with pytest.raises(TypeError, match=message):
            as_score(bad)


def test_a_raising_function_names_itself_the_row_and_the_exception(user_file):
    with pytest.raises(UserCodeError) as info:
        FunctionScorer(RewardFunctionSpec(path=user_file, name="divide")).score(rows(("1", "0", "2")))
    message = str(info.value)
    assert "my_rewards.divide raised ZeroDivisionError: division by zero" in message
    assert "row 1 (prompt 'copy 1', response '0')" in message and "reward.on_function_error=zero" in message


def test_a_non_number_is_reported_with_a_shortened_row(user_file):
    long_response = "x" * 200
    with pytest.raises(UserCodeError) as info:
        FunctionScorer(RewardFunctionSpec(path=user_file, name="text")).score(rows(("7", long_response), ("7", "1")))
    message = str(info.value)
    assert "my_rewards.text returned str 'good'" in message and "on row 1" in message
    assert "x" * 117 + "...'" in message and "x" * 118 not in message


def test_on_error_zero_scores_failed_rows_zero_and_counts_them(user_file):
    out = FunctionScorer(RewardFunctionSpec(path=user_file, name="divide"), on_error="zero").score(
        rows(("1", "0", "4"))
    )
    assert out.scores.tolist() == [1.0, 0.0, 0.25] and out.error_count == 1
    batch = FunctionScorer(
        RewardFunctionSpec(path=user_file, name="wrong_length", batched=True), on_error="zero"
    ).score(rows())
    assert batch.scores.tolist() == [0.0, 0.0, 0.0] and batch.error_count == 3


def test_wrong_length_from_a_batched_function(user_file):
    with pytest.raises(UserCodeError, match="wrong_length returned 1 scores for 3 rows.*a batch of 3 rows"):
        FunctionScorer(RewardFunctionSpec(path=user_file, name="wrong_length", batched=True)).score(rows())


def test_per_call_deadline_stops_a_slow_function(user_file):
    started = time.monotonic()
    with pytest.raises(
        UserCodeError, match=r"my_rewards.slow did not return within reward.function_timeout_s=0.2s on row 0"
    ):
        FunctionScorer(RewardFunctionSpec(path=user_file, name="slow"), timeout_s=0.2).score(rows())
    assert time.monotonic() - started < 25  # interrupted, not waited out (the function sleeps 30 s)


def test_import_errors_are_user_code_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\ndef compute_score(*a, **k):\n    return 1.0\n")
    with pytest.raises(
        UserCodeError, match="loading reward function broken.compute_score .* raised ModuleNotFoundError"
    ):
        FunctionScorer(RewardFunctionSpec(path=str(broken))).score(rows())


def test_config_checks_run_before_ray(user_file):
    assert check_spec(RewardFunctionSpec(path=user_file, name="divide"), "f") == []
    assert (
        "defines no such name; functions there: compute_score, divide, slow, text, wrong_length"
        in check_spec(RewardFunctionSpec(path=user_file, name="compute_scor"), "f")[0]
    )
    assert "is no importable module" in check_spec(RewardFunctionSpec(path="no_such_reward_module"), "f")[0]
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]: a reward function needs exactly one of `path`"):
        load_config(CONFIG, ["reward.functions=[{name: compute_score}]"])
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [f"reward.functions=[{{path: {user_file}, name: nope}}]", "reward.on_function_error=skip"])
    message = str(info.value)
    assert "reward.functions[0].name='nope'" in message
    assert "reward.on_function_error='skip'; choose one of raise, zero" in message
    config = load_config(CONFIG, [f"reward.functions=[{{path: {user_file}, weight: 0.5, batched: false}}]"])
    assert config.reward.functions[0] == RewardFunctionSpec(path=user_file, weight=0.5)
    assert config.reward.builtin_weights() == {"copy_digit": 1.0}  # the YAML's built-in stays, summed with it


def test_a_callable_in_a_pipeline_config_is_named_in_the_saved_yaml():
    import dataclasses

    from roll_backend.config.loader import config_to_yaml

    def my_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    config = load_config(CONFIG, [])
    config = dataclasses.replace(
        config, reward=dataclasses.replace(config.reward, functions=[RewardFunctionSpec(fn=my_score, weight=0.5)])
    )
    text = config_to_yaml(config)
    assert "fn: <python callable" in text and "my_score>" in text


def test_a_reward_class_is_built_once_with_its_kwargs_and_its_failures_name_it():
    class Scorer:  # given directly from a driver script; from YAML the spec names a class in a file
        built = 0

        def __init__(self, scale):
            Scorer.built += 1
            self.scale = scale

        def compute_rewards(self, batch):
            return [self.scale * float(r == a) for r, a in zip(batch.responses, batch.answers)]

    scorer = FunctionScorer(RewardFunctionSpec(fn=Scorer, kwargs={"scale": 3.0}))
    assert list(scorer.score(rows()).scores) == [3.0, 0.0, 3.0]
    assert list(scorer.score(rows()).scores) == [3.0, 0.0, 3.0] and Scorer.built == 1

    class Broken:
        def __init__(self):
            raise OSError("no model file")

    with pytest.raises(UserCodeError, match=r"building reward class Broken\(\{\}\) raised OSError: no model file"):
        FunctionScorer(RewardFunctionSpec(fn=Broken)).score(rows())

    class Batched:
        def __call__(self, data_sources, solution_strs, ground_truths, extra_infos):
            return [float(s == "math") for s in data_sources]

    assert list(FunctionScorer(RewardFunctionSpec(fn=Batched)).score(rows()).scores) == [1.0, 0.0, 1.0]


class _FailsToUnpickle:
    def __reduce__(self):
        return (eval, ("1/0",))  # raises where the child unpickles the specs


def test_a_child_that_cannot_build_the_scorers_is_a_named_error_and_the_next_batch_tries_again():
    from roll_backend.rewards.function_host import RewardFunctionProcess
    from roll_backend.rewards.user_functions import RewardFunctionSpec, RewardRows

    bomb = _FailsToUnpickle()

    def score(data_source, solution_str, ground_truth, extra_info=None, _bomb=bomb):
        return 1.0

    functions = RewardFunctionProcess((RewardFunctionSpec(fn=score),), "raise", 1.0)
    rows = RewardRows(prompts=["p"], responses=["r"], answers=["a"], data_sources=["s"], extra_infos=[{}])
    try:
        for _ in range(2):  # (the second batch opens a new session, and fails the same way)
            with pytest.raises(UserCodeError, match=r"reward function score raised ZeroDivisionError"):
                functions.score(0, rows)
    finally:
        functions.shutdown()
