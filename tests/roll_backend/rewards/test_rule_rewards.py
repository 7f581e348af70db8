"""Rule-based rewards: math equivalence, boxed answers, wrong answers and garbage, exact match, format, registry."""

import threading

import pytest

from roll_backend.rewards import exact_match, format_rules, math_answer
from roll_backend.rewards.registry import REWARDS, get_reward_fn, weighted_score


@pytest.mark.parametrize(
    "response, answer",
    [
        ("The answer is 0.5", "1/2"),
        ("so the result is \\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("We get $\\frac{\\sqrt{2}}{2}$", "\\sqrt{2}/2"),
        ("x = \\boxed{42}", "42"),
        ("first guess 41, final \\boxed{42}", "42"),  # the boxed answer wins over earlier numbers
        ("the answer is 7", "7"),
    ],
)
def test_math_equivalent_forms_score_one(response, answer):
    assert math_answer.score(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("The answer is 3", "1/2"),
        ("first 42, final \\boxed{41}", "42"),
        ("\\boxed{0.51}", "1/2"),
    ],
)
def test_math_wrong_answers_score_zero(response, answer):
    assert math_answer.score(response, answer) == 0.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("asdf }{ \\frac{", "1/2"),
        ("", "2"),
        ("{{{{ \\boxed{", "{{"),
        ("\x00\x01 ))) \\\\", "3"),
        (None, "3"),
        ("\\boxed{3}", None),
    ],
)
def test_math_garbage_scores_zero_without_raising(response, answer):
    assert math_answer.score(response, answer) == 0.0


def test_math_score_works_off_the_main_thread():
    # math-verify's signal-based timeout raises ValueError off the main thread; score must avoid it.
    results = []
    worker = threading.Thread(target=lambda: results.append(math_answer.score("\\boxed{0.5}", "1/2")))
    worker.start()
    worker.join()
    assert results == [1.0]


def test_dapo_scale_reads_the_end_of_the_response():
    """verl's math_dapo scorer: +1 right, -1 wrong (no 0), over the last 300 characters (its `Answer:` line)."""
    assert math_answer.dapo_score("3 + 4 = 7, times 6.\nAnswer: 42", "42") == 1.0
    assert math_answer.dapo_score("so it is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer.dapo_score("Answer: 41", "42") == -1.0
    assert math_answer.dapo_score("", "42") == -1.0
    # The right answer early, a wrong one at the end: only the window counts (and with it, the wrong one).
    long_response = "Answer: 42\n" + "x" * math_answer.DAPO_WINDOW + "\nAnswer: 41"
    assert math_answer.score(long_response, "42") == 0.0 and math_answer.dapo_score(long_response, "42") == -1.0
    early_only = "Answer: 42\n" + "thinking " * 40
    assert math_answer.dapo_score(early_only, "42") == -1.0 and math_answer.score(early_only, "42") == 1.0


def test_exact_match():
    assert exact_match.score("  Paris. ", "paris") == 1.0
    assert exact_match.score("I think \\boxed{Paris}", "Paris") == 1.0
    assert exact_match.score("Paris is nice", "Paris") == 0.0
    assert exact_match.score("0.5", "1/2") == 0.0  # exact means exact, unlike math_verify


def test_format_rewards():
    assert format_rules.boxed_score("work... so \\boxed{12}.", "") == 1.0
    assert format_rules.boxed_score("\\boxed{12} and more words", "") == 0.0
    assert format_rules.boxed_score("no box", "") == 0.0
    assert format_rules.think_answer_score("<think>a</think> <answer>b</answer>", "") == 1.0
    assert format_rules.think_answer_score("<answer>b</answer>", "") == 0.0
    assert format_rules.regex_format(r"\d+")("123", "") == 1.0


def test_registry_names_and_weighted_score():
    assert set(REWARDS) >= {"math_verify", "exact_match", "format_boxed"}
    assert weighted_score({"math_verify": 1.0, "format_boxed": 0.5}, "so \\boxed{0.5}", "1/2") == 1.5
    with pytest.raises(ValueError, match="unknown reward 'mathh'; known: .*math_verify"):
        get_reward_fn("mathh")
