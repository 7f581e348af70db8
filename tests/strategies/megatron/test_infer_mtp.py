"""MegatronInferStrategy (reference) parity at PP2, a deliberately wrong mapping caught by parity, MTP at PP2,
and the critic's value head - on real Ray actors."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_batches import hf_response_log_probs, make_rl_batch_tensors, max_masked_diff

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronInferConfig, MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.critic import CriticConfig, CriticWorker
from roll_backend.workers.reference import ReferenceConfig, ReferenceWorker

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return str(build_tiny_model(tmp_path_factory.mktemp("megatron_tiny_mtp"), spec))


@pytest.fixture(scope="module")
def batch_tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=5, seed=3)
    tensors[keys.OLD_LOG_PROBS], _ = hf_response_log_probs(model_dir, tensors)
    tensors[keys.ADVANTAGES] = torch.randn(tensors[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(4))
    return tensors


def _started(group):
    if not getattr(group, "initialised", False):
        group.call(group.worker_cls.init_model)  # the reference, actor or critic it was made with
        group.initialised = True
    return group


def test_reference_log_probs_and_entropy_match_transformers_at_pp2(make_group, model_dir, batch_tensors):
    config = ReferenceConfig(
        strategy=MegatronInferConfig(model_path=model_dir, micro_batch_size=2, compute_entropy=True, temperature=0.7)
    )
    group = _started(make_group(ReferenceWorker, 2, ParallelLayout(pp=2), role="reference", worker_config=config))
    out = group.call(ReferenceWorker.compute_log_probs, DataProto.from_dict(tensors=batch_tensors))
    mask = batch_tensors[keys.RESPONSE_MASK]
    expected_lp, expected_entropy = hf_response_log_probs(model_dir, batch_tensors, temperature=0.7)
    assert max_masked_diff(out.batch[keys.LOG_PROBS], expected_lp, mask) < TOL
    assert max_masked_diff(out.batch[keys.ENTROPY], expected_entropy, mask) < TOL
    # the batch's meta temperature overrides the configured one
    at_one = group.call(
        ReferenceWorker.compute_log_probs,
        DataProto.from_dict(tensors=batch_tensors, meta_info={keys.META_TEMPERATURE: 1.0}),
    )
    assert max_masked_diff(at_one.batch[keys.LOG_PROBS], hf_response_log_probs(model_dir, batch_tensors)[0], mask) < TOL


def test_swapped_gate_up_mapping_fails_parity(make_group, model_dir, batch_tensors):
    config = ReferenceConfig(
        strategy=MegatronInferConfig(model_path=model_dir, micro_batch_size=2, test_swap_gate_up=True)
    )
    group = _started(make_group(ReferenceWorker, 1, ParallelLayout(), role="reference_wrong", worker_config=config))
    got = group.call(ReferenceWorker.compute_log_probs, DataProto.from_dict(tensors=batch_tensors)).batch[
        keys.LOG_PROBS
    ]
    expected, _ = hf_response_log_probs(model_dir, batch_tensors)
    assert max_masked_diff(got, expected, batch_tensors[keys.RESPONSE_MASK]) > 100 * TOL


def test_mtp_at_pp2_log_probs_loss_and_gradients(make_group, model_dir, batch_tensors):
    config = ActorConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, mtp_num_layers=1, optimizer=OptimizerSettings(lr=1e-3)
        )
    )
    group = _started(make_group(ActorWorker, 2, ParallelLayout(pp=2), role="actor_mtp", worker_config=config))
    got = group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=batch_tensors)).batch[keys.LOG_PROBS]
    expected, _ = hf_response_log_probs(model_dir, batch_tensors)
    assert max_masked_diff(got, expected, batch_tensors[keys.RESPONSE_MASK]) < TOL  # MTP leaves the main head alone

    metrics = group.call(ActorWorker.train_step, DataProto.from_dict(tensors=batch_tensors))[0]
    assert math.isfinite(metrics["mtp_loss"]) and metrics["mtp_loss"] > 0
    norms_per_rank = group.call(ActorWorker.param_grad_norms, "mtp.")
    last_stage = norms_per_rank[1]  # rank 1 is pp=1, where the MTP block lives
    assert last_stage and not norms_per_rank[0]
    assert all(math.isfinite(n) and n > 0 for n in last_stage.values()), last_stage


def test_critic_values_and_train_step(make_group, model_dir, batch_tensors):
    config = CriticConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, value_head=True, optimizer=OptimizerSettings(lr=1e-2)
        )
    )
    group = _started(make_group(CriticWorker, 2, ParallelLayout(tp=2), role="critic", worker_config=config))
    values = group.call(CriticWorker.compute_values, DataProto.from_dict(tensors=batch_tensors)).batch[keys.VALUES]
    assert values.shape == batch_tensors[keys.RESPONSES].shape and torch.isfinite(values).all()
    tensors = dict(batch_tensors, **{keys.VALUES: values, keys.RETURNS: torch.ones_like(values)})
    losses = [group.call(CriticWorker.train_step, DataProto.from_dict(tensors=tensors))[0]["vf_loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses


def test_token_budget_with_mtp_at_pp2_and_packing_with_the_value_head(make_group, model_dir, batch_tensors):
    """The groups above again (same keys): budget micro-batches under MTP at PP2 (variable shapes between stages)
    give the fixed micro-batches' log-probs and a finite MTP loss; the critic's values agree in all three modes."""
    from roll_backend.keys import META_MAX_TOKENS_PER_MICROBATCH, META_SEQUENCE_PACKING

    budget = {META_MAX_TOKENS_PER_MICROBATCH: 16}
    mask = batch_tensors[keys.RESPONSE_MASK]
    config = ActorConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, mtp_num_layers=1, optimizer=OptimizerSettings(lr=1e-3)
        )
    )
    actor = _started(make_group(ActorWorker, 2, ParallelLayout(pp=2), role="actor_mtp", worker_config=config))
    fixed = actor.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=batch_tensors)).batch[keys.LOG_PROBS]
    grouped = actor.call(
        ActorWorker.compute_log_probs, DataProto.from_dict(tensors=batch_tensors, meta_info=budget)
    ).batch[keys.LOG_PROBS]
    assert max_masked_diff(grouped, fixed, mask) < TOL
    metrics = actor.call(ActorWorker.train_step, DataProto.from_dict(tensors=batch_tensors, meta_info=budget))[0]
    assert math.isfinite(metrics["mtp_loss"]) and metrics["mtp_loss"] > 0

    config = CriticConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, value_head=True, optimizer=OptimizerSettings(lr=1e-2)
        )
    )
    critic = _started(make_group(CriticWorker, 2, ParallelLayout(tp=2), role="critic", worker_config=config))
    values = critic.call(CriticWorker.compute_values, DataProto.from_dict(tensors=batch_tensors)).batch[keys.VALUES]
    for meta in (budget, {**budget, META_SEQUENCE_PACKING: True}):
        got = critic.call(
            CriticWorker.compute_values, DataProto.from_dict(tensors=batch_tensors, meta_info=meta)
        ).batch[keys.VALUES]
        assert max_masked_diff(got, values, mask) < TOL, meta
