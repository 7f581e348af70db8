"""Rollout-mismatch correction against hand-computed values: each mode, the caps, masks and empty masks."""

import math

import pytest
import torch

from roll_backend.algorithms import gspo_policy_loss, ppo_policy_loss, rollout_correction
from roll_backend.algorithms.rollout_correction import sequence_truncated_is_weights, token_truncated_is_weights

NAN = float("nan")
LN2, LN3 = math.log(2.0), math.log(3.0)

# log r_t = old - rollout. Row 0: [ln 2, ln 3, -ln 2] (3 tokens); row 1: [0.1, -0.1] then padding holding NaN;
# row 2: [ln 3, ln 3]. rollout log-probs are all -1.
LOG_RATIO = [[LN2, LN3, -LN2], [0.1, -0.1, NAN], [LN3, LN3, 0.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
ROLLOUT = torch.full((3, 3), -1.0)
OLD = ROLLOUT + torch.tensor(LOG_RATIO)


def correct(**settings):
    return rollout_correction(OLD, ROLLOUT, MASK, **settings)


def k3(log_r: float) -> float:
    """k3 of KL(rollout || old) on one token: ratio old/rollout = e^log_r."""
    return math.exp(log_r) - log_r - 1


def test_token_truncated_is_caps_each_token():
    weights, metrics = correct(is_level="token", is_cap=2.5)
    expected = [[2.0, 2.5, 0.5], [math.exp(0.1), math.exp(-0.1), 0.0], [2.5, 2.5, 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert metrics["weight_mean"].item() == pytest.approx(sum(map(sum, expected)) / 7, rel=1e-6)
    assert metrics["weight_max"].item() == pytest.approx(2.5)
    assert metrics["masked_token_fraction"].item() == 0.0 and metrics["masked_sequence_fraction"].item() == 0.0
    tokens = [LN2, LN3, -LN2, 0.1, -0.1, LN3, LN3]
    assert metrics["kl_k3"].item() == pytest.approx(sum(map(k3, tokens)) / 7, rel=1e-5)


def test_sequence_truncated_is_one_weight_per_row():
    # Row sums of log r: ln 3 -> 3, 0 -> 1, 2 ln 3 -> 9, capped at 5.
    weights, metrics = correct(is_level="sequence", is_cap=5.0)
    expected = [[3.0] * 3, [1.0, 1.0, 0.0], [5.0, 5.0, 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert metrics["weight_mean"].item() == pytest.approx(3.0)  # (3 + 1 + 5) / 3 sequences
    assert metrics["weight_max"].item() == pytest.approx(5.0)


def test_sequence_geometric_mean_rejection_masks_whole_rows():
    # Geometric means: row 0 exp(ln3 / 3) = 1.44, row 1 exp(0) = 1, row 2 exp(ln 3) = 3 -> outside [1/2, 2].
    weights, metrics = correct(rejection="sequence", rejection_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0] * 3, [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["masked_token_fraction"].item() == pytest.approx(2 / 7)
    assert metrics["masked_sequence_fraction"].item() == pytest.approx(1 / 3)
    # A threshold of 1.4 also rejects row 0 (1.44 > 1.4), never row 1.
    weights, metrics = correct(rejection="sequence", rejection_threshold=1.4)
    torch.testing.assert_close(weights[:, 0], torch.tensor([0.0, 1.0, 0.0]))
    assert metrics["masked_sequence_fraction"].item() == pytest.approx(2 / 3)


def test_token_rejection_masks_tokens_outside_the_band():
    # Threshold 2.5: ratios 2, 3, 1/2, e^.1, e^-.1, 3, 3 -> the three 3s are rejected; row 2 loses every token.
    weights, metrics = correct(rejection="token", rejection_threshold=2.5)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["masked_token_fraction"].item() == pytest.approx(3 / 7)
    assert metrics["masked_sequence_fraction"].item() == pytest.approx(1 / 3)


def test_is_and_rejection_combine_weights_only_on_kept_tokens():
    weights, metrics = correct(is_level="token", is_cap=2.5, rejection="sequence", rejection_threshold=2.0)
    expected = [[2.0, 2.5, 0.5], [math.exp(0.1), math.exp(-0.1), 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert metrics["weight_mean"].item() == pytest.approx(sum(map(sum, expected)) / 5, rel=1e-6)  # kept tokens only
    assert metrics["weight_max"].item() == pytest.approx(2.5)


def test_weights_are_detached_and_padding_never_leaks():
    old = OLD.clone().requires_grad_()
    weights, metrics = rollout_correction(old, ROLLOUT, MASK, is_level="token", is_cap=2.0)
    assert not weights.requires_grad and all(not m.requires_grad for m in metrics.values())
    assert torch.isfinite(weights).all() and weights[1, 2].item() == 0.0  # NaN under the mask gives weight 0


def test_empty_masks_give_zero_metrics_and_zero_weights():
    empty = torch.zeros(2, 3)
    for settings in (
        {"is_level": "token"},
        {"is_level": "sequence"},
        {"rejection": "sequence"},
        {"rejection": "token"},
    ):
        weights, metrics = rollout_correction(OLD[:2], ROLLOUT[:2], empty, **settings)
        assert weights.abs().sum().item() == 0.0, settings
        for name, value in metrics.items():
            assert math.isfinite(value.item()), (settings, name)
        assert metrics["masked_token_fraction"].item() == 0.0 and metrics["masked_sequence_fraction"].item() == 0.0
    # One empty row among full ones: not counted as a sequence, its sequence weight is exp(0) = 1 but masked to 0.
    mask = MASK.clone()
    mask[1] = 0
    weights, metrics = rollout_correction(OLD, ROLLOUT, mask, is_level="sequence", is_cap=5.0, rejection="sequence")
    torch.testing.assert_close(weights, torch.tensor([[3.0] * 3, [0.0] * 3, [0.0] * 3]))
    assert metrics["masked_sequence_fraction"].item() == pytest.approx(1 / 2)  # row 2 of the two non-empty rows


def test_large_log_ratios_stay_finite():
    huge = torch.tensor([[200.0, 300.0]])
    assert token_truncated_is_weights(huge, torch.ones(1, 2), 2.0).tolist() == [[2.0, 2.0]]
    assert sequence_truncated_is_weights(huge, torch.ones(1, 2), 2.0).tolist() == [2.0]


def test_bad_settings_say_what_to_change():
    with pytest.raises(ValueError, match="is_level='tok'"):
        correct(is_level="tok")
    with pytest.raises(ValueError, match="is_cap=0.5 must be >= 1"):
        correct(is_level="token", is_cap=0.5)
    with pytest.raises(ValueError, match="rejection_threshold=1.0 must be > 1"):
        correct(rejection="token", rejection_threshold=1.0)


def test_policy_losses_multiply_each_token_by_its_weight():
    # Ratio 1 everywhere (logp = old): PPO token loss is -adv, so the token-mean loss is -sum(w * adv) / N.
    old = torch.zeros(1, 3)
    logp = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = torch.tensor([[0.5, 2.0, NAN]])  # NaN under the mask never reaches the loss
    loss, *_ = ppo_policy_loss(old, logp, adv, mask, token_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 2.0 * -2.0) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5 / 2, 4.0 / 2, 0.0])
    loss, *_ = gspo_policy_loss(old, logp.detach(), adv, mask, token_weights=weights, agg_mode="token-mean")
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 2.0 * -2.0) / 2)
