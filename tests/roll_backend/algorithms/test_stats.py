"""Masked statistics and per-group score statistics against hand-computed values."""

import math

import pytest
import torch

from roll_backend.algorithms import (
    as_group_ids,
    group_stats,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

NAN, INF = float("nan"), float("inf")

# Valid entries: 1, 3 (row 0) and 5, 6 (row 1); the masked ones hold garbage that must not leak.
VALUES = torch.tensor([[1.0, NAN, 3.0], [INF, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
# mean 3.75; squared deviations 7.5625 + 0.5625 + 1.5625 + 5.0625 = 14.75
MEAN, SQ_DEV = 3.75, 14.75


def test_masked_sum_total_and_per_row_ignore_nan_and_inf_outside_mask():
    assert masked_sum(VALUES, MASK).item() == 15.0
    assert masked_sum(VALUES, MASK, -1).tolist() == [4.0, 11.0]


def test_masked_sum_gradient_is_zero_not_nan_outside_mask():
    values = VALUES.clone().requires_grad_()
    masked_sum(values, MASK).backward()
    assert values.grad.tolist() == MASK.tolist()


def test_masked_mean_total_per_row_and_empty_row():
    assert masked_mean(VALUES, MASK).item() == pytest.approx(MEAN)
    mask = MASK.clone()
    mask[1] = 0.0
    assert masked_mean(VALUES, mask, -1).tolist() == pytest.approx([2.0, 0.0])  # empty row -> 0, not NaN
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_biased_and_bessel_corrected():
    assert masked_var(VALUES, MASK, False).item() == pytest.approx(SQ_DEV / 4)
    assert masked_var(VALUES, MASK, True).item() == pytest.approx(SQ_DEV / 3)


@pytest.mark.parametrize("num_valid", [0, 1])
def test_unbiased_variance_and_whitening_need_two_tokens(num_valid):
    mask = torch.zeros(2, 3)
    mask.view(-1)[:num_valid] = 1.0
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(VALUES, mask, True)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(VALUES, mask, True)


def test_masked_whiten_applies_to_every_element_and_shift_mean_adds_mean_back():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # finite everywhere: masked entries are whitened too
    std = math.sqrt(SQ_DEV / 3 + 1e-8)
    expected = [[(x - MEAN) / std for x in row] for row in values.tolist()]
    assert masked_whiten(values, MASK, True).tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    shifted = [[x + MEAN for x in row] for row in expected]
    assert masked_whiten(values, MASK, False).tolist() == [pytest.approx(row, abs=1e-6) for row in shifted]


def test_masked_whiten_nan_outside_mask_stays_outside():
    whitened = masked_whiten(VALUES, MASK, True)
    valid = MASK.bool()
    assert torch.isfinite(whitened[valid]).all()
    expected = [(x - MEAN) / math.sqrt(SQ_DEV / 3) for x in (1, 3, 5, 6)]
    assert whitened[valid].tolist() == pytest.approx(expected, abs=1e-6)


def test_group_stats_interleaved_groups_and_singleton():
    scores = torch.tensor([1.0, 0.0, 3.0, 10.0, 5.0, 5.0, 7.0])
    ids = torch.tensor([4, 9, 4, 2, 9, 0, 0])  # {0,2}: 1,3  {1,4}: 0,5  {3}: singleton  {5,6}: 5,7
    stats = group_stats(scores, ids)
    assert stats.mean.tolist() == pytest.approx([2.0, 2.5, 2.0, 0.0, 2.5, 6.0, 6.0])
    s2, s12_5 = math.sqrt(2.0), math.sqrt(12.5)
    assert stats.std.tolist() == pytest.approx([s2, s12_5, s2, 1.0, s12_5, s2, s2])
    assert stats.size.tolist() == [2, 2, 2, 1, 2, 2, 2]


def test_group_stats_match_torch_mean_and_std_of_each_group_bit_for_bit():
    # With near-identical rewards an ulp in the mean matters after dividing by std + 1e-6.
    gen = torch.Generator().manual_seed(0)
    scores = 0.5 + torch.rand(40, generator=gen) * 1e-4
    ids = torch.randint(0, 6, (40,), generator=gen)
    stats = group_stats(scores, ids)
    for gid in ids.unique():
        rows = (ids == gid).nonzero().squeeze(1)
        members = torch.stack([scores[i] for i in rows.tolist()])
        if len(rows) > 1:
            assert torch.equal(stats.mean[rows], torch.mean(members).expand(len(rows)))
            assert torch.equal(stats.std[rows], torch.std(members).expand(len(rows)))


def test_group_stats_identical_scores_give_exact_mean_and_zero_std():
    scores = torch.full((3,), 0.9)
    assert torch.mean(scores) != scores[0]  # why the pin exists: torch.mean is an ulp off here
    stats = group_stats(scores, torch.zeros(3, dtype=torch.int64))
    assert torch.equal(stats.mean, scores)
    assert stats.std.tolist() == [0.0, 0.0, 0.0]


def test_group_ids_may_be_uid_strings():
    by_uid = group_stats(torch.tensor([1.0, 2.0, 3.0]), ["b", "a", "b"])
    assert by_uid.mean.tolist() == [2.0, 0.0, 2.0]
    assert as_group_ids(["b", "a", "b"]).tolist() == [1, 0, 1]


def test_group_stats_rejects_float_ids_and_shape_mismatch():
    with pytest.raises(ValueError, match="integer"):
        group_stats(torch.ones(2), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"\[B\]"):
        group_stats(torch.ones(2, 3), torch.tensor([0, 1]))
