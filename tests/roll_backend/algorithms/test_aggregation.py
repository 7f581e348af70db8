"""The five loss-aggregation modes, with local and global (data-parallel) normalisers."""

import pytest
import torch

from roll_backend.algorithms import AGG_MODE_NAMES, agg_loss

NAN = float("nan")
# Row sums over the mask: 3 (2 tokens), 26 (4 tokens); row 2 is fully masked and holds garbage.
LOSS = torch.tensor([[1.0, 2.0, NAN, float("inf")], [5.0, 6.0, 7.0, 8.0], [NAN, 10.0, 11.0, 12.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 29 / 6),
        ("token-sum", 29.0),
        ("seq-mean-token-sum", 29 / 2),  # the empty row is excluded from the count
        ("seq-mean-token-mean", (1.5 + 6.5) / 2),
        ("seq-mean-token-sum-norm", 29 / 2 / 4),  # divided by the padded length T=4, not the token count
    ],
)
def test_local_aggregation(mode, expected):
    loss = agg_loss(LOSS, MASK, mode)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode, normalisers, expected",
    [
        ("token-mean", {"batch_num_tokens": 12}, 29 / 12 * 2),
        ("token-sum", {}, 29 * 2),
        ("seq-mean-token-sum", {"global_batch_size": 5}, 29 / 5 * 2),
        ("seq-mean-token-mean", {"global_batch_size": 5}, 8 / 5 * 2),
        ("seq-mean-token-sum-norm", {"global_batch_size": 5, "loss_scale_factor": 10}, 29 / 5 * 2 / 10),
    ],
)
def test_global_normalisers_and_dp_size(mode, normalisers, expected):
    assert agg_loss(LOSS, MASK, mode, 2, **normalisers).item() == pytest.approx(expected)


def test_positional_call_order_of_the_spec():
    # (L, M, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    assert agg_loss(LOSS, MASK, "token-mean", None, None, None, None).item() == pytest.approx(29 / 6)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", 1, None, None, 8).item() == pytest.approx(29 / 2 / 8)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_dp_size_without_the_global_normaliser_is_an_error(mode):
    with pytest.raises(ValueError, match="dp_size=2 needs the global"):
        agg_loss(LOSS, MASK, mode, 2)


def test_token_mean_gradient_is_mask_over_token_count_and_zero_outside():
    loss_mat = LOSS.clone().requires_grad_()
    agg_loss(loss_mat, MASK, "token-mean").backward()
    assert loss_mat.grad.tolist() == (MASK / 6).tolist()


def test_token_mean_of_an_empty_mask_has_no_epsilon():
    assert agg_loss(torch.ones(1, 2), torch.zeros(1, 2), "token-mean").isnan()


def test_unknown_mode_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        agg_loss(LOSS, MASK, "seq-mean")
    assert str(err.value) == f"unknown loss aggregation mode 'seq-mean'; known: {', '.join(AGG_MODE_NAMES)}."
    assert len(AGG_MODE_NAMES) == 5
