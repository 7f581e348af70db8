"""LoRA weight sync, both modes (issue #34): a Megatron actor (TP2) trains LoRA adapters a few steps on vLLM's own
rollouts; one engine receives the merged weights (base + (alpha / r) B A, the verified full-weight path), another,
which serves adapters over the base it started with (max_lora_rank), receives the adapters alone as a PEFT folder.
Both give the same greedy tokens on 16 prompts sharing a 420-token prefix, and score the same sampled sequences with
the same log-probs, which are Megatron's; the adapter sync moves a fraction of the bytes."""

from __future__ import annotations

import pytest
import torch
from test_weight_sync import (  # shared helpers of the transformers-trained variant
    GREEDY_TOKENS,
    NUM_PROMPTS,
    model_dir,  # noqa: F401  (fixture: the tiny model with a sharpened LM head)
    prompt_batch,
    shared_prefix_prompts,  # noqa: F401  (fixture)
    tokenizer,  # noqa: F401  (fixture)
    vllm_greedy_rows,
)
from test_weight_sync_megatron import megatron_log_probs

from roll_backend import keys
from roll_backend.distributed.parallel import ParallelLayout
from roll_backend.keys import META_VALIDATE
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import LoRASettings, MegatronTrainConfig, OptimizerSettings
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

TRAIN_STEPS = 3
RANK = 8


def rollout_group(make_group, model_dir: str, role: str, max_lora_rank: int | None):
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_dir,
            max_model_len=1024,
            sampling=SamplingConfig(n=4, temperature=1.0, max_tokens=24),
            validation=SamplingConfig(n=1, temperature=0.0, max_tokens=GREEDY_TOKENS),
            max_lora_rank=max_lora_rank,
        )
    )
    group = make_group(RolloutWorker, 1, role=role, worker_config=config)
    group.call(RolloutWorker.init_model)
    return group


@pytest.fixture(scope="module")
def engines(make_group, model_dir):  # noqa: F811
    return {
        "merged": rollout_group(make_group, model_dir, "rollout_merged", None),
        "adapter": rollout_group(make_group, model_dir, "rollout_adapter", RANK),
    }


@pytest.fixture(scope="module")
def actor(make_group, model_dir):  # noqa: F811
    config = ActorConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir,
            micro_batch_size=4,
            optimizer=OptimizerSettings(lr=2e-2),
            lora=LoRASettings(rank=RANK, alpha=16.0, sync="adapter"),
        ),
    )
    group = make_group(ActorWorker, 2, ParallelLayout(tp=2), role="lora_actor", worker_config=config)
    group.call(ActorWorker.init_model)
    return group


def greedy(engine, prompts, pad_id: int) -> list[list[int]]:
    return vllm_greedy_rows(engine.call(RolloutWorker.generate, prompt_batch(prompts, pad_id, **{META_VALIDATE: True})))


@pytest.fixture(scope="module")
def synced(engines, actor, tokenizer, shared_prefix_prompts):  # noqa: F811
    """Greedy output of the base, TRAIN_STEPS PPO steps of the adapters on the merged engine's samples, then each
    engine's sync. Returns (greedy before, {mode: what the rollout loaded})."""
    pad_id = tokenizer.pad_token_id
    before = greedy(engines["adapter"], shared_prefix_prompts, pad_id)
    assert before == greedy(engines["merged"], shared_prefix_prompts, pad_id)
    gen = torch.Generator().manual_seed(0)
    for step in range(TRAIN_STEPS):
        samples = engines["merged"].call(
            RolloutWorker.generate, prompt_batch(shared_prefix_prompts[4 * step : 4 * step + 4], pad_id)
        )
        samples = samples.select(
            batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES, keys.RESPONSE_MASK]
        )
        advantages = torch.randn(samples.batch[keys.RESPONSES].shape, generator=gen)
        extra = DataProto.from_dict(
            tensors={keys.OLD_LOG_PROBS: megatron_log_probs(actor, samples), keys.ADVANTAGES: advantages}
        )
        actor.call(ActorWorker.train_step, samples.union(extra))
    merged = next(refs for refs in actor.call(ActorWorker.publish_hf_weights, 1 << 30) if refs)
    adapter = next(refs for refs in actor.call(ActorWorker.publish_adapter) if refs)
    loaded = {
        "merged": engines["merged"].call(RolloutWorker.load_weight_buckets, merged)[0],
        "adapter": engines["adapter"].call(RolloutWorker.load_adapter, adapter, version=1)[0],
    }
    return before, loaded


def test_adapter_and_merged_sync_give_the_same_engine(engines, actor, synced, tokenizer, shared_prefix_prompts):  # noqa: F811
    before, loaded = synced
    pad_id = tokenizer.pad_token_id
    after = {mode: greedy(engine, shared_prefix_prompts, pad_id) for mode, engine in engines.items()}
    assert after["merged"] != before, "training did not change the greedy output; the test would prove nothing"
    matches = sum(a == m for a, m in zip(after["adapter"], after["merged"]))
    assert matches == NUM_PROMPTS, f"{matches}/{NUM_PROMPTS} prompts give the same greedy tokens"
    # Both engines score the same sampled sequences alike, with Megatron's log-probs.
    sampled = engines["merged"].call(RolloutWorker.generate, prompt_batch(shared_prefix_prompts[:4], pad_id))
    mask = sampled.batch[keys.RESPONSE_MASK].bool()
    probes = {
        mode: engine.call(RolloutWorker.probe_log_probs, sampled).batch[keys.LOG_PROBS]
        for mode, engine in engines.items()
    }
    trainer = megatron_log_probs(actor, sampled)
    assert (probes["adapter"] - probes["merged"]).abs()[mask].max() < 1e-4
    assert (probes["adapter"] - trainer).abs()[mask].mean() < 1e-5
    # 2 layers x 7 modules x (A, B) against every weight of the model.
    assert loaded["adapter"]["tensors"] == 2 * 7 * 2
    assert loaded["adapter"]["bytes"] * 10 < loaded["merged"]["bytes"], loaded
