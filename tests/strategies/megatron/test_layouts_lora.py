"""LoRA on the Megatron train strategy (issue #34, first part) on the shared layout groups: a 4-layer Qwen2 with
adapters on every projection (rank 4) takes two steps at TP1, TP2, PP2, TP2 x PP2, CP2, PP2 x vpp2 and DP2 from the
same start:

- before the first step the model is the base (B starts at 0): transformers' log-probs;
- the steps' loss and grad norm, and the merged weights after them (the base plus (alpha / r) B A, what the weight
  sync and the HF export send), equal TP1's; the optimizer holds the adapters only and the base is bit-identical;
- transformers on the merged weights gives the trained model's log-probs, and the forward with the adapters off
  (keys.META_BASE_MODEL, the reference without a second model) gives the base's.
"""

from __future__ import annotations

import pytest
import torch
from megatron_batches import hf_response_log_probs, max_masked_diff, rl_batch_of_lengths
from reconfigurable_workers import ReconfigurableActor

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import LoRASettings, MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig

TOL = 1e-5
LORA = LoRASettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, seed=9)
    return str(build_tiny_model(tmp_path_factory.mktemp("lora_base"), spec))


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    batch = rl_batch_of_lengths([1, 6, 3, 5, 2, 4], [1, 4, 6, 2, 5, 3], 6, 6, 300, gen)
    batch[keys.OLD_LOG_PROBS] = torch.zeros_like(batch[keys.ADVANTAGES])  # replaced by the model's own below
    return batch


def lora_run(group, model_dir: str, tensors: dict) -> dict:
    config = ActorConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-2), lora=LORA
        ),
        loss=ActorLossConfig(clip_low=0.2),
    )
    group.call(ReconfigurableActor.init_model_with, config)
    base_before = group.call(ReconfigurableActor.base_weights)
    before = group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch
    batch = DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: before[keys.LOG_PROBS]})
    steps = [next(m for m in group.call(ReconfigurableActor.train_step, batch) if m) for _ in range(2)]
    base_model = DataProto.from_dict(tensors=tensors, meta_info={keys.META_BASE_MODEL: True})
    return {
        "before": before[keys.LOG_PROBS],
        "steps": steps,
        "after": group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch,
        "base_model": group.call(ReconfigurableActor.compute_log_probs, base_model).batch[keys.LOG_PROBS],
        "merged": group.call(ReconfigurableActor.merged_hf_weights)[0],
        "base_unchanged": all(
            torch.equal(a[name], b[name])
            for a, b in zip(base_before, group.call(ReconfigurableActor.base_weights))
            for name in a
        ),
        "trained": group.call(ReconfigurableActor.optimizer_parameter_names),
    }


def test_lora_steps_are_the_same_at_every_layout(layout_actors, model_dir, tensors, tmp_path):
    mask = tensors[keys.RESPONSE_MASK]
    base, _ = hf_response_log_probs(model_dir, tensors)
    runs = {name: lora_run(group, model_dir, tensors) for name, group in layout_actors.items()}
    reference = runs["tp1"]
    for name, run in runs.items():
        assert max_masked_diff(run["before"], base, mask) < TOL, name  # B = 0: the base model
        assert run["base_unchanged"], name
        assert all(".lora." in param for names in run["trained"] for param in names) and any(run["trained"]), name
        for step, (got, want) in enumerate(zip(run["steps"], reference["steps"])):
            for key in ("loss", "pg_loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], abs=TOL), (name, step, key)
        assert sorted(run["merged"]) == sorted(reference["merged"])
        for weight, tensor in reference["merged"].items():
            assert torch.allclose(run["merged"][weight], tensor, atol=TOL), (name, weight)
        assert max_masked_diff(run["after"][keys.LOG_PROBS], reference["after"][keys.LOG_PROBS], mask) < TOL, name
        assert max_masked_diff(run["base_model"], base, mask) < TOL, name  # adapters off: the reference
    moved = max_masked_diff(reference["after"][keys.LOG_PROBS], base, mask)
    assert moved > 1e-2, moved  # the adapters learned something
    # The merged weights are a Hugging Face model with the trained log-probs.
    merged_dir = tmp_path / "merged"
    layout_actors["tp1"].call(ReconfigurableActor.export_hf, str(merged_dir))
    merged, _ = hf_response_log_probs(str(merged_dir), tensors)
    assert max_masked_diff(merged, reference["after"][keys.LOG_PROBS], mask) < TOL
