"""RewardWorker on a 2-rank Ray group: rule-based scores computed in parallel, placed on the last response token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.config.schema import OverlongBufferConfig
from roll_backend.protocol import DataProto
from roll_backend.workers.reward import RewardWorker, RewardWorkerConfig

# (response text, answer, expected math_verify score)
CASES = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("\\boxed{42}", "42", 1.0),
    ("I think it is 41", "42", 0.0),
    ("}{ garbage \\frac{", "7", 0.0),
    ("", "3", 0.0),
    ("x = \\boxed{3}", "3", 1.0),  # 7 rows: uneven over 2 ranks
]


def rollout_like_batch(lengths: list[int], width: int = 6) -> DataProto:
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()  # [B, T_resp]
    return DataProto.from_dict(
        tensors={keys.RESPONSE_MASK: mask, keys.RESPONSES: torch.randint(0, 100, mask.shape)},
        non_tensors={
            keys.RESPONSE_TEXT: np.array([c[0] for c in CASES], dtype=object),
            keys.ANSWER: np.array([c[1] for c in CASES], dtype=object),
        },
    )


def test_math_rewards_on_a_two_rank_group(make_group):
    group = make_group(RewardWorker, 2, role="reward", worker_config=RewardWorkerConfig({"math_verify": 1.0}))
    lengths = [3, 6, 1, 2, 5, 4, 6]
    out = group.call(RewardWorker.compute_rewards, rollout_like_batch(lengths))
    scores = out.batch[keys.TOKEN_LEVEL_SCORES]
    assert scores.shape == (len(CASES), 6) and scores.dtype == torch.float32
    expected = torch.tensor([c[2] for c in CASES])
    assert torch.equal(scores.sum(dim=1), expected)
    for row, length in enumerate(lengths):
        assert torch.all(scores[row, length:] == 0) and torch.all(scores[row, : length - 1] == 0)
        assert scores[row, length - 1] == expected[row]
    assert np.mean(out.meta_info[keys.META_METRICS]["reward/score_mean"]) == pytest.approx(
        float(expected.mean()), abs=0.1
    )


def dapo_overlong_reward(length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's overlong reward as verl's DAPO reward manager writes it, row by row."""
    expected_len = max_resp_len - buffer_len
    exceed_len = length - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0)


def test_weighted_rewards_with_the_overlong_penalty_and_unknown_name(make_group):
    overlong = OverlongBufferConfig(length=3, penalty_factor=0.7, max_length=6)
    config = RewardWorkerConfig({"math_verify": 1.0, "format_boxed": 0.5}, overlong_buffer=overlong)
    group = make_group(RewardWorker, 2, role="reward", worker_config=config)
    lengths = [6, 5, 4, 3, 1, 6, 2]  # the limit reached, inside the buffer, at its edge, short of it
    out = group.call(RewardWorker.compute_rewards, rollout_like_batch(lengths))
    boxed = torch.tensor([0.5 if "\\boxed{" in c[0] else 0.0 for c in CASES])
    overlong_rewards = torch.tensor([dapo_overlong_reward(length, 6, 3, 0.7) for length in lengths])
    assert overlong_rewards.tolist()[:4] == pytest.approx([-0.7, -0.7 * 2 / 3, -0.7 / 3, 0.0])
    expected = torch.tensor([c[2] for c in CASES]) + boxed + overlong_rewards
    assert torch.allclose(out.batch[keys.TOKEN_LEVEL_SCORES].sum(dim=1), expected)
    metrics = out.meta_info[keys.META_METRICS]
    # Each rank's means, over its own rows only (rows 0-3 | 4-6; the dispatch's padding row not counted).
    assert metrics["reward/overlong_fraction"] == pytest.approx([3 / 4, 1 / 3])
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(
        [float(overlong_rewards[:4].mean()), float(overlong_rewards[4:].mean())]
    )
    # Validation scores the answers alone (its accuracy counts a long right answer as right).
    validation = rollout_like_batch(lengths)
    validation.meta_info[keys.META_VALIDATE] = True
    out = group.call(RewardWorker.compute_rewards, validation)
    assert torch.allclose(out.batch[keys.TOKEN_LEVEL_SCORES].sum(dim=1), expected - overlong_rewards)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardWorkerConfig({"nope": 1.0})


# ---- user functions on a 2-rank group ------------------------------------------------------------------------

USER_REWARDS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise RuntimeError("cannot parse " + solution_str)
    return {"score": float(solution_str.strip() == ground_truth), "level": extra_info.get("level", -1.0)}

def starts_with_digit(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.5 if s[:1].isdigit() else 0.0 for s in solution_strs]

def divide(data_source, solution_str, ground_truth, extra_info=None):
    return 1 / int(solution_str)

def slow(data_source, solution_str, ground_truth, extra_info=None):
    import time
    time.sleep(0 if solution_str != "1" else 60)
    return 1.0

def stuck(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "stuck":
        sum(range(10**13))  # one native call: the per-call deadline's signal waits for it to return (hours)
    return 1.0

def exits(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "exit":
        import os
        os._exit(3)
    return 1.0
"""


def text_batch(responses: list[str], answers: list[str]) -> DataProto:
    n = len(responses)
    return DataProto.from_dict(
        tensors={keys.RESPONSE_MASK: torch.ones(n, 3, dtype=torch.long)},
        non_tensors={
            keys.PROMPT_TEXT: np.array([f"copy {a}" for a in answers], dtype=object),
            keys.RESPONSE_TEXT: np.array(responses, dtype=object),
            keys.ANSWER: np.array(answers, dtype=object),
            keys.DATA_SOURCE: np.array(["copy_digit"] * n, dtype=object),
            keys.EXTRA_INFO: np.array([{"level": float(i)} for i in range(n)], dtype=object),
        },
    )


@pytest.fixture(scope="module")
def user_rewards_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user_rewards") / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_user_functions_mixed_with_a_builtin_and_a_driver_callable(make_group, user_rewards_file):
    from types import SimpleNamespace

    from roll_backend.errors import UserCodeError
    from roll_backend.pipelines.loops.phases import score
    from roll_backend.rewards.user_functions import RewardFunctionSpec

    def answer_length(data_source, solution_str, ground_truth, extra_info=None):  # pickled by value to the workers
        return float(len(ground_truth)) if data_source == "copy_digit" else -100.0

    config = RewardWorkerConfig(
        rewards={"exact_match": 2.0},
        functions=(
            RewardFunctionSpec(path=user_rewards_file, name="compute_score", weight=1.0),
            RewardFunctionSpec(path=user_rewards_file, name="starts_with_digit", weight=1.0, batched=True),
            RewardFunctionSpec(fn=answer_length, weight=0.25),
        ),
    )
    group = make_group(RewardWorker, 2, role="reward", worker_config=config)
    responses, answers = ["7", "3 ", "x", "12", "5"], ["7", "3", "4", "1", "55"]  # 5 rows: one dispatch padding row
    batch = text_batch(responses, answers)
    metrics = score(SimpleNamespace(reward=group, reward_model=None), batch)
    exact = [1.0, 1.0, 0.0, 0.0, 0.0]
    expected = [
        2 * e + e + (0.5 if r[0].isdigit() else 0.0) + 0.25 * len(a) for e, r, a in zip(exact, responses, answers)
    ]
    assert torch.allclose(batch.batch[keys.TOKEN_LEVEL_SCORES][:, -1], torch.tensor(expected))
    assert metrics["reward/user_rewards.compute_score/error_count"] == 0.0
    # extra_info reached the function; metrics are each rank's mean, averaged (rows 0-2 | rows 3-4).
    assert metrics["reward/user_rewards.compute_score/level"] == pytest.approx((1.0 + 3.5) / 2)
    assert metrics["reward/answer_length/mean"] == pytest.approx((1.0 + 1.5) / 2)

    with pytest.raises(UserCodeError) as info:  # a raising user function stops the call, with its row
        group.call(RewardWorker.compute_rewards, text_batch(["7", "boom", "3"], ["7", "8", "3"]))
    message = str(info.value)
    assert "reward.compute_rewards: [reward rank" in message
    assert (
        "user_rewards.compute_score raised RuntimeError: cannot parse boom on row 1 (prompt 'copy 8', response 'boom')"
        in message
    )
    # The group is not broken by a user's error: the next call works.
    assert group.call(RewardWorker.compute_rewards, text_batch(["7"], ["7"])).batch[
        keys.TOKEN_LEVEL_SCORES
    ].sum() == pytest.approx(3.5 + 0.25)


def test_on_function_error_zero_and_the_deadline_in_ray_workers(make_group, user_rewards_file):
    from types import SimpleNamespace

    from roll_backend.pipelines.loops.phases import score
    from roll_backend.rewards.user_functions import RewardFunctionSpec

    config = RewardWorkerConfig(
        rewards={},
        on_function_error="zero",
        function_timeout_s=1.0,
        functions=(
            RewardFunctionSpec(path=user_rewards_file, name="divide"),
            RewardFunctionSpec(path=user_rewards_file, name="slow"),
        ),
    )
    group = make_group(RewardWorker, 2, role="reward", worker_config=config)
    batch = text_batch(["1", "0", "4", "0", "1", "2"], ["0"] * 6)
    metrics = score(SimpleNamespace(reward=group, reward_model=None), batch)
    divide = [1.0, 0.0, 0.25, 0.0, 1.0, 0.5]
    slow = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # "1" sleeps past the deadline: scored 0
    assert torch.allclose(batch.batch[keys.TOKEN_LEVEL_SCORES][:, -1], torch.tensor(divide) + torch.tensor(slow))
    assert metrics["reward/user_rewards.divide/error_count"] == 2.0  # summed over both ranks
    assert metrics["reward/user_rewards.slow/error_count"] == 2.0


def test_a_function_stuck_in_native_code_or_ending_its_process_is_named_and_the_rank_goes_on(
    make_group, user_rewards_file
):
    """User functions run in a child of the rank (rewards/function_host.py): one that Python's per-call deadline
    cannot interrupt is killed at its batch's deadline, one that exits ends the child, not the rank; either is named,
    and the next batch is scored by a fresh child."""
    from roll_backend.distributed.worker import Worker
    from roll_backend.errors import UserCodeError
    from roll_backend.rewards.user_functions import RewardFunctionSpec

    functions = tuple(RewardFunctionSpec(path=user_rewards_file, name=name) for name in ("stuck", "exits"))
    group = make_group(
        RewardWorker, 1, role="reward", worker_config=RewardWorkerConfig(function_timeout_s=0.5, functions=functions)
    )
    pids = group.call(Worker.pid)
    with pytest.raises(UserCodeError) as info:
        group.call(RewardWorker.compute_rewards, text_batch(["stuck"], ["1"]))
    assert (
        "reward function user_rewards.stuck did not finish a batch of 1 rows within 2.5s "
        "(reward.function_timeout_s=0.5 per call, stuck where Python cannot interrupt it), so its process was killed"
    ) in str(info.value)
    with pytest.raises(UserCodeError) as info:
        group.call(RewardWorker.compute_rewards, text_batch(["7", "exit"], ["7", "7"]))
    assert "reward function user_rewards.exits ended its process (exited with code 3)" in str(info.value)
    scores = group.call(RewardWorker.compute_rewards, text_batch(["7", "8"], ["7", "7"])).batch
    assert scores[keys.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [2.0, 2.0]
    assert group.call(Worker.pid) == pids  # the rank lived through both

    zero = RewardWorkerConfig(on_function_error="zero", functions=functions)
    group = make_group(RewardWorker, 1, role="reward", worker_config=zero)
    scored = group.call(RewardWorker.compute_rewards, text_batch(["7", "exit", "8"], ["7", "7", "7"]))
    assert scored.batch[keys.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 1.0, 1.0]  # stuck's; exits' batch lost
    assert scored.meta_info[keys.META_METRICS]["reward/user_rewards.exits/error_count"] == [3.0]


# ---- reward.by_source and class-based rewards -------------------------------------------------------------------

CLASS_REWARDS = """
class ExactMatchScorer:
    '''ROLL-style reward object: built once per rank, scored per batch.'''

    def __init__(self, bonus):
        self.bonus = bonus
        self.calls = 0

    def compute_rewards(self, rows):
        self.calls += 1
        return [
            {"score": float(r in (a if isinstance(a, list) else [a])) + self.bonus, "calls": float(self.calls),
             "typed": float(isinstance(a, list))}
            for r, a in zip(rows.responses, rows.answers)
        ]


class LengthPenalty:
    def __call__(self, data_sources, solution_strs, ground_truths, extra_infos):
        return [-0.1 * len(s) for s in solution_strs]
"""


CODE_TESTS = '{"inputs": ["2\\n", "5\\n"], "outputs": ["4\\n", "11\\n"]}'


def test_by_source_scores_a_mixed_batch_per_source_with_builtins_and_classes(make_group, tmp_path):
    from types import SimpleNamespace

    from roll_backend.pipelines.loops.phases import score
    from roll_backend.rewards.user_functions import RewardFunctionSpec

    path = tmp_path / "class_rewards.py"
    path.write_text(CLASS_REWARDS)
    config = RewardWorkerConfig(
        rewards={},
        functions=(
            RewardFunctionSpec(path=str(path), name="ExactMatchScorer", kwargs={"bonus": 0.25}),
            RewardFunctionSpec(path=str(path), name="LengthPenalty"),
        ),
        by_source={
            "openai/gsm8k": "gsm8k",
            "math*": {"math_verify": 2.0},
            "code": ["class_rewards.ExactMatchScorer", "class_rewards.LengthPenalty"],
            "default": "auto",
        },
    )
    group = make_group(RewardWorker, 2, role="reward", worker_config=config)
    rows = [  # (source, response, answer as stored, expected score)
        ("openai/gsm8k", "#### 12", "12", 1.0),
        ("math_dapo", "\\boxed{\\frac{1}{2}}", "0.5", 2.0),
        ("code", "ok", ["ok", "fine"], 1.25 - 0.2),  # a list of accepted answers reaches the class typed
        ("crossthinkqa", "Answer: B", 1, 1.0),  # `auto`: ROLL's multiple-choice tag, an option index
        ("code", "bad", ["ok"], 0.25 - 0.3),
        ("openai/gsm8k", "#### 13", "12", 0.0),
        ("math", "\\boxed{3}", "4", 0.0),
        # `auto`: verl's code source, its tests run in the sandbox from the rank (APPS layout, as JSON text)
        ("codecontests", "```python\nprint(int(input()) * 2)\n```", CODE_TESTS, 0.5),
    ]
    n = len(rows)
    batch = DataProto.from_dict(
        tensors={keys.RESPONSE_MASK: torch.ones(n, 3, dtype=torch.long)},
        non_tensors={
            keys.PROMPT_TEXT: np.array(["p"] * n, dtype=object),
            keys.RESPONSE_TEXT: np.array([r[1] for r in rows], dtype=object),
            keys.ANSWER: _object_array([r[2] for r in rows]),
            keys.DATA_SOURCE: np.array([r[0] for r in rows], dtype=object),
            keys.EXTRA_INFO: np.array([{}] * n, dtype=object),
        },
    )
    metrics = score(SimpleNamespace(reward=group, reward_model=None), batch)
    assert torch.allclose(batch.batch[keys.TOKEN_LEVEL_SCORES][:, -1], torch.tensor([r[3] for r in rows]))
    assert metrics["reward/class_rewards.ExactMatchScorer/typed"] == 1.0  # every code row's answer was a list
    # Each rank built its object once and calls it per batch (the second batch is its second call).
    group.call(RewardWorker.compute_rewards, batch)
    calls = score(SimpleNamespace(reward=group, reward_model=None), batch)[
        "reward/class_rewards.ExactMatchScorer/calls"
    ]
    assert calls == 3.0

    unrouted = DataProto.from_dict(
        tensors={keys.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.long)},
        non_tensors={
            keys.RESPONSE_TEXT: np.array(["1", "2"], dtype=object),
            keys.ANSWER: np.array(["1", "2"], dtype=object),
            keys.DATA_SOURCE: np.array(["mine", "mine"], dtype=object),
        },
    )
    from roll_backend.distributed.worker_group import RankRaisedError

    with pytest.raises(RankRaisedError, match="UnroutedSource: reward.by_source: source 'mine' has no built-in"):
        group.call(RewardWorker.compute_rewards, unrouted)


def test_by_source_names_must_be_rewards_there_are():
    with pytest.raises(ValueError, match=r"reward.by_source names \['nope'\]"):
        RewardWorkerConfig(rewards={}, by_source={"a": "exact_match", "default": "nope"})


def _object_array(values: list) -> np.ndarray:
    array = np.empty(len(values), dtype=object)  # 1-D even where entries are lists
    for index, value in enumerate(values):
        array[index] = value
    return array
