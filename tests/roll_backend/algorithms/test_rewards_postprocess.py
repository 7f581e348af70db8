"""Response-score normalisation (batch or group) and clipping."""

import math

import pytest
import torch

from roll_backend.algorithms import clip_rewards, normalize_rewards, postprocess_rewards

SCORES = torch.tensor([1.0, 2.0, 3.0, 4.0])
EPS = 1e-6


def test_batch_normalisation_uses_unbiased_std_plus_eps():
    std = math.sqrt(5 / 3)  # deviations 1.5, 0.5, 0.5, 1.5 -> 5 / (4 - 1)
    expected = [(x - 2.5) / (std + EPS) for x in (1, 2, 3, 4)]
    assert normalize_rewards(SCORES, "batch").tolist() == pytest.approx(expected)
    assert normalize_rewards(SCORES, "batch", scale_by_std=False).tolist() == [-1.5, -0.5, 0.5, 1.5]


def test_group_normalisation_with_interleaved_uids():
    normalised = normalize_rewards(SCORES, "group", ["p", "q", "p", "q"])  # p: 1, 3  q: 2, 4
    unit = 1 / (math.sqrt(2) + EPS)
    assert normalised.tolist() == pytest.approx([-unit, -unit, unit, unit])


def test_identical_scores_normalise_to_exactly_zero():
    assert normalize_rewards(torch.full((6,), 0.3), "batch").tolist() == [0.0] * 6


def test_clip_symmetric_and_range():
    assert clip_rewards(SCORES, 2.5).tolist() == [1.0, 2.0, 2.5, 2.5]
    assert clip_rewards(SCORES - 2.5, 1.0).tolist() == [-1.0, -0.5, 0.5, 1.0]
    assert clip_rewards(SCORES, (1.5, 3.0)).tolist() == [1.5, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(SCORES, -1.0)


def test_postprocess_normalises_then_clips():
    processed = postprocess_rewards(SCORES, [0, 1, 0, 1], norm="group", clip=0.5)
    assert processed.tolist() == pytest.approx([-0.5, -0.5, 0.5, 0.5])
    assert torch.equal(postprocess_rewards(SCORES), SCORES)


def test_normalisation_mode_errors():
    with pytest.raises(ValueError, match="needs group_ids"):
        normalize_rewards(SCORES, "group")
    with pytest.raises(ValueError) as err:
        normalize_rewards(SCORES, "running")
    assert str(err.value) == "unknown reward normalisation 'running'; known: batch, group."
