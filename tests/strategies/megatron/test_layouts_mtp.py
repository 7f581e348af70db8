"""Multi-token prediction across layouts (issue #21), on the package's shared Ray groups (PP1, PP2, TP2 x PP2, CP2,
PP2 x vpp2), each loading the tied and the untied model in turn:
- a checkpoint saved at one layout and loaded at the others gives the same next step (dist_checkpointing with the
  MTP stage's embedding copy and, tied, no stray output weight);
- HF export writes the MTP layers as `model.mtp_layers.{i}.*`, and importing that folder keeps them bit-exact.
Fresh MTP weights giving the same step at every layout, for many shapes, is in test_layout_properties.py."""

from __future__ import annotations

import json

import pytest
import torch
from megatron_batches import hf_response_log_probs, make_rl_batch_tensors, max_masked_diff
from reconfigurable_workers import ReconfigurableActor
from safetensors.torch import load_file

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig

TOL = 1e-5
MTP_HF_NAMES = (
    "token_layernorm.weight",
    "hidden_layernorm.weight",
    "input_proj.weight",
    "final_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request, tmp_path_factory) -> str:
    spec = TinyModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=request.param == "tied",
    )
    return str(build_tiny_model(tmp_path_factory.mktemp(f"mtp_{request.param}"), spec))


@pytest.fixture(scope="module")
def batch(model_dir) -> DataProto:
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=6, seed=5)
    tensors[keys.OLD_LOG_PROBS], _ = hf_response_log_probs(model_dir, tensors)
    tensors[keys.ADVANTAGES] = torch.randn(tensors[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(6))
    return DataProto.from_dict(tensors=tensors)


@pytest.fixture(scope="module")
def groups(layout_actors) -> dict:
    """The shared groups by the names this module uses (the model is loaded per test with init_model_with)."""
    names = {"pp1": "tp1", "pp2": "pp2", "tp2pp2": "tp2pp2", "cp2": "cp2", "pp2vpp2": "pp2vpp2"}
    return {name: layout_actors[shared] for name, shared in names.items()}


def _config(model_path: str, seed: int = 42) -> ActorConfig:
    return ActorConfig(
        strategy=MegatronTrainConfig(
            model_path=model_path,
            micro_batch_size=2,
            mtp_num_layers=1,
            mtp_loss_scaling_factor=0.3,
            seed=seed,
            optimizer=OptimizerSettings(lr=1e-3),
        )
    )


def _step(group, batch: DataProto) -> tuple[dict, torch.Tensor]:
    """One train step's metrics (last stage) and the log-probs after it."""
    metrics = next(m for m in group.call(ReconfigurableActor.train_step, batch) if m is not None)
    return metrics, group.call(ReconfigurableActor.compute_log_probs, batch).batch[keys.LOG_PROBS]


def _assert_same_step(results: dict[str, tuple[dict, torch.Tensor]], mask: torch.Tensor) -> None:
    (ref_name, (ref_metrics, ref_lp)), *others = results.items()
    for name, (metrics, log_probs) in others:
        where = f"{name} vs {ref_name}"
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=TOL), where
        assert metrics["mtp_loss"] == pytest.approx(ref_metrics["mtp_loss"], abs=TOL), where
        assert max_masked_diff(log_probs, ref_lp, mask) <= TOL, where


def test_checkpoint_saved_at_one_layout_gives_the_same_step_at_every_layout(groups, model_dir, batch, tmp_path):
    saver = groups["tp2pp2"]
    saver.call(ReconfigurableActor.init_model_with, _config(model_dir))
    saver.call(ReconfigurableActor.train_step, batch)
    saved_lp = saver.call(ReconfigurableActor.compute_log_probs, batch).batch[keys.LOG_PROBS]
    checkpoint = str(tmp_path / "ckpt")
    saver.call(ReconfigurableActor.save_checkpoint, checkpoint)
    mask = batch.batch[keys.RESPONSE_MASK]
    results = {}
    for name, group in groups.items():
        group.call(
            ReconfigurableActor.init_model_with, _config(model_dir, seed=7)
        )  # another seed: only the checkpoint can make them agree
        group.call(ReconfigurableActor.load_checkpoint, checkpoint)
        assert (
            max_masked_diff(
                group.call(ReconfigurableActor.compute_log_probs, batch).batch[keys.LOG_PROBS], saved_lp, mask
            )
            <= TOL
        ), name
        results[name] = _step(group, batch)
    _assert_same_step(results, mask)
    # and back: PP1 saves, PP2 loads, the next steps agree
    groups["pp1"].call(ReconfigurableActor.save_checkpoint, str(tmp_path / "ckpt_pp1"))
    groups["pp2"].call(ReconfigurableActor.init_model_with, _config(model_dir, seed=9))
    groups["pp2"].call(ReconfigurableActor.load_checkpoint, str(tmp_path / "ckpt_pp1"))
    _assert_same_step({"pp1": _step(groups["pp1"], batch), "pp2": _step(groups["pp2"], batch)}, mask)


def test_hf_export_carries_mtp_layers_and_import_keeps_them_bit_exact(groups, model_dir, batch, tmp_path):
    trained = groups["tp2pp2"]
    trained.call(ReconfigurableActor.init_model_with, _config(model_dir))
    trained.call(ReconfigurableActor.train_step, batch)
    exported = tmp_path / "exported"
    trained.call(ReconfigurableActor.export_hf, str(exported))
    state = load_file(exported / "model.safetensors")
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 1
    for suffix in MTP_HF_NAMES:
        assert f"model.mtp_layers.0.{suffix}" in state, suffix
    assert not any(name.startswith("mtp.") for name in state)

    reimported = groups["pp1"]
    reimported.call(
        ReconfigurableActor.init_model_with, _config(str(exported), seed=11)
    )  # another seed: the folder's MTP weights must win
    again = tmp_path / "again"
    reimported.call(ReconfigurableActor.export_hf, str(again))
    state_again = load_file(again / "model.safetensors")
    assert state_again.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(state_again[name], tensor), name
    # the folder's weights are not what a fresh start at that seed would give
    reimported.call(ReconfigurableActor.init_model_with, _config(model_dir, seed=11))
    fresh = tmp_path / "fresh"
    reimported.call(ReconfigurableActor.export_hf, str(fresh))
    fresh_proj = load_file(fresh / "model.safetensors")["model.mtp_layers.0.input_proj.weight"]
    assert not torch.equal(fresh_proj, state["model.mtp_layers.0.input_proj.weight"])
