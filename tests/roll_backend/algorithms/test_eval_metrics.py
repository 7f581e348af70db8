"""pass@k, maj@k and mean@n against hand-computed cases."""

from __future__ import annotations

import itertools

import pytest

from roll_backend.algorithms.eval_metrics import majority_correct, pass_at_k, validation_metrics


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 0, 1, 0.0),  # nothing correct
        (4, 4, 2, 1.0),  # everything correct
        (4, 1, 4, 1.0),  # k = n: the one correct sample is always drawn
        (4, 1, 1, 0.25),
        (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2) = 1/6 of the pairs miss both correct ones
        (5, 2, 3, 0.9),  # C(3,3)/C(5,3) = 1/10 of the triples miss both
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_equals_the_fraction_of_k_subsets_holding_a_correct_sample():
    for n, c in [(6, 2), (7, 3), (5, 1)]:
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_k_above_n_is_refused():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="k <= n"):
        majority_correct(["a", "b"], [1.0, 0.0], 3, 1.0)


def test_majority_vote_with_ties_broken_by_reward_then_order():
    # "7" twice (wrong), "8" once (right): the majority is wrong.
    assert majority_correct(["7", "8", "7"], [0.0, 1.0, 0.0], 3, 1.0) == 0.0
    # Only the first k samples vote: of ["8", "7"] both once, the tie goes to the rewarded "8".
    assert majority_correct(["8", "7", "7"], [1.0, 0.0, 0.0], 2, 1.0) == 1.0
    assert majority_correct(["7", "8", "7"], [0.0, 1.0, 0.0], 2, 1.0) == 1.0
    # Equal count and reward: the answer seen first wins.
    assert majority_correct(["a", "b"], [0.5, 0.5], 2, 0.5) == 1.0
    assert majority_correct(["a", "b"], [0.4, 0.4], 2, 0.5) == 0.0
    assert majority_correct(["x"] * 4, [1.0] * 4, 4, 1.0) == 1.0  # k = n, all agree and right


def test_validation_metrics_per_source_and_overall():
    # Prompt p (source "math"): 4 samples, 1 correct. Prompt q (source "code"): 4 samples, all correct.
    prompts = ["p"] * 4 + ["q"] * 4
    sources = ["math"] * 4 + ["code"] * 4
    rewards = [0.0, 1.0, 0.0, 0.0] + [1.0] * 4
    answers = ["1", "2", "1", "3"] + ["x"] * 4
    lengths = [2, 4, 6, 8] + [1] * 4
    metrics = validation_metrics(prompts, sources, rewards, answers, lengths, pass_k=[1, 2], maj_k=[4], threshold=1.0)
    assert metrics["val/math/mean@4"] == 0.25 and metrics["val/code/mean@4"] == 1.0
    assert metrics["val/math/pass@1"] == 0.25 and metrics["val/math/pass@2"] == pytest.approx(0.5)  # 1 - 3/6
    assert metrics["val/math/maj@4"] == 0.0 and metrics["val/code/maj@4"] == 1.0  # "1" wins twice, and is wrong
    assert metrics["val/math/response_length"] == 5.0
    assert metrics["val/all/mean@4"] == pytest.approx(0.625)
    assert metrics["val/all/pass@2"] == pytest.approx(0.75) and metrics["val/all/maj@4"] == 0.5
