"""The actor's loss without OLD_LOG_PROBS (an on-policy step) equals the loss with old = current log-probs."""

import torch

from roll_backend import keys
from roll_backend.config.schema import AlgorithmConfig
from roll_backend.pipelines.loops.phases import is_on_policy, needs_old_log_probs
from roll_backend.protocol import DataProto
from roll_backend.workers.actor import ActorLossConfig, actor_loss


def _loss_and_grad(with_old: bool):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, generator=generator, requires_grad=True)
    log_probs = torch.log_softmax(logits, -1)
    tensors = {
        keys.RESPONSE_MASK: torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),
        keys.ADVANTAGES: torch.randn(3, 5, generator=generator),
        keys.REF_LOG_PROBS: torch.randn(3, 5, generator=generator) - 2,
    }
    if with_old:
        tensors[keys.OLD_LOG_PROBS] = log_probs.detach().clone()
    micro = DataProto.from_dict(tensors=tensors, meta_info={keys.META_GLOBAL_TOKEN_COUNT: 9.0})
    loss, metrics = actor_loss(ActorLossConfig(kl_loss_coef=0.1), {keys.LOG_PROBS: log_probs}, micro)
    loss.backward()
    return loss.detach(), logits.grad, metrics


def test_on_policy_loss_equals_loss_with_old_log_probs_equal_to_current():
    loss_old, grad_old, metrics_old = _loss_and_grad(with_old=True)
    loss_on, grad_on, metrics_on = _loss_and_grad(with_old=False)
    assert torch.equal(loss_old, loss_on)
    assert torch.allclose(grad_old, grad_on, atol=0, rtol=0)
    assert float(metrics_on["pg_clipfrac"]) == 0.0 and float(metrics_old["ppo_kl"]) == 0.0
    assert grad_on.abs().sum() > 0


def test_on_policy_only_for_one_epoch_one_mini_batch_and_kl_outside_the_reward():
    assert is_on_policy(AlgorithmConfig(ppo_epochs=1, ppo_mini_batch_size=None), 64)
    assert is_on_policy(AlgorithmConfig(ppo_epochs=1, ppo_mini_batch_size=64), 64)
    assert not is_on_policy(AlgorithmConfig(ppo_epochs=1, ppo_mini_batch_size=32), 64)
    assert not is_on_policy(AlgorithmConfig(ppo_epochs=2), 64)
    assert not is_on_policy(AlgorithmConfig(use_kl_in_reward=True), 64)


def test_old_log_probs_are_computed_off_policy_or_for_the_rollout_correction():
    from roll_backend.config.schema import RolloutCorrectionConfig

    assert not needs_old_log_probs(AlgorithmConfig(), 64)
    assert needs_old_log_probs(AlgorithmConfig(ppo_epochs=2), 64)
    for correction in (RolloutCorrectionConfig(is_level="token"), RolloutCorrectionConfig(rejection="sequence")):
        assert needs_old_log_probs(AlgorithmConfig(rollout_correction=correction), 64)  # on-policy, yet needed


def test_distillation_as_a_loss_adds_the_teacher_kl_like_the_reference_kl():
    """distill_loss_coef * the kl_estimator's token-mean KL to TEACHER_LOG_PROBS: with the teacher's log-probs in the
    reference's column instead, kl_loss_coef gives the same loss and gradient."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    advantages, teacher = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator) - 2
    logits = torch.randn(3, 5, generator=generator)

    def loss_and_grad(column: str, config: ActorLossConfig):
        leaf = logits.clone().requires_grad_(True)
        tensors = {keys.RESPONSE_MASK: mask, keys.ADVANTAGES: advantages, column: teacher}
        micro = DataProto.from_dict(tensors=tensors, meta_info={keys.META_GLOBAL_TOKEN_COUNT: 9.0})
        loss, metrics = actor_loss(config, {keys.LOG_PROBS: torch.log_softmax(leaf, -1)}, micro)
        loss.backward()
        return loss.detach(), leaf.grad, metrics

    distilled = loss_and_grad(keys.TEACHER_LOG_PROBS, ActorLossConfig(distill_loss_coef=0.3))
    as_reference = loss_and_grad(keys.REF_LOG_PROBS, ActorLossConfig(kl_loss_coef=0.3))
    assert torch.allclose(distilled[0], as_reference[0]) and torch.allclose(distilled[1], as_reference[1])
    assert float(distilled[2]["distill_kl"]) == float(as_reference[2]["kl_loss"]) > 0


def test_the_run_s_policy_loss_and_its_settings_reach_the_actor_loss():
    """Each registered policy loss is what the actor trains with, with the run's settings from `algorithm`: the
    actor's loss equals the registered loss called with them (SAPO at the run's gate temperatures, which matter)."""
    from types import SimpleNamespace

    from roll_backend.algorithms import POLICY_LOSS_NAMES, get_policy_loss
    from roll_backend.config.schema import DistillationConfig
    from roll_backend.pipelines.groups import _actor_loss_config

    generator = torch.Generator().manual_seed(1)
    log_probs = torch.log_softmax(torch.randn(2, 4, generator=generator), -1)
    old = log_probs + 0.3 * torch.randn(2, 4, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    advantages = torch.tensor([[1.0] * 4, [-0.5] * 4])
    tensors = {keys.RESPONSE_MASK: mask, keys.ADVANTAGES: advantages, keys.OLD_LOG_PROBS: old}
    micro = DataProto.from_dict(tensors=tensors, meta_info={keys.META_GLOBAL_TOKEN_COUNT: 7.0})
    settings = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0, agg_mode="token-mean", batch_num_tokens=7.0)
    losses = {}
    for name in POLICY_LOSS_NAMES:
        algo = AlgorithmConfig(
            policy_loss=name, sapo_tau_pos=2.0, sapo_tau_neg=3.0, clip_ratio_high=0.28, use_kl_loss=False
        )
        run = SimpleNamespace(offline=False, pipeline="grpo", distillation=DistillationConfig(), teacher=None)
        losses[name], _ = actor_loss(
            _actor_loss_config(SimpleNamespace(**vars(run), algorithm=algo)), {keys.LOG_PROBS: log_probs}, micro
        )
        expected = get_policy_loss(name)(old, log_probs, advantages, mask.float(), tau_pos=2.0, tau_neg=3.0, **settings)
        assert torch.allclose(losses[name], expected.loss), name
    at_defaults = get_policy_loss("sapo")(old, log_probs, advantages, mask.float(), **settings).loss
    assert (losses["sapo"] - at_defaults).abs() > 1e-3
    assert len({round(float(v), 6) for v in losses.values()}) == len(losses)  # six different objectives
