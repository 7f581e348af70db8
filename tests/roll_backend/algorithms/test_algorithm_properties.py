"""Hypothesis properties: independent float64 references, masking, group invariants, gradient zeros."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roll_backend.algorithms import (
    agg_loss,
    gae,
    grpo_advantage,
    masked_mean,
    ppo_policy_loss,
    response_mask_from_eos,
    rloo_advantage,
)

FAST = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, min_valid=1):
    """(values [B, T], NaN/inf outside the mask; mask [B, T] with holes, every row >= 1 token; a generator)."""
    batch, length = draw(st.integers(1, 8)), draw(st.integers(min_valid, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, length, generator=gen) < draw(st.floats(0.3, 1.0))).float()
    mask[:, 0] = 1.0
    mask[0, :min_valid] = 1.0
    values = torch.randn(batch, length, generator=gen) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    pick = torch.randint(0, 3, values.shape, generator=gen)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf")])[pick]
    return torch.where(mask.bool(), values, garbage), mask, gen


@st.composite
def groups(draw):
    """(group_ids [B] interleaved with groups of different sizes incl. singletons, scores [B] float32)."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    ids = [gid for gid, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(ids))))
    group_ids = torch.tensor([ids[i] * 7 + 3 for i in order])  # arbitrary id values, shuffled rows
    score = st.sampled_from([0.0, 1.0, 0.3, -0.9, 2.5]) | st.floats(-5, 5, width=32)
    scores = draw(st.lists(score, min_size=len(ids), max_size=len(ids)))
    return group_ids, torch.tensor(scores)


@FAST
@given(batches())
def test_masked_mean_matches_a_float64_reference_and_ignores_garbage(batch):
    values, mask, _ = batch
    kept = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    assert math.isclose(masked_mean(values, mask).item(), sum(kept) / len(kept), rel_tol=1e-5, abs_tol=1e-5)
    rows = masked_mean(values, mask, -1)
    assert torch.isfinite(rows).all()


@FAST
@given(groups())
def test_grpo_is_zero_for_identical_groups_and_zero_mean_inside_groups(data):
    group_ids, scores = data
    rewards, mask = scores.unsqueeze(-1), torch.ones(len(scores), 1)
    centred = grpo_advantage(rewards, mask, group_ids, 1e-6, False)[:, 0].double()
    for gid in group_ids.unique():
        rows = group_ids == gid
        members = scores[rows]
        if rows.sum() > 1:
            assert abs(centred[rows].sum().item()) <= 1e-5 * max(1.0, members.abs().max().item())
        if rows.sum() > 1 and (members == members[0]).all():
            assert grpo_advantage(rewards, mask, group_ids, 1e-6, True)[rows].abs().max().item() == 0.0


@FAST
@given(groups())
def test_rloo_is_score_minus_mean_of_the_others(data):
    group_ids, scores = data
    advantages = rloo_advantage(scores.unsqueeze(-1), torch.ones(len(scores), 1), group_ids)[:, 0]
    for i, (gid, score) in enumerate(zip(group_ids.tolist(), scores.double().tolist())):
        members = zip(group_ids.tolist(), scores.double().tolist())
        others = [s for j, (g, s) in enumerate(members) if g == gid and j != i]
        expected = score - sum(others) / len(others) if others else score
        assert math.isclose(advantages[i].item(), expected, rel_tol=1e-5, abs_tol=1e-5)


def gae_reference(rewards, values, mask, gamma, lam):
    """The spec's GAE loop in plain float64 Python, whitened over the valid tokens."""
    raw = []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        next_value, running, row = 0.0, 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                running = r_row[t] + gamma * next_value - v_row[t] + gamma * lam * running
                next_value = v_row[t]
            row[t] = running
        raw.append(row)
    kept = [a for row, m_row in zip(raw, mask.tolist()) for a, m in zip(row, m_row) if m]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((a - mean) ** 2 for a in kept) / (len(kept) - 1) + 1e-8)
    return [(a - mean) / std for a in kept]


@FAST
@given(batches(min_valid=2), st.floats(0.5, 1.0), st.floats(0.5, 1.0))
def test_gae_matches_a_float64_reference(batch, gamma, lam):
    values, mask, gen = batch
    rewards = torch.where(mask.bool(), torch.randn(values.shape, generator=gen), values)
    advantages, _ = gae(rewards, values, mask, gamma, lam)
    expected = gae_reference(rewards, values, mask, gamma, lam)
    got = advantages[mask.bool()].tolist()
    assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(got, expected))


@FAST
@given(batches(), st.floats(0.05, 0.3), st.floats(0.05, 0.3))
def test_ppo_gradient_is_minus_adv_ratio_where_unclipped_and_zero_elsewhere(batch, clip_low, clip_high):
    log_ratio, mask, gen = batch
    log_ratio = torch.where(mask.bool(), log_ratio.clamp(-30, 30), log_ratio)  # up to +-30: clamp at 20 active
    old = torch.randn(mask.shape, generator=gen)
    adv = torch.randn(mask.shape, generator=gen)
    logp = (old + log_ratio).requires_grad_()
    loss, clipfrac, _, _ = ppo_policy_loss(old, logp, adv, mask, clip_low, clip_high, 3.0, "token-mean")
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    num_tokens = mask.sum().item()
    expected, clipped = [], 0
    for d, a, m in zip((logp - old).flatten().tolist(), adv.flatten().tolist(), mask.flatten().tolist()):
        if not m:
            expected.append(0.0)
            continue
        ratio = math.exp(min(max(d, -20.0), 20.0))
        clipped_branch = (a > 0 and ratio > 1 + clip_high) or (a < 0 and ratio < 1 - clip_low)
        dual_capped = a < 0 and ratio > 3.0
        log_ratio_clamped = abs(d) > 20
        clipped += clipped_branch
        zero = clipped_branch or dual_capped or log_ratio_clamped
        expected.append(0.0 if zero else -a * ratio / num_tokens)
    got = logp.grad.flatten().tolist()
    assert all(math.isclose(g, e, rel_tol=1e-4, abs_tol=1e-6) for g, e in zip(got, expected))
    assert math.isclose(clipfrac.item(), clipped / num_tokens, abs_tol=1e-6)


@FAST
@given(batches(), st.integers(1, 5))
def test_padding_columns_do_not_change_mean_aggregations(batch, pad):
    loss_mat, mask, _ = batch
    padded_loss = torch.cat([loss_mat, torch.full((loss_mat.shape[0], pad), float("nan"))], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], pad)], dim=1)
    # float32 sums in another order: the rounding scales with the summed magnitudes, not with the (cancelled) result
    scale = float(torch.where(mask.bool(), loss_mat, 0.0).abs().sum())
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"):
        unpadded, padded = agg_loss(loss_mat, mask, mode), agg_loss(padded_loss, padded_mask, mode)
        assert torch.allclose(unpadded, padded, rtol=1e-5, atol=1e-6 * max(1.0, scale)), mode
    tokens = int(mask.sum())
    global_mean = agg_loss(loss_mat, mask, "token-mean", 4, 4 * tokens)
    assert torch.allclose(global_mean, agg_loss(loss_mat, mask, "token-mean"), rtol=1e-5, atol=1e-6)


@FAST
@given(st.integers(1, 4), st.integers(1, 8), st.data(), st.sets(st.integers(0, 5), max_size=2))
def test_response_mask_matches_a_python_loop(batch, length, data, eos_ids):
    row = st.lists(st.integers(0, 5), min_size=length, max_size=length)
    rows = data.draw(st.lists(row, min_size=batch, max_size=batch))
    expected = []
    for row in rows:
        seen_eos, out = False, []
        for token in row:
            out.append(0 if seen_eos else 1)
            seen_eos = seen_eos or token in eos_ids
        expected.append(out)
    assert response_mask_from_eos(torch.tensor(rows), sorted(eos_ids)).tolist() == expected
