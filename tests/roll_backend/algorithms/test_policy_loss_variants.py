"""CISPO, SAPO, GPG and GMPO (verl's loss modes cispo, sapo, gpg, geo_mean) against their formulas written token by
token in plain Python, as verl's core_algos computes them: values and gradients, masked tokens (NaN/inf there)
never reaching either, and the global-batch normalisers forwarded."""

from __future__ import annotations

import math

import pytest
import torch

from roll_backend.algorithms import get_policy_loss

NAN, INF = float("nan"), float("inf")
# Two rows of four tokens, the last token of row 0 masked (garbage there); ratios on both sides of every clip.
LOG_RATIO = [[math.log(1.5), math.log(0.6), math.log(1.05), 0.0], [math.log(0.9), math.log(1.3), math.log(0.7), 0.3]]
ADV = [[1.0, 1.0, 1.0, INF], [-0.5, -0.5, -0.5, -0.5]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
OLD = [[-1.0, -2.0, -0.5, NAN], [-1.5, -0.3, -2.5, -1.0]]
SETTINGS = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0, agg_mode="token-mean", tau_pos=1.0, tau_neg=1.05)


def inputs():
    old = torch.tensor(OLD)
    logp = (torch.nan_to_num(old) + torch.tensor(LOG_RATIO)).requires_grad_(True)
    return old, logp, torch.tensor(ADV), torch.tensor(MASK)


def tokens():
    """(row, t, log-ratio, advantage, log-prob) of every unmasked token."""
    for b, row in enumerate(MASK):
        for t, m in enumerate(row):
            if m:
                yield b, t, LOG_RATIO[b][t], ADV[b][t], OLD[b][t] + LOG_RATIO[b][t]


N_TOKENS = sum(map(sum, MASK))


def run(name, **overrides):
    old, logp, adv, mask = inputs()
    out = get_policy_loss(name)(old, logp, adv, mask, **(SETTINGS | overrides))
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 3] == 0.0
    return out, logp.grad


def test_cispo_weights_every_token_by_its_clipped_detached_ratio():
    out, grad = run("cispo")
    loss = changed = 0.0
    for b, t, lr, a, lp in tokens():
        weight = min(max(math.exp(lr), 0.8), 1.28)  # clip(r, 1 - 0.2, 1 + 0.28), no gradient through it
        loss += -weight * a * lp / N_TOKENS
        changed += weight != math.exp(lr)
        assert grad[b, t].item() == pytest.approx(-weight * a / N_TOKENS, rel=1e-5)  # every token keeps a gradient
    assert out.loss.item() == pytest.approx(loss) and out.clipfrac.item() == pytest.approx(changed / N_TOKENS)
    assert out.approx_kl.item() == pytest.approx(-sum(lr for *_, lr, _a, _l in tokens()) / N_TOKENS, rel=1e-5)


def test_sapo_gates_each_token_softly_and_averages_per_sequence():
    out, grad = run("sapo", agg_mode="token-sum")  # (SAPO aggregates seq-mean-token-mean whatever is asked)
    lengths = [sum(row) for row in MASK]
    loss = 0.0
    for b, t, lr, a, _ in tokens():
        tau = 1.0 if a > 0 else 1.05
        r = math.exp(lr)
        gate = 1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau
        loss += -gate * a / lengths[b] / len(MASK)
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        d_gate = 4 * sig * (1 - sig) * r  # d gate / d log-prob: the gate's slope times r
        assert grad[b, t].item() == pytest.approx(-d_gate * a / lengths[b] / len(MASK))
    assert out.loss.item() == pytest.approx(loss) and out.clipfrac.item() == 0.0


def test_gpg_is_the_plain_policy_gradient():
    out, grad = run("gpg", agg_mode="seq-mean-token-sum", global_batch_size=4, dp_size=2)
    loss = sum(-a * lp for *_, a, lp in tokens()) / 4 * 2
    assert out.loss.item() == pytest.approx(loss)
    for b, t, _, a, _ in tokens():
        assert grad[b, t].item() == pytest.approx(-a / 4 * 2)


def test_geo_mean_clips_pessimistically_and_takes_the_geometric_mean_per_sequence():
    out, grad = run("geo_mean", clip_low=0.1, clip_high=0.2)
    rows = {}
    for b, t, lr, a, _ in tokens():
        bounded = min(max(lr, -0.1), 0.2)
        sign = math.copysign(1.0, a)
        kept = sign * min(sign * lr, sign * bounded)  # the pessimistic side for this advantage's sign
        rows.setdefault(b, []).append((t, kept, a, kept == lr))
    loss = 0.0
    for b, toks in rows.items():
        n = len(toks)
        ratio = math.exp(sum(k for _, k, _, _ in toks) / n)
        advantage = sum(a for _, _, a, _ in toks) / n
        loss += -advantage * ratio / len(rows)
        for t, _, _, live in toks:  # d/d logp[t] of -A exp(mean) is -A exp(mean) / n where the log-ratio is kept
            assert grad[b, t].item() == pytest.approx(-advantage * ratio / n / len(rows) if live else 0.0, abs=1e-7)
    assert out.loss.item() == pytest.approx(loss)
    assert out.clipfrac.item() == pytest.approx(2 / N_TOKENS)  # 1.5 and 0.6 left [-0.1, 0.2] with A > 0
    assert out.clipfrac_lower.item() == pytest.approx(4 / N_TOKENS)  # 0.9, 1.3, 0.7 and e^0.3 with A < 0


def test_rollout_correction_weights_scale_every_variant():
    """The detached correction weights multiply each token's loss (GMPO: their geometric mean per row)."""
    for name in ("cispo", "sapo", "gpg", "geo_mean"):
        plain, _ = run(name)
        halved, _ = run(name, token_weights=torch.full((2, 4), 0.5))
        assert halved.loss.item() == pytest.approx(0.5 * plain.loss.item(), rel=1e-5), name
