"""Two rollout ranks (DP=2, one engine each, vLLM on the role's gloo world via external_launcher): an uneven prompt
batch is split, sampled, collected in order with uid groups intact, a weight update reaches both engines, and a
minimal sync that fails on one engine is undone on both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.keys import META_VALIDATE
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.protocol.weight_delta import changed_tensors
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

VLLM_TINY = TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, seed=3)
PROMPTS = ["what is 1 + 2?", "copy 12345", "reverse the digits", "sum 3 4 5", "add 10"]  # 5 rows over 2 ranks
MAX_PROMPT_LENGTH = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm_dp2"), VLLM_TINY))


@pytest.fixture(scope="module")
def rollout(make_group, model_dir):
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_dir,
            max_model_len=256,
            max_prompt_length=MAX_PROMPT_LENGTH,  # equal prompt widths on both ranks, so the parts concatenate
            sampling=SamplingConfig(n=3, temperature=1.0, max_tokens=12),
            validation=SamplingConfig(n=1, temperature=0.0, max_tokens=12),
            weight_sync_bucket_mb=1 / 16,  # a decoder layer per load: a fault can fall between two
        )
    )
    group = make_group(RolloutWorker, 2, role="rollout", worker_config=config)
    group.call(RolloutWorker.init_model)
    return group


def text_batch(prompts, **meta) -> DataProto:
    return DataProto.from_dict(
        non_tensors={
            keys.PROMPT_TEXT: np.array(prompts, dtype=object),
            keys.ANSWER: np.array([f"a{i}" for i in range(len(prompts))], dtype=object),
        },
        meta_info=meta,
    )


def test_uneven_batch_split_over_two_ranks_comes_back_in_order(rollout):
    out = rollout.call(RolloutWorker.generate, text_batch(PROMPTS))
    assert len(out) == len(PROMPTS) * 3  # the padding row added for the split is dropped, n times
    assert list(out.non_tensor_batch[keys.ANSWER]) == [f"a{i}" for i in range(len(PROMPTS)) for _ in range(3)]
    assert list(out.non_tensor_batch[keys.PROMPT_TEXT][::3]) == PROMPTS
    uids = out.non_tensor_batch[keys.UID].reshape(len(PROMPTS), 3)
    assert all(len(set(group)) == 1 for group in uids) and len(set(uids[:, 0])) == len(PROMPTS)
    assert out.batch[keys.PROMPTS].shape == (len(out), MAX_PROMPT_LENGTH)
    mask = out.batch[keys.RESPONSE_MASK].bool()
    assert torch.isfinite(out.batch[keys.ROLLOUT_LOG_PROBS][mask]).all()


def test_weight_update_reaches_both_engines(rollout, model_dir):
    from transformers import AutoModelForCausalLM

    same_prompt_twice = text_batch([PROMPTS[0], PROMPTS[0]], **{META_VALIDATE: True})  # one row per rank
    before = rollout.call(RolloutWorker.generate, same_prompt_twice).batch[keys.RESPONSES]
    assert torch.equal(before[0], before[1])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = [(name, param.detach() * 3.0) for name, param in model.named_parameters()]  # clearly different weights
    assert rollout.call(RolloutWorker.update_weights, named) == [len(named), len(named)]
    after = rollout.call(RolloutWorker.generate, same_prompt_twice).batch[keys.RESPONSES]
    assert torch.equal(after[0], after[1]), "the two engines disagree after the update: one kept old weights"
    assert not torch.equal(after[0], before[0])


def test_a_minimal_sync_failing_on_one_engine_is_undone_on_both(rollout, model_dir):
    """All or nothing across ranks (#52): a minimal sync whose load fails between two decoder layers on rank 0 leaves
    both engines on their version bit for bit (they agree before either commits), where rank 1 alone would have
    switched; the same sync then lands on both."""
    import ray
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def whole(scale: float, version: int) -> list:
        named = [(name, param.detach() * scale) for name, param in model.named_parameters()]
        return [ray.put(changed_tensors(named, None, version))]

    rollout.call(RolloutWorker.load_weight_deltas, whole(1.0, 1), version=1)  # fills both engines' copies
    served = rollout.call(RolloutWorker.weights_digest)
    rollout.call(RolloutWorker.inject_fault, "raise:rollout:0:engine_load_bucket:1")
    with pytest.raises(Exception, match="serves version 1 again"):
        rollout.call(RolloutWorker.load_weight_deltas, whole(0.5, 2), version=2)
    rollout.call(RolloutWorker.inject_fault, None)
    assert rollout.call(RolloutWorker.weights_digest) == served
    assert rollout.call(RolloutWorker.weights_version) == [1, 1]
    rollout.call(RolloutWorker.load_weight_deltas, whole(0.5, 2), version=2)
    landed = rollout.call(RolloutWorker.weights_digest)
    assert landed[0] == landed[1] != served[0] and rollout.call(RolloutWorker.weights_version) == [2, 2]
