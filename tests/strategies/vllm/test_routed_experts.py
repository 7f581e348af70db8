"""The vLLM rollout's routed experts (MoE routing replay R3, `return_routed_experts`), on a RolloutWorker in a Ray
actor with a tiny Qwen3-MoE: every token the engine forwarded carries the experts transformers' router picks for it
at each layer (top-2 of 4), in the rollout batch's layout; the last sampled token (never forwarded) and padding
carry -1. Two prompts share two whole KV blocks and each has 3 samples, so most prompt rows are read from the
prefix cache and never forwarded again: they come from the sample that computed them. After a weight update (new
router weights) the routes are the new router's."""

from __future__ import annotations

import pytest
import ray
import torch
from router_checks import hf_routes

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

SPEC = TinyModelSpec(family="qwen3_moe", hidden_size=64, num_attention_heads=2, num_key_value_heads=2, seed=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm_moe"), SPEC))


@pytest.fixture(scope="module")
def rollout(make_group, model_dir):
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_dir,
            max_model_len=128,
            return_routed_experts=True,
            sampling=SamplingConfig(n=3, temperature=1.0, max_tokens=6),
        )
    )
    group = make_group(RolloutWorker, 1, role="rollout_moe", worker_config=config)
    group.call(RolloutWorker.init_model)
    return group


def prompts() -> DataProto:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 300, (64,), generator=gen).tolist()  # two whole 32-token KV blocks
    ids = [shared + torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 9)]
    padded, mask = left_pad(ids, 0)
    return DataProto.from_dict(tensors={keys.PROMPTS: padded, keys.ATTENTION_MASK: mask})


def check_routes(batch: DataProto, model_dir: str) -> None:
    tensors = batch.batch
    routes, attention = tensors[keys.ROUTED_EXPERTS], tensors[keys.ATTENTION_MASK].bool()
    assert routes.dtype == torch.int16 and routes.shape == (*attention.shape, 2, 2)
    expected = hf_routes(model_dir, {k: tensors[k] for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)})
    last = attention.shape[1] - 1 - attention.flip(1).long().argmax(1)
    forwarded = attention.clone()
    forwarded[torch.arange(len(last)), last] = False
    assert (routes[~forwarded] == -1).all()  # padding and each sample's last token
    assert torch.equal(routes[forwarded].sort(-1).values, expected[forwarded].sort(-1).values)


def test_routes_of_every_forwarded_token_match_transformers(rollout, model_dir):
    batch = rollout.call(RolloutWorker.generate, prompts())
    assert batch.meta_info[keys.META_METRICS]["rollout/prompt_cached_fraction"][0] > 0.5  # rows read from cache
    check_routes(batch, model_dir)


def test_routes_after_a_weight_update_are_the_new_routers(rollout, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    changed = {
        n: w + 0.05 * torch.randn(w.shape, generator=gen) if n.endswith("mlp.gate.weight") else w
        for n, w in weights.items()
    }
    refs = [ray.put(list(changed.items()))]
    rollout.call(RolloutWorker.load_weight_buckets, refs, version=1)
    updated = tmp_path / "updated"
    build_tiny_model(updated, SPEC)  # the same config and tokenizer, then the new weights
    save_file(changed, str(updated / "model.safetensors"), metadata={"format": "pt"})
    check_routes(rollout.call(RolloutWorker.generate, prompts()), str(updated))
