"""Driver-side step math: dynamic sampling and advantages on a hand-made batch (no Ray)."""

import numpy as np
import torch

from roll_backend import keys
from roll_backend.config.schema import AlgorithmConfig
from roll_backend.pipelines.loops.phases import advantages, drop_uniform_groups
from roll_backend.protocol import DataProto


def scored_batch(scores: list[float], uids: list[str]) -> DataProto:
    n = len(scores)
    token_scores = torch.zeros(n, 3)
    token_scores[:, 1] = torch.tensor(scores)
    mask = torch.tensor([[1, 1, 0]] * n)
    return DataProto.from_dict(
        tensors={keys.TOKEN_LEVEL_SCORES: token_scores, keys.RESPONSE_MASK: mask},
        non_tensors={keys.UID: np.array(uids, dtype=object)},
    )


def test_dynamic_sampling_drops_only_groups_whose_rewards_are_all_equal():
    batch = scored_batch([1, 1, -2, -1, 0, 0, -3, -3], ["a", "a", "b", "b", "c", "c", "d", "d"])
    kept, dropped = drop_uniform_groups(batch)
    assert dropped == 6
    assert kept.non_tensor_batch[keys.UID].tolist() == ["b", "b"]  # all-negative but different: kept


def test_refill_keeps_the_first_groups_in_the_order_they_came():
    from roll_backend.pipelines.loops.dynamic_sampling import first_groups

    batch = scored_batch([1, 0, 2, 3, 0, 1, 5, 4], ["c", "c", "a", "a", "b", "b", "d", "d"])
    kept = first_groups(batch, 2)
    assert kept.non_tensor_batch[keys.UID].tolist() == ["c", "c", "a", "a"]
    assert kept.batch[keys.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1, 0, 2, 3]
    assert len(first_groups(batch, 9)) == 8


def test_grpo_advantages_on_the_batch_are_group_normalised_and_masked():
    batch = scored_batch([1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"])
    metrics = advantages(batch, AlgorithmConfig(adv_estimator="grpo", use_kl_loss=False), kl_coef=0.0)
    adv = batch.batch[keys.ADVANTAGES]
    std = float(torch.tensor([1.0, 0.0]).std())
    assert torch.allclose(adv[0, :2], torch.full((2,), 0.5 / (std + 1e-6)))
    assert torch.allclose(adv[1, :2], torch.full((2,), -0.5 / (std + 1e-6)))
    assert torch.equal(adv[2:], torch.zeros(2, 3)) and torch.equal(adv[:, 2], torch.zeros(4))
    assert "advantages/mean" in metrics


def test_distillation_as_a_reward_subtracts_the_per_token_reverse_kl():
    """distillation.mode=reward: each response token's reward loses coef * (log pi - log pi_teacher), the sampler's
    log-probs standing in for the policy's on-policy; outside the mask nothing changes. mode=loss leaves the
    rewards alone (the actor loss takes it) but reports the same reverse KL."""
    from roll_backend.config.schema import DistillationConfig

    batch = scored_batch([1.0, 0.0], ["a", "a"])
    policy = torch.tensor([[-0.5, -1.0, -9.0], [-2.0, -0.1, -9.0]])
    teacher = torch.tensor([[-1.5, -0.5, -1.0], [-0.5, -0.3, -1.0]])
    batch.batch[keys.ROLLOUT_LOG_PROBS] = policy
    batch.batch[keys.TEACHER_LOG_PROBS] = teacher
    algo = AlgorithmConfig(adv_estimator="reinforce_plus_plus", use_kl_loss=False)
    metrics = advantages(batch, algo, 0.0, DistillationConfig(mode="reward", coef=0.5))
    mask = batch.batch[keys.RESPONSE_MASK].float()
    expected = batch.batch[keys.TOKEN_LEVEL_SCORES] - 0.5 * (policy - teacher) * mask
    assert torch.allclose(batch.batch[keys.TOKEN_LEVEL_REWARDS], expected)
    reverse_kl = float(((policy - teacher) * mask).sum() / mask.sum())
    assert metrics["distill/reverse_kl"] == reverse_kl
    as_loss = scored_batch([1.0, 0.0], ["a", "a"])
    as_loss.batch[keys.ROLLOUT_LOG_PROBS], as_loss.batch[keys.TEACHER_LOG_PROBS] = policy, teacher
    metrics = advantages(as_loss, algo, 0.0, DistillationConfig(mode="loss", coef=0.5))
    assert torch.equal(as_loss.batch[keys.TOKEN_LEVEL_REWARDS], as_loss.batch[keys.TOKEN_LEVEL_SCORES])
    assert metrics["distill/reverse_kl"] == reverse_kl
