"""reasoning-gym rows and their reward: the library's generator and its own verifier, no Ray."""

from __future__ import annotations

import dataclasses

import pytest

from roll_backend.pipelines.data.procedural_tasks import reasoning_gym_rows
from roll_backend.pipelines.data.rows import DataError
from roll_backend.rewards.procedural import compute_score, response_answer


@dataclasses.dataclass(frozen=True)
class Spec:  # the fields of config.schema.ReasoningGymData
    name: str
    size: int = 5
    seed: int = 0
    config: dict = dataclasses.field(default_factory=dict)


def test_rows_are_drawn_from_the_seed_and_carry_the_verifier_inputs():
    rows = reasoning_gym_rows(Spec("basic_arithmetic", seed=3)).rows
    assert rows == reasoning_gym_rows(Spec("basic_arithmetic", seed=3)).rows
    assert rows != reasoning_gym_rows(Spec("basic_arithmetic", seed=4)).rows
    assert len(rows) == 5 and {row["data_source"] for row in rows} == {"basic_arithmetic"}
    entry = rows[0]["extra_info"]["reasoning_gym"]["entry"]
    assert entry["question"] == rows[0]["prompt"] and str(entry["answer"]) == rows[0]["answer"]


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum"])
def test_the_library_verifier_scores_the_reference_answer_and_refuses_a_wrong_one(name):
    for row in reasoning_gym_rows(Spec(name)).rows:
        answer, info = row["answer"], row["extra_info"]
        assert compute_score(name, f"thinking... <answer>{answer}</answer>", answer, info) == 1.0
        assert compute_score(name, f"so \\boxed{{{answer}}}", answer, info) == 1.0
        assert compute_score(name, "<answer>not a number</answer>", answer, info) == 0.0


def test_answer_extraction_prefers_tags_then_boxed():
    assert response_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert response_answer("x \\boxed{7}.") == "7" and response_answer(" 12 ") == "12"


def test_unknown_dataset_and_rows_without_the_entry_say_what_to_change():
    with pytest.raises(DataError, match="no dataset 'basic_arithmetc'; did you mean basic_arithmetic"):
        reasoning_gym_rows(Spec("basic_arithmetc"))
    with pytest.raises(ValueError, match="reasoning-gym rows only"):
        compute_score("other", "1", "1", {"level": 2})
