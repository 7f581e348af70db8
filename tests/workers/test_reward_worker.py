"""RewardWorker on a 2-rank Ray group: rule-based scores computed in parallel, placed on the last response token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.workers.reward import RewardWorker, RewardWorkerConfig, last_token_scores

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


def test_last_token_scores_places_score_on_last_masked_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    out = last_token_scores(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 2.0], [3.0, 0, 0, 0], [4.0, 0, 0, 0]])
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_math_rewards_on_a_two_rank_group(make_group):
    group = make_group(RewardWorker, 2, role="reward", worker_config=RewardWorkerConfig({"math_verify": 1.0}))
    lengths = [3, 6, 1, 2, 5, 4, 6]
    out = group.compute_rewards(rollout_like_batch(lengths))
    scores = out.batch[keys.TOKEN_LEVEL_SCORES]
    assert scores.shape == (len(CASES), 6) and scores.dtype == torch.float32
    expected = torch.tensor([c[2] for c in CASES])
    assert torch.equal(scores.sum(dim=1), expected)
    for row, length in enumerate(lengths):
        assert torch.all(scores[row, length:] == 0) and torch.all(scores[row, : length - 1] == 0)
        assert scores[row, length - 1] == expected[row]
    assert np.mean(out.meta_info[keys.META_METRICS]["reward/score_mean"]) == pytest.approx(float(expected.mean()), abs=0.1)


def test_weighted_rewards_and_unknown_name(make_group):
    group = make_group(RewardWorker, 2, role="reward", worker_config=RewardWorkerConfig({"math_verify": 1.0, "format_boxed": 0.5}))
    out = group.compute_rewards(rollout_like_batch([6] * len(CASES)))
    boxed = torch.tensor([0.5 if "\\boxed{" in c[0] else 0.0 for c in CASES])
    assert torch.allclose(out.batch[keys.TOKEN_LEVEL_SCORES][:, -1], torch.tensor([c[2] for c in CASES]) + boxed)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardWorkerConfig({"nope": 1.0})
