"""copy_digit reward: exact digit 1.0, right digit then more text 0.5, anything else 0.0; registered by name."""

import pytest

from roll_backend.rewards import copy_digit
from roll_backend.rewards.registry import get_reward_fn, weighted_score


@pytest.mark.parametrize("response", ["7", " 7", "7\n", "\n7 "])
def test_exactly_the_digit_scores_one(response):
    assert copy_digit.score(response, "7") == 1.0


@pytest.mark.parametrize("response", ["77", "7 copy", "73"])
def test_right_digit_then_more_scores_half(response):
    assert copy_digit.score(response, "7") == 0.5


@pytest.mark.parametrize(
    "response, answer", [("3", "7"), ("", "7"), ("copy 7", "7"), ("37", "7"), (None, "7"), ("7", None), ("7", "")]
)
def test_wrong_or_garbage_scores_zero(response, answer):
    assert copy_digit.score(response, answer) == 0.0


def test_registered_as_copy_digit():
    assert get_reward_fn("copy_digit") is copy_digit.score
    assert weighted_score({"copy_digit": 1.0}, "7", "7") == 1.0
