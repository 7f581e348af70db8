"""Dual-clip PPO and GSPO: values, metrics and gradients on hand-worked tokens, and the registry."""

import math

import pytest
import torch

from roll_backend.algorithms import POLICY_LOSS_NAMES, get_policy_loss, gspo_policy_loss, ppo_policy_loss

NAN, INF = float("nan"), float("inf")

# clip 0.2 / 0.2, clip_c 3. One token per behaviour:
#   adv  ratio   L1     L2     token loss           d loss/d logp (before /N)
#   +1   1.1    -1.1   -1.1    -1.1  (inside band)  -1.1
#   +1   1.5    -1.5   -1.2    -1.2  (clipped)       0
#   -1   0.5     0.5    0.8     0.8  (clipped)       0
#   -1   4.0     4.0    1.2     3.0  (dual clip)     0
#   -1   2.0     2.0    1.2     2.0  (below cap)     2.0
#    0   1.5     0      0       0    (adv 0: not counted as clipped)  0
#   +1   e^-25 -> clamped to e^-20: L1 = -e^-20 > L2 = -0.8, but the log-ratio clamp kills the gradient
#   masked token: NaN/inf everywhere
PPO_ADV = [1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 1.0, NAN]
PPO_LOG_RATIO = [math.log(1.1), math.log(1.5), math.log(0.5), math.log(4.0), math.log(2.0), math.log(1.5), -25.0, 0.0]
PPO_MASK = torch.tensor([[1.0] * 7 + [0.0]])
PPO_OLD = torch.tensor([[-0.7] * 7 + [INF]])


def ppo_inputs():
    logp = (PPO_OLD + torch.tensor([PPO_LOG_RATIO])).detach()
    logp[0, 7] = NAN
    return logp.requires_grad_(), torch.tensor([PPO_ADV])


def test_ppo_loss_metrics_and_gradient():
    logp, adv = ppo_inputs()
    outputs = ppo_policy_loss(PPO_OLD, logp, adv, PPO_MASK, 0.2, 0.2, 3.0, "token-mean")
    loss, clipfrac, approx_kl, clipfrac_lower = outputs
    loss.backward()
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 3.0 + 2.0 + 0.0 - math.exp(-20)) / 7, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 7)
    assert clipfrac_lower.item() == pytest.approx(1 / 7)
    clamped = PPO_LOG_RATIO[:6] + [-20.0]
    assert approx_kl.item() == pytest.approx(-sum(clamped) / 7, abs=1e-6)
    expected_grad = [-1.1 / 7, 0.0, 0.0, 0.0, 2.0 / 7, 0.0, 0.0, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(expected_grad, abs=1e-6)


def test_ppo_asymmetric_clip_high():
    logp = torch.tensor([[math.log(1.25)]])
    adv, mask, old = torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1)
    loss, clipfrac, _, _ = ppo_policy_loss(old, logp, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    assert (loss.item(), clipfrac.item()) == (pytest.approx(-1.25), 0.0)
    loss, clipfrac, _, _ = ppo_policy_loss(old, logp, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    assert (loss.item(), clipfrac.item()) == (pytest.approx(-1.2), 1.0)


def test_ppo_aggregation_mode_and_normalisers_are_forwarded():
    logp, adv = ppo_inputs()
    token_sum = (-1.1 - 1.2 + 0.8 + 3.0 + 2.0 - math.exp(-20)) * 2
    loss = ppo_policy_loss(PPO_OLD, logp, adv, PPO_MASK, 0.2, 0.2, 3.0, "token-sum", dp_size=2)[0]
    assert loss.item() == pytest.approx(token_sum, abs=1e-5)


def test_ppo_needs_clip_c_above_one():
    logp, adv = ppo_inputs()
    with pytest.raises(ValueError, match="clip_c > 1"):
        ppo_policy_loss(PPO_OLD, logp, adv, PPO_MASK, 0.2, 0.2, 1.0, "token-mean")


# GSPO, clip 0.2 / 0.2 for a readable case. Row 0: log-ratios 0.1, 0.3 (+ a masked NaN): s = 0.2, adv +1,
# ratio e^0.2 = 1.2214 > 1.2 -> clipped on both tokens. Row 1: log-ratios -0.2, 0.1, 0.4: s = 0.1, adv -1,
# ratio e^0.1 inside the band -> loss e^0.1 per token, gradient e^0.1 per token.
GSPO_OLD = torch.tensor([[-1.0, -1.0, NAN], [-2.0, -2.0, -2.0]])
GSPO_LOG_RATIO = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.1, 0.4]])
GSPO_ADV = torch.tensor([[1.0, 1.0, INF], [-1.0, -1.0, -1.0]])
GSPO_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_gspo_sequence_ratio_loss_metrics_and_gradient():
    logp = (GSPO_OLD.nan_to_num(0.0) + GSPO_LOG_RATIO).requires_grad_()
    loss, clipfrac, approx_kl = gspo_policy_loss(GSPO_OLD, logp, GSPO_ADV, GSPO_MASK, 0.2, 0.2, "seq-mean-token-mean")
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 + math.exp(0.1)) / 2, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert approx_kl.item() == pytest.approx(-0.7 / 5, abs=1e-6)
    row1_grad = math.exp(0.1) / 3 / 2  # d loss / d token loss = 1/(3 tokens * 2 rows)
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0], pytest.approx([row1_grad] * 3, abs=1e-6)]


def test_gspo_log_ratio_clamp_at_ten_kills_the_gradient():
    old = torch.zeros(1, 2)
    logp = torch.full((1, 2), 12.0, requires_grad=True)
    adv = -torch.ones(1, 2)
    loss, _, approx_kl = gspo_policy_loss(old, logp, adv, torch.ones(1, 2), 0.2, 0.2, "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)  # -adv * e^10 beats the clipped 1.2
    assert approx_kl.item() == pytest.approx(-12.0)  # unclamped
    assert logp.grad.tolist() == [[0.0, 0.0]]


def test_registered_policy_losses_share_one_call():
    logp, adv = ppo_inputs()
    settings = dict(clip_low=0.2, clip_high=0.2, clip_c=3.0, agg_mode="token-mean")
    ppo = get_policy_loss("ppo")(PPO_OLD, logp, adv, PPO_MASK, **settings)
    assert ppo.clipfrac_lower.item() == pytest.approx(1 / 7)
    gspo = get_policy_loss("gspo")(PPO_OLD, logp, adv, PPO_MASK, **settings)
    assert gspo.clipfrac_lower.item() == 0.0
    assert torch.isfinite(gspo.loss)
    with pytest.raises(ValueError) as err:
        get_policy_loss("vanilla")
    assert str(err.value) == f"unknown policy loss 'vanilla'; known: {', '.join(POLICY_LOSS_NAMES)}."
