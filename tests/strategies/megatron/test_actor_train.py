"""MegatronTrainStrategy behind ActorWorker on real Ray actors: HF parity (TP1, TP2, TP2xPP2), equal losses
across layouts, checkpoints across fresh actors and layouts, HF export and bucketed HF weights.

Tests run in file order and share groups: parity runs on fresh weights before any training.
"""

from __future__ import annotations

import pytest
import torch
from megatron_batches import hf_response_log_probs, make_rl_batch_tensors, max_masked_diff

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker

TOL = 1e-5
NUM_STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )
    return str(build_tiny_model(tmp_path_factory.mktemp("megatron_tiny"), spec))


@pytest.fixture(scope="module")
def batch_tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=5, seed=1)
    tensors[keys.OLD_LOG_PROBS], _ = hf_response_log_probs(model_dir, tensors)
    tensors[keys.ADVANTAGES] = torch.randn(tensors[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(2))
    return tensors


@pytest.fixture(scope="module")
def actor(make_group, model_dir):
    """actor(tp, pp, role=...) -> an initialised ActorWorker group (one per layout and role in this module)."""

    def build(tp: int, pp: int, role: str = "actor"):
        config = ActorConfig(
            strategy=MegatronTrainConfig(
                model_path=model_dir, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-2)
            ),
            loss=ActorLossConfig(clip_low=0.2),
        )
        group = make_group(ActorWorker, tp * pp, ParallelLayout(tp=tp, pp=pp), role=role, worker_config=config)
        if not getattr(group, "initialised", False):
            group.call(ActorWorker.init_model)
            group.initialised = True
        return group

    return build


@pytest.fixture(scope="module")
def results() -> dict:
    """Numbers one test hands to a later one (losses, checkpoint paths)."""
    return {}


def _log_probs(group, tensors) -> torch.Tensor:
    return group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch[keys.LOG_PROBS]


def _train(group, tensors, steps: int) -> list[dict]:
    metrics = []
    for _ in range(steps):
        per_dp = group.call(ActorWorker.train_step, DataProto.from_dict(tensors=tensors))
        metrics.append(per_dp[0])
    return metrics


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "tp2pp2"])
def test_log_probs_match_transformers(actor, model_dir, batch_tensors, tp, pp):
    """Left-padded prompts, uneven lengths, right-padded responses, 5 rows in micro-batches of 2."""
    expected, _ = hf_response_log_probs(model_dir, batch_tensors)
    got = _log_probs(actor(tp, pp), batch_tensors)
    assert got.shape == expected.shape
    assert max_masked_diff(got, expected, batch_tensors[keys.RESPONSE_MASK]) < TOL


def test_padding_columns_shared_by_every_row_change_nothing(actor, model_dir, batch_tensors):
    """Prompts arrive padded to max_prompt_length: the strategy trims columns no row uses (to a multiple of
    SEQUENCE_MULTIPLE), at TP2xPP2 where every stage must agree on the width."""
    from roll_backend.strategies.megatron.micro_batches import SEQUENCE_MULTIPLE, model_width

    extra = SEQUENCE_MULTIPLE + 3
    padded = dict(batch_tensors)
    for key in (keys.PROMPTS, keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS):
        padded[key] = torch.nn.functional.pad(batch_tensors[key], (extra, 0))
    width = batch_tensors[keys.INPUT_IDS].shape[1]
    assert (
        model_width(padded[keys.ATTENTION_MASK])
        == model_width(batch_tensors[keys.ATTENTION_MASK])
        == -(-width // SEQUENCE_MULTIPLE) * SEQUENCE_MULTIPLE
    )
    expected, _ = hf_response_log_probs(model_dir, batch_tensors)
    got = _log_probs(actor(2, 2), padded)
    assert max_masked_diff(got, expected, batch_tensors[keys.RESPONSE_MASK]) < TOL


def test_train_losses_equal_across_layouts_and_fall(actor, batch_tensors, results):
    tp1 = _train(actor(1, 1), batch_tensors, NUM_STEPS)
    tp2pp2 = _train(actor(2, 2), batch_tensors, NUM_STEPS)
    losses_tp1 = [m["loss"] for m in tp1]
    losses_tp2pp2 = [m["loss"] for m in tp2pp2]
    assert losses_tp1 == pytest.approx(losses_tp2pp2, abs=TOL)
    assert [m["grad_norm"] for m in tp1] == pytest.approx([m["grad_norm"] for m in tp2pp2], rel=1e-4)
    assert losses_tp1[-1] < losses_tp1[0] - 1e-3, losses_tp1
    results["trained_tp2pp2"] = True


def test_hf_export_loads_in_transformers_with_same_log_probs(actor, batch_tensors, results, tmp_path):
    """Export gathers TP shards and PP stages; transformers' log-probs of the export equal the actor's."""
    assert results.get("trained_tp2pp2"), "runs after the training test (trained weights differ from the input model)"
    group = actor(2, 2)
    group.call(ActorWorker.export_hf, str(tmp_path / "export"))
    expected = _log_probs(group, batch_tensors)
    exported, _ = hf_response_log_probs(str(tmp_path / "export"), batch_tensors)
    assert max_masked_diff(exported, expected, batch_tensors[keys.RESPONSE_MASK]) < TOL

    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "export" / "model.safetensors"))
    per_rank = group.call(ActorWorker.hf_weight_checksums, 1 << 14)  # small buckets: many of them
    for checksums in per_rank:  # every rank yields the same full tensors
        assert set(checksums) == set(saved)
        for name, (shape, total) in checksums.items():
            assert shape == tuple(saved[name].shape)
            assert total == pytest.approx(float(saved[name].double().sum()), abs=1e-4)


def test_checkpoint_resumes_in_fresh_actors_and_other_layout(actor, batch_tensors, tmp_path):
    saver = actor(2, 1)
    _train(saver, batch_tensors, 1)
    saver.call(ActorWorker.save_checkpoint, str(tmp_path / "ckpt"))
    log_probs_at_save = _log_probs(saver, batch_tensors)
    next_step = _train(saver, batch_tensors, 1)[0]

    fresh = actor(2, 1, role="actor_fresh")
    fresh.call(ActorWorker.load_checkpoint, str(tmp_path / "ckpt"))
    assert torch.equal(_log_probs(fresh, batch_tensors), log_probs_at_save)
    resumed_step = _train(fresh, batch_tensors, 1)[0]
    assert resumed_step["loss"] == next_step["loss"]
    assert resumed_step["grad_norm"] == next_step["grad_norm"]
    assert torch.equal(_log_probs(fresh, batch_tensors), _log_probs(saver, batch_tensors))

    other_layout = actor(1, 1)  # the TP2 checkpoint loads at TP1
    other_layout.call(ActorWorker.load_checkpoint, str(tmp_path / "ckpt"))
    mask = batch_tensors[keys.RESPONSE_MASK]
    assert max_masked_diff(_log_probs(other_layout, batch_tensors), log_probs_at_save, mask) < TOL
    assert _train(other_layout, batch_tensors, 1)[0]["loss"] == pytest.approx(next_step["loss"], abs=TOL)
