"""Response masks from EOS, log-probabilities and entropy from logits."""

import math

import pytest
import torch

from roll_backend.algorithms import entropy_from_logits, entropy_loss, logprobs_from_logits, response_mask_from_eos

RESPONSES = torch.tensor(
    [
        [5, 2, 7, 2, 9],  # EOS at 1; the later EOS does not matter
        [1, 3, 4, 6, 8],  # no EOS (2): all ones
        [2, 0, 0, 0, 0],  # EOS first
        [5, 6, 1, 2, 2],
    ]
)


def test_response_mask_includes_the_first_eos_and_nothing_after():
    mask = response_mask_from_eos(RESPONSES, [2])
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]


def test_response_mask_any_of_several_eos_ids():
    mask = response_mask_from_eos(RESPONSES, [1, 2])
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert response_mask_from_eos(RESPONSES, 2).tolist() == response_mask_from_eos(RESPONSES, [2]).tolist()


def test_logprobs_are_log_softmax_at_the_label():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 1]])
    log_z = math.log(math.e + math.e**2 + math.e**3)
    assert logprobs_from_logits(logits, labels).tolist() == [pytest.approx([3.0 - log_z, -math.log(3.0)])]


def test_logprobs_stay_accurate_for_large_logits():
    logits = torch.tensor([[[80.0, 79.0, -80.0]]])
    expected = -math.log1p(math.exp(-1.0))  # log(e^80 / (e^80 + e^79)), e^-80 term negligible
    assert logprobs_from_logits(logits, torch.tensor([[0]])).item() == pytest.approx(expected, abs=1e-6)


def test_entropy_of_uniform_and_peaked_rows():
    logits = torch.tensor(
        [
            [7.0, 7.0, 7.0, 7.0],  # uniform: log 4
            [80.0, -80.0, 80.0, -80.0],  # two equal winners: log 2
            [80.0, 0.0, 0.0, -80.0],  # one winner: ~0
            [-80.0, -80.0, -80.0, -80.0],
        ]
    )
    entropy = entropy_from_logits(logits)
    assert entropy.tolist() == pytest.approx([math.log(4), math.log(2), 0.0, math.log(4)], abs=1e-5)


def test_entropy_matches_minus_sum_p_log_p_and_keeps_leading_shape():
    logits = torch.tensor([0.5, -1.0, 2.0]).repeat(2, 3, 1)  # [2, 3, V]
    z = [0.5, -1.0, 2.0]
    total = sum(math.exp(v) for v in z)
    expected = -sum(math.exp(v) / total * math.log(math.exp(v) / total) for v in z)
    entropy = entropy_from_logits(logits)
    assert entropy.shape == (2, 3)
    assert entropy.flatten().tolist() == pytest.approx([expected] * 6, abs=1e-6)


def test_entropy_loss_aggregates_over_the_mask_only():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = float("nan")  # masked token
    mask = torch.tensor([[1.0, 0.0]])
    assert entropy_loss(logits, mask, "token-mean").item() == pytest.approx(math.log(4))
    assert entropy_loss(logits, mask, "seq-mean-token-sum-norm").item() == pytest.approx(math.log(4) / 2)
