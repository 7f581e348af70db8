"""Qwen3 dense, Qwen2-MoE and Qwen3-MoE on Megatron with expert parallelism, on real Ray groups: log-prob
parity with transformers at EP1, EP2, TP2xEP2 (etp 1 and 2) and PP2xEP2; the same train step (loss, aux loss,
router load, grad norm, post-step log-probs) at EP1 and TP2xEP2; checkpoints across EP layouts; HF export
round-trips bit for bit; LoRA on a MoE model under sequence parallelism and expert TP.

One group per layout holds all three models (MultiModelActorWorker). Tests run in file order: parity runs on
the loaded weights before any training. Routing parity needs no near-ties between the k-th and (k+1)-th router
logit (an ulp of difference could pick another expert): `test_reference_routing_has_no_near_ties` checks the
margin on the reference inputs, so a parity failure cannot be a tie flip.
"""

from __future__ import annotations

import pytest
import torch
from megatron_batches import hf_response_log_probs, make_rl_batch_tensors, max_masked_diff
from multi_model_actor import MultiModelActorWorker
from router_checks import hf_routes, replay_step, same_routes

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.worker import Worker
from roll_backend.keys import META_BALANCE_DP
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import LoRASettings, MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig

TOL = 1e-5
FAMILIES = ("qwen3", "qwen2_moe", "qwen3_moe")
LAYOUTS = {
    "ep1": (1, ParallelLayout()),
    "ep2": (2, ParallelLayout(ep=2)),
    "tp2ep2_etp1": (4, ParallelLayout(tp=2, ep=2, etp=1)),
    "tp2ep2_etp2": (4, ParallelLayout(tp=2, ep=2, etp=2)),
    "pp2ep2": (4, ParallelLayout(pp=2, ep=2)),
}
REPLAYED = "qwen3_moe_r2"  # an untrained Qwen3-MoE copy with router_replay R2, for the replay test
ADAPTED = "qwen2_moe_lora"  # Qwen2-MoE with LoRA adapters on attention, every expert and the shared expert
LORA = LoRASettings(rank=4, alpha=8.0)
# Trained in test_train_step_is_the_same_at_ep1_and_tp2ep2: family -> the TP2xEP2 layout it is compared at.
TRAINED = {"qwen3_moe": "tp2ep2_etp1", "qwen2_moe": "tp2ep2_etp2"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_models")
    return {
        family: str(
            build_tiny_model(
                root / family,
                TinyModelSpec(
                    family=family,
                    hidden_size=64,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    seed=5,
                ),
            )
        )
        for family in FAMILIES
    }


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=4, seed=3)
    tensors[keys.ADVANTAGES] = torch.randn(tensors[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(4))
    return tensors


@pytest.fixture(scope="module")
def references(model_dirs, batch) -> dict[str, torch.Tensor]:
    return {family: hf_response_log_probs(path, batch)[0] for family, path in model_dirs.items()}


@pytest.fixture(scope="module")
def group(make_group, model_dirs):
    """group(layout name) -> an initialised MultiModelActorWorker group holding every family."""

    def build(name: str):
        world_size, layout = LAYOUTS[name]
        config = ActorConfig(
            strategy=None,
            loss=ActorLossConfig(clip_low=0.2),
        )
        built = make_group(MultiModelActorWorker, world_size, layout, role=f"moe_{name}", worker_config=config)
        if not getattr(built, "initialised", False):
            built.call(
                MultiModelActorWorker.init_models,
                {
                    **{
                        family: MegatronTrainConfig(
                            model_path=path, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-2)
                        )
                        for family, path in model_dirs.items()
                    },
                    REPLAYED: MegatronTrainConfig(
                        model_path=model_dirs["qwen3_moe"],
                        micro_batch_size=2,
                        optimizer=OptimizerSettings(lr=1e-2),
                        router_replay="R2",
                    ),
                    ADAPTED: MegatronTrainConfig(
                        model_path=model_dirs["qwen2_moe"],
                        micro_batch_size=2,
                        optimizer=OptimizerSettings(lr=1e-2),
                        lora=LORA,
                    ),
                },
            )
            built.initialised = True
        return built

    return build


def _log_probs(group, family: str, tensors) -> torch.Tensor:
    group.call(MultiModelActorWorker.use_model, family)
    return group.call(MultiModelActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch[
        keys.LOG_PROBS
    ]


def _train(group, family: str, tensors) -> dict:
    """One step on rows in input order: DP balancing off, so DP2's micro-batches are DP1's (see below)."""
    group.call(MultiModelActorWorker.use_model, family)
    return group.call(
        MultiModelActorWorker.train_step, DataProto.from_dict(tensors=tensors, meta_info={META_BALANCE_DP: False})
    )[0]


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_reference_routing_has_no_near_ties(model_dirs, batch, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(
            input_ids=batch[keys.INPUT_IDS],
            attention_mask=batch[keys.ATTENTION_MASK],
            position_ids=batch[keys.POSITION_IDS],
            output_router_logits=True,
        )
    real = batch[keys.ATTENTION_MASK].reshape(-1).bool()
    topk = model.config.num_experts_per_tok
    for layer_logits in out.router_logits:
        ordered = layer_logits[real].sort(dim=-1, descending=True).values
        assert float((ordered[:, topk - 1] - ordered[:, topk]).min()) > 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_match_transformers(group, references, batch, layout):
    built = group(layout)
    for family in FAMILIES:
        got = _log_probs(built, family, batch)
        assert max_masked_diff(got, references[family], batch[keys.RESPONSE_MASK]) < TOL, (layout, family)


def test_expert_groups_are_carved_out_of_data_parallel(group):
    """TP2 x EP2 with etp=1 on 4 ranks: experts split over each TP pair, expert-DP across the pairs."""
    ranks = group("tp2ep2_etp1").call(Worker.group_ranks)
    assert ranks[0]["tp"] == [0, 1] and ranks[0]["dp"] == [0, 2]
    assert ranks[0]["ep"] == [0, 1] and ranks[0]["etp"] == [0] and ranks[0]["edp"] == [0, 2]
    ranks = group("tp2ep2_etp2").call(Worker.group_ranks)
    assert ranks[0]["etp"] == [0, 1] and ranks[0]["ep"] == [0, 2] and ranks[0]["edp"] == [0]


def test_train_step_is_the_same_at_ep1_and_tp2ep2(group, batch, references, results):
    """Two steps each; 4 rows in micro-batches of 2 at DP1 and DP2 give the same micro-batches, so the aux loss
    (a per-micro-batch quantity) is comparable. The aux loss is in the gradient, so post-step log-probs check it."""
    tensors = dict(batch, **{keys.OLD_LOG_PROBS: references["qwen3_moe"]})
    for family, layout in TRAINED.items():
        tensors[keys.OLD_LOG_PROBS] = references[family]
        for step in range(2):
            single = _train(group("ep1"), family, tensors)
            parallel = _train(group(layout), family, tensors)
            for name in (
                "loss",
                "moe/aux_loss",
                "moe/load_balancing_loss",
                "moe/expert_load_min",
                "moe/expert_load_max",
                "moe/expert_load_imbalance",
            ):
                assert parallel[name] == pytest.approx(single[name], abs=TOL), (family, step, name)
            assert parallel["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4), (family, step)
            assert single["moe/aux_loss"] > 0 and single["moe/expert_load_max"] >= 1.0 >= single["moe/expert_load_min"]
        after_single = _log_probs(group("ep1"), family, batch)
        after_parallel = _log_probs(group(layout), family, batch)
        mask = batch[keys.RESPONSE_MASK]
        assert max_masked_diff(after_single, references[family], mask) > 1e-2, "training should move the log-probs"
        assert max_masked_diff(after_parallel, after_single, mask) < TOL, family
    results["trained"] = True


@pytest.fixture(scope="module")
def results() -> dict:
    return {}


def test_checkpoint_saved_at_one_ep_layout_loads_at_another(group, batch, references, results, tmp_path_factory):
    """Qwen3-MoE trained at TP2xEP2 (etp 1) -> loaded at EP1 and at PP2xEP2: same log-probs, and the next step
    (model + optimizer state restored) gives the same loss and weights at EP1 as at the saver's layout."""
    assert results.get("trained"), "runs after the training test"
    source = group(TRAINED["qwen3_moe"])
    path = str(tmp_path_factory.mktemp("moe_ckpt") / "step")
    source.call(MultiModelActorWorker.use_model, "qwen3_moe")
    source.call(MultiModelActorWorker.save_checkpoint, path)
    expected = _log_probs(source, "qwen3_moe", batch)
    mask = batch[keys.RESPONSE_MASK]
    for target in ("ep1", "pp2ep2"):
        group(target).call(MultiModelActorWorker.use_model, "qwen3_moe")
        group(target).call(MultiModelActorWorker.load_checkpoint, path)
        assert max_masked_diff(_log_probs(group(target), "qwen3_moe", batch), expected, mask) < TOL, target
    tensors = dict(batch, **{keys.OLD_LOG_PROBS: references["qwen3_moe"]})
    next_source, next_target = _train(source, "qwen3_moe", tensors), _train(group("ep1"), "qwen3_moe", tensors)
    assert next_target["loss"] == pytest.approx(next_source["loss"], abs=TOL)
    assert (
        max_masked_diff(_log_probs(group("ep1"), "qwen3_moe", batch), _log_probs(source, "qwen3_moe", batch), mask)
        < TOL
    )


def _safetensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


def test_hf_export_round_trips_bit_for_bit(group, model_dirs, batch, results, tmp_path):
    """Untrained Qwen2-MoE from PP2xEP2: HF -> Megatron -> HF gives the input tensors exactly. Trained Qwen3-MoE
    from TP2xEP2: transformers loads the export (fusing experts) and saves exactly the same tensors, and its
    log-probs are the actor's."""
    from transformers import AutoModelForCausalLM

    group("pp2ep2").call(MultiModelActorWorker.use_model, "qwen2_moe")
    group("pp2ep2").call(MultiModelActorWorker.export_hf, str(tmp_path / "qwen2_moe"))
    exported, original = _safetensors(tmp_path / "qwen2_moe"), _safetensors(model_dirs["qwen2_moe"])
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)

    assert results.get("trained"), "runs after the training test"
    source = group(TRAINED["qwen3_moe"])
    source.call(MultiModelActorWorker.use_model, "qwen3_moe")
    source.call(MultiModelActorWorker.export_hf, str(tmp_path / "qwen3_moe"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen3_moe"), dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "resaved"))
    exported, resaved = _safetensors(tmp_path / "qwen3_moe"), _safetensors(tmp_path / "resaved")
    assert sorted(exported) == sorted(resaved) and any(".mlp.experts.3." in name for name in exported)
    assert all(torch.equal(exported[name], resaved[name]) for name in exported)
    expected = _log_probs(source, "qwen3_moe", batch)
    got, _ = hf_response_log_probs(str(tmp_path / "qwen3_moe"), batch)
    assert max_masked_diff(got, expected, batch[keys.RESPONSE_MASK]) < TOL


def test_r2_replay_at_ep1_tp2ep2_and_pp2ep2(group, model_dirs, batch):
    """Routing replay R2 on experts split over EP ranks (and TP / PP): the old-log-prob forward records
    transformers' own top-k, the perturbed routers replay it exactly, and loss, grad norm and router gradients are
    EP1's (test_layouts_router_replay.py: TP, PP, CP, vpp, packing)."""
    tensors = dict(batch)
    meta = {META_BALANCE_DP: False}  # DP2's micro-batches are DP1's: the aux loss is a per-micro-batch objective
    runs = {}
    for name in ("ep1", "tp2ep2_etp1", "pp2ep2"):
        built = group(name)
        built.call(MultiModelActorWorker.use_model, REPLAYED)
        runs[name] = replay_step(built, tensors, perturbation=0.01, meta=meta)
    reference = runs["ep1"]
    assert same_routes(reference["recorded"], hf_routes(model_dirs["qwen3_moe"], tensors), tensors[keys.ATTENTION_MASK])
    assert reference["metrics"]["moe/route_agreement"] < 1.0
    for name, run in runs.items():
        assert same_routes(run["recorded"], reference["recorded"], tensors[keys.ATTENTION_MASK]), name
        assert run["metrics"]["moe/replay_mismatched_tokens"] == 0, name
        agreement = reference["metrics"]["moe/route_agreement"]  # (live choices may flip at a near-tie: a token)
        assert run["metrics"]["moe/route_agreement"] == pytest.approx(agreement, abs=0.05), name
        for key in ("loss", "moe/aux_loss", "grad_norm"):
            assert run["metrics"][key] == pytest.approx(reference["metrics"][key], abs=TOL), (name, key)
        for layer, grad in reference["router_grads"].items():
            assert torch.allclose(run["router_grads"][layer], grad, atol=TOL), (name, layer)


def test_lora_under_sequence_parallelism_and_expert_tp(group, model_dirs, batch, references, tmp_path):
    """Qwen2-MoE with adapters on attention, every routed expert and the shared expert, at TP2 x EP2 (MoE turns on
    sequence parallelism at tp > 1) with etp 1 and 2: the untrained forward is transformers' base; two steps give
    EP1's loss, aux loss and grad norm, the same merged weights and log-probs; only adapters train and the base stays
    bit-identical; etp 2's checkpoint after its first step (adapters split over expert TP) resumes at EP1 and etp 1
    into the same second step; transformers on etp 2's merged export gives the trained log-probs."""
    tensors = dict(batch, **{keys.OLD_LOG_PROBS: references["qwen2_moe"]})
    mask = batch[keys.RESPONSE_MASK]
    checkpoint = str(tmp_path / "lora_etp2_step1")
    runs = {}
    for name in ("ep1", "tp2ep2_etp1", "tp2ep2_etp2"):
        built = group(name)
        built.call(MultiModelActorWorker.use_model, ADAPTED)
        base = built.call(MultiModelActorWorker.base_weights)
        before = _log_probs(built, ADAPTED, batch)
        steps = [_train(built, ADAPTED, tensors)]
        if name == "tp2ep2_etp2":
            built.call(MultiModelActorWorker.save_checkpoint, checkpoint)
        steps.append(_train(built, ADAPTED, tensors))
        runs[name] = {
            "before": before,
            "steps": steps,
            "after": _log_probs(built, ADAPTED, batch),
            "merged": built.call(MultiModelActorWorker.merged_hf_weights)[0],
            "base_unchanged": all(
                torch.equal(a[n], b[n]) for a, b in zip(base, built.call(MultiModelActorWorker.base_weights)) for n in a
            ),
            "trained": {n for names in built.call(MultiModelActorWorker.optimizer_parameter_names) for n in names},
        }
    reference = runs["ep1"]
    assert max_masked_diff(reference["after"], references["qwen2_moe"], mask) > 1e-2  # the adapters learned
    for name, run in runs.items():
        assert max_masked_diff(run["before"], references["qwen2_moe"], mask) < TOL, name  # B = 0: the base
        assert run["base_unchanged"], name
        assert all(".lora." in n for n in run["trained"]), name
        assert any(".local_experts." in n for n in run["trained"]), name
        assert any(".shared_experts." in n for n in run["trained"]), name
        for step, (got, want) in enumerate(zip(run["steps"], reference["steps"])):
            for key in ("loss", "pg_loss", "moe/aux_loss"):
                assert got[key] == pytest.approx(want[key], abs=TOL), (name, step, key)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (name, step)
        assert max_masked_diff(run["after"], reference["after"], mask) < TOL, name
        assert sorted(run["merged"]) == sorted(reference["merged"]), name
        for weight, tensor in reference["merged"].items():
            assert torch.allclose(run["merged"][weight], tensor, atol=TOL), (name, weight)
    for name in ("ep1", "tp2ep2_etp1"):
        group(name).call(MultiModelActorWorker.load_checkpoint, checkpoint)
        resumed = _train(group(name), ADAPTED, tensors)
        for key in ("loss", "grad_norm"):
            assert resumed[key] == pytest.approx(runs["tp2ep2_etp2"]["steps"][1][key], rel=1e-4, abs=TOL), (name, key)
        assert max_masked_diff(_log_probs(group(name), ADAPTED, batch), reference["after"], mask) < TOL, name
    merged_dir = tmp_path / "lora_merged"
    group("tp2ep2_etp2").call(MultiModelActorWorker.export_hf, str(merged_dir))
    merged, _ = hf_response_log_probs(str(merged_dir), batch)
    assert max_masked_diff(merged, reference["after"], mask) < TOL
