"""Advantage estimators against hand-worked cases, and their registry."""

import math

import pytest
import torch

from roll_backend.algorithms import (
    ADVANTAGE_ESTIMATOR_NAMES,
    gae,
    get_advantage_estimator,
    grpo_advantage,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)

NAN = float("nan")


def whiten(xs):
    """Whitening of a list of floats with the Bessel-corrected variance (independent of the library)."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) + 1e-8)
    return [(x - mean) / std for x in xs]


def outcome_rewards(scores, mask):
    """Token rewards [B, T] with each score on the last valid token."""
    rewards = torch.zeros(mask.shape)
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=-1)
    rewards[torch.arange(mask.shape[0]), last] = torch.tensor(scores)
    return rewards


# --- GAE --------------------------------------------------------------------------------------------

# gamma = lam = 0.5, one row with a hole at t=1 (its reward and value are garbage).
#   t=3: delta = 1 + 0.5*0 - 4 = -3;    running = -3
#   t=2: delta = 0 + 0.5*4 - 2 = 0;     running = 0 + 0.25*(-3) = -0.75
#   t=1: masked, keeps next_value = 2, running = -0.75
#   t=0: delta = 0 + 0.5*2 - 1 = 0;     running = 0 + 0.25*(-0.75) = -0.1875
GAE_REWARDS = torch.tensor([[0.0, NAN, 0.0, 1.0]])
GAE_VALUES = torch.tensor([[1.0, NAN, 2.0, 4.0]])
GAE_MASK = torch.tensor([[1.0, 0.0, 1.0, 1.0]])


def test_gae_bridges_holes_and_whitens_over_the_batch():
    advantages, returns = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 0.5, 0.5)
    valid = GAE_MASK.bool()
    assert returns[valid].tolist() == pytest.approx([-0.1875 + 1.0, -0.75 + 2.0, -3.0 + 4.0])
    assert advantages[valid].tolist() == pytest.approx(whiten([-0.1875, -0.75, -3.0]), abs=1e-6)


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 1.0, 1.5, NAN], [0.25, 0.75, NAN, NAN]])
    advantages, returns = gae(rewards, values, mask, 1.0, 1.0)
    raw = [2.0 - 0.5, 2.0 - 1.0, 2.0 - 1.5, 1.0 - 0.25, 1.0 - 0.75]
    assert returns[mask.bool()].tolist() == pytest.approx([2.0, 2.0, 2.0, 1.0, 1.0])
    # One whitening over the whole batch, not per row.
    assert advantages[mask.bool()].tolist() == pytest.approx(whiten(raw), abs=1e-6)


def test_gae_needs_two_valid_tokens():
    with pytest.raises(ValueError, match="at least 2"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]]), 1.0, 1.0)


# --- group estimators ---------------------------------------------------------------------------------

# Groups are interleaved and of different sizes: id 7 -> rows 0, 2, 5 (scores 1, 0, 2),
# id 3 -> rows 1, 3 (0, 2), id 9 -> row 4 alone (0.5).
GROUP_IDS = torch.tensor([7, 3, 7, 3, 9, 7])
GROUP_SCORES = [1.0, 0.0, 0.0, 2.0, 0.5, 2.0]
GROUP_MASK = torch.tensor(
    [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
)
GROUP_REWARDS = outcome_rewards(GROUP_SCORES, GROUP_MASK)


def per_row(advantages):
    """The single value each row carries inside its mask (checks it is the same on every valid token)."""
    values = []
    for row, row_mask in zip(advantages, GROUP_MASK):
        kept = row[row_mask.bool()].unique()
        assert kept.numel() == 1
        values.append(kept.item())
    assert (advantages[~GROUP_MASK.bool()] == 0).all()
    return values


def test_grpo_normalises_by_group_mean_and_unbiased_std_plus_eps():
    eps = 1e-6
    # id 7: mean 1, std 1; id 3: mean 1, std sqrt(2); id 9: singleton, mean 0 and std 1.
    unit3 = 1 / (math.sqrt(2) + eps)
    expected = [0.0, -unit3, -1 / (1 + eps), unit3, 0.5 / (1 + eps), 1 / (1 + eps)]
    assert per_row(grpo_advantage(GROUP_REWARDS, GROUP_MASK, GROUP_IDS, eps, True)) == pytest.approx(expected)


def test_dr_grpo_only_subtracts_the_group_mean():
    advantages = grpo_advantage(GROUP_REWARDS, GROUP_MASK, GROUP_IDS, 1e-6, False)
    assert per_row(advantages) == pytest.approx([0.0, -1.0, -1.0, 1.0, 0.5, 1.0])


def test_grpo_eps_is_added_to_the_std_not_inside_a_sqrt():
    # Scores 1 and 1 + 2^-20 (exact in float32): deviations +-2^-21, std 2^-21 * sqrt(2).
    tiny = 2.0**-21
    mask = torch.ones(2, 1)
    rewards = torch.tensor([[1.0], [1.0 + 2 * tiny]])
    advantages = grpo_advantage(rewards, mask, torch.tensor([0, 0]), 1e-6, True)
    expected = tiny / (tiny * math.sqrt(2) + 1e-6)  # ~0.285; eps inside the sqrt would give ~5e-4
    assert advantages[:, 0].tolist() == pytest.approx([-expected, expected], rel=1e-5)


def test_grpo_score_sums_every_position_of_the_row():
    rewards = torch.tensor([[0.5, 0.0, 1.0], [0.0, 0.0, 0.0]])  # row 0 has a reward outside its mask
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = grpo_advantage(rewards, mask, torch.tensor([0, 0]), 1e-6, False)
    assert advantages.tolist() == [[0.75, 0.75, 0.0], [-0.75, -0.75, -0.75]]


@pytest.mark.parametrize("score", [0.0, 1.0, 0.9, 0.3, -2.7])
def test_identical_rewards_in_a_group_give_exactly_zero(score):
    # torch.mean of 3 x 0.9 or 6 x 0.3 in float32 is an ulp off: a naive (x - mean) / (std + eps) gives ~0.05.
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 1, 1, 1])
    rewards = torch.full((9, 2), score / 2)
    mask = torch.ones(9, 2)
    for advantages in (
        grpo_advantage(rewards, mask, ids, 1e-6, True),
        grpo_advantage(rewards, mask, ids, 1e-6, False),
        rloo_advantage(rewards, mask, ids),
    ):
        assert advantages.abs().max().item() == 0.0


def test_rloo_subtracts_the_mean_of_the_other_responses():
    # id 7: 1 - (0+2)/2, 0 - (1+2)/2, 2 - (1+0)/2; id 3: 0 - 2, 2 - 0; id 9 alone keeps its score.
    expected = [0.0, -2.0, -1.5, 2.0, 0.5, 1.5]
    assert per_row(rloo_advantage(GROUP_REWARDS, GROUP_MASK, GROUP_IDS)) == pytest.approx(expected)


def test_reinforce_pp_baseline_centres_by_group_then_whitens_the_batch():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    rewards = outcome_rewards([1.0, 3.0, 5.0], mask)
    advantages = reinforce_pp_baseline_advantage(rewards, mask, torch.tensor([0, 0, 1]))
    # Centred scores: -1, 1 (group mean 2), 5 (singleton); as tokens -1, -1, 1, 5.
    assert advantages[mask.bool()].tolist() == pytest.approx(whiten([-1.0, -1.0, 1.0, 5.0]), abs=1e-6)
    assert advantages[~mask.bool()].tolist() == [0.0, 0.0]


# --- REINFORCE++ and ReMax ----------------------------------------------------------------------------


def test_reinforce_pp_discounts_across_holes_and_whitens():
    # gamma 0.5. Row 0: t3 masked -> 0; t2: 2; t1 masked (reward 5 ignored), running stays 2; t0: 1 + 0.5*2 = 2.
    # Row 1: t3 masked; t2: 4; t1: 0 + 2 = 2; t0: 0 + 1 = 1.
    rewards = torch.tensor([[1.0, 5.0, 2.0, NAN], [0.0, 0.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    advantages, returns = reinforce_pp_advantage(rewards, mask, 0.5)
    assert returns.tolist() == [[2.0, 0.0, 2.0, 0.0], [1.0, 2.0, 4.0, 0.0]]
    assert advantages[mask.bool()].tolist() == pytest.approx(whiten([2.0, 2.0, 1.0, 2.0, 4.0]), abs=1e-6)
    assert advantages[~mask.bool()].tolist() == [0.0, 0.0, 0.0]


def test_remax_return_to_go_minus_greedy_baseline():
    rewards = torch.tensor([[1.0, NAN, 3.0], [0.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    advantages, returns = remax_advantage(rewards, torch.tensor([0.5, 2.0]), mask)
    assert returns.tolist() == [[4.0, 3.0, 3.0], [5.0, 5.0, 5.0]]
    assert advantages.tolist() == [[3.5, 3.0, 2.5], [3.0, 3.0, 3.0]]


# --- registry -----------------------------------------------------------------------------------------


def test_registry_calls_each_estimator_with_the_inputs_it_needs():
    inputs = dict(values=torch.zeros(6, 3), group_ids=GROUP_IDS, baselines=torch.zeros(6), gamma=1.0, lam=1.0, eps=1e-6)
    for name in ADVANTAGE_ESTIMATOR_NAMES:
        if name == "grpo_passk":  # (group 9 has one response: no second best)
            with pytest.raises(ValueError, match="grpo_passk needs at least 2 responses per group"):
                get_advantage_estimator(name)(GROUP_REWARDS, GROUP_MASK, **inputs)
            continue
        advantages, returns = get_advantage_estimator(name)(GROUP_REWARDS, GROUP_MASK, **inputs)
        assert advantages.shape == returns.shape == GROUP_REWARDS.shape
    grpo_adv, grpo_ret = get_advantage_estimator("grpo")(GROUP_REWARDS, GROUP_MASK, norm_by_std=False, **inputs)
    assert torch.equal(grpo_adv, grpo_advantage(GROUP_REWARDS, GROUP_MASK, GROUP_IDS, 1e-6, False))
    assert grpo_ret is grpo_adv
    assert get_advantage_estimator("gae").needs_critic and not get_advantage_estimator("grpo").needs_critic


def test_registry_reports_missing_and_unknown_inputs():
    with pytest.raises(ValueError, match="'grpo' needs group_ids"):
        get_advantage_estimator("grpo")(GROUP_REWARDS, GROUP_MASK, values=torch.zeros(6, 3))
    with pytest.raises(TypeError, match="unknown advantage input"):
        get_advantage_estimator("rloo")(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS, gama=1.0)


def test_unknown_estimator_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("ppo")
    assert str(err.value) == (
        "unknown advantage estimator 'ppo'; known: gae, grpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, gpg, opo, grpo_passk."
    )


# ---- verl's gpg, opo and grpo_passk, against its loops written row by row -----------------------------------------


def groups_of(ids, values):
    out = {}
    for i, v in zip(ids, values):
        out.setdefault(i, []).append(v)
    return out


def test_gpg_rescales_the_centred_scores_by_the_share_of_scoring_responses():
    ids, scores = GROUP_IDS.tolist(), GROUP_SCORES
    alpha = len(scores) / sum(s != 0 for s in scores)  # 6 / 4
    members = groups_of(ids, scores)
    mean = {g: (sum(v) / len(v) if len(v) > 1 else 0.0) for g, v in members.items()}
    expected = [alpha * (s - mean[g]) for g, s in zip(ids, scores)]
    advantages, _ = get_advantage_estimator("gpg")(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    assert per_row(advantages) == pytest.approx(expected)
    assert torch.equal(advantages == 0, (GROUP_MASK == 0) | (advantages == 0))  # 0 outside the mask


def test_opo_subtracts_the_length_weighted_group_mean():
    ids, scores = GROUP_IDS.tolist(), GROUP_SCORES
    lengths = GROUP_MASK.sum(-1).tolist()
    members = groups_of(ids, list(zip(scores, lengths)))
    baseline = {g: (sum(s * n for s, n in v) / sum(n for _, n in v) if len(v) > 1 else 0.0) for g, v in members.items()}
    advantages, _ = get_advantage_estimator("opo")(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    assert per_row(advantages) == pytest.approx([s - baseline[g] for g, s in zip(ids, scores)])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_rewards_only_each_groups_best_by_its_lead(norm_by_std):
    ids = torch.tensor([1, 1, 1, 2, 2, 2, 2])
    scores = [0.5, 2.0, 1.0, 3.0, 3.0, 1.0, 0.0]  # group 2: a tie for the best goes to the first
    mask = torch.ones(7, 2)
    expected = [0.0] * 7
    for g, best, lead in ((1, 1, 2.0 - 1.0), (2, 3, 0.0)):
        members = [s for i, s in zip(ids.tolist(), scores) if i == g]
        std = torch.tensor(members).std().item()
        expected[best] = lead / (std + 1e-6) if norm_by_std else lead
    advantages, _ = get_advantage_estimator("grpo_passk")(
        outcome_rewards(scores, mask), mask, group_ids=ids, eps=1e-6, norm_by_std=norm_by_std
    )
    assert torch.equal(advantages[:, 0], advantages[:, 1])
    assert advantages[:, 0].tolist() == pytest.approx(expected)
