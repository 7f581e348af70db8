"""LoRA on the Megatron train strategy (issue #34, first part) on the shared layout groups: a 4-layer Qwen2 with
adapters on every projection (rank 4) takes two steps at TP1, TP2, PP2, TP2 x PP2, CP2, PP2 x vpp2 and DP2 from the
same start:

- before the first step the model is the base (B starts at 0): transformers' log-probs;
- the steps' loss and grad norm, and the merged weights after them (the base plus (alpha / r) B A, what the weight
  sync and the HF export send), equal TP1's; the optimizer holds the adapters only and the base is bit-identical;
- transformers on the merged weights gives the trained model's log-probs, and the forward with the adapters off
  (keys.META_BASE_MODEL, the reference without a second model) gives the base's;
- the first layout's checkpoint after the first step holds only the adapters and their optimizer state; every
  layout resumes from it and repeats the second step (exactly at the saving layout);
- the adapters exported as a PEFT folder (from TP2 x PP2) give the trained log-probs on transformers' base.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron_batches import hf_response_log_probs, max_masked_diff, model_response_log_probs, rl_batch_of_lengths
from peft import PeftModel
from reconfigurable_workers import ReconfigurableActor
from transformers import AutoModelForCausalLM

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import LoRASettings, MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig
from roll_backend.workers.critic import CriticConfig

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


def dense_sizes(model_dir: str) -> tuple[int, int]:
    """(adapter parameters of LORA on every projection, the base's parameters) of a dense model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    hf = model.config
    kv = hf.num_key_value_heads * hf.hidden_size // hf.num_attention_heads
    widths = 4 * hf.hidden_size + 2 * (hf.hidden_size + kv) + 3 * (hf.hidden_size + hf.intermediate_size)
    # q, o; k, v; gate, up, down: rank x (in + out) each
    return hf.num_hidden_layers * LORA.rank * widths, sum(p.numel() for p in model.parameters())


def lora_run(group, model_dir: str, tensors: dict, checkpoint: str, peft_start: bool = True, micro: int = 2) -> dict:
    """Two steps; the first layout saves a checkpoint after the first, and every layout resumes from it at the end
    and takes the second step again. `peft_start`: the first layout also exports its starting adapters for PEFT."""
    config = ActorConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=micro, optimizer=OptimizerSettings(lr=1e-2), lora=LORA
        ),
        loss=ActorLossConfig(clip_low=0.2),
    )
    group.call(ReconfigurableActor.init_model_with, config)
    base_before = group.call(ReconfigurableActor.base_weights)
    before = group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch
    batch = DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: before[keys.LOG_PROBS]})
    first = not Path(checkpoint).exists()
    if first and peft_start:  # the starting adapters as a PEFT folder, for the gradient reference
        group.call(ReconfigurableActor.export_peft, f"{checkpoint}_start_adapter")
    steps = [next(m for m in group.call(ReconfigurableActor.train_step, batch) if m)]
    first_grads = group.call(ReconfigurableActor.param_grad_norms)[0] if first else None
    if first:
        group.call(ReconfigurableActor.save_checkpoint, checkpoint)
    steps.append(next(m for m in group.call(ReconfigurableActor.train_step, batch) if m))
    base_model = DataProto.from_dict(tensors=tensors, meta_info={keys.META_BASE_MODEL: True})
    outcome = {
        "first_grads": first_grads,
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
        "counts": group.call(ReconfigurableActor.parameter_counts)[0],
    }
    group.call(ReconfigurableActor.load_checkpoint, checkpoint)
    outcome["resumed_step"] = next(m for m in group.call(ReconfigurableActor.train_step, batch) if m)
    outcome["resumed"] = group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch
    return outcome


def test_lora_steps_are_the_same_at_every_layout(layout_actors, model_dir, tensors, tmp_path):
    mask = tensors[keys.RESPONSE_MASK]
    base, _ = hf_response_log_probs(model_dir, tensors)
    adapters, base_size = dense_sizes(model_dir)
    checkpoint = str(tmp_path / "tp1_step1")
    runs = {name: lora_run(group, model_dir, tensors, checkpoint) for name, group in layout_actors.items()}
    reference = runs["tp1"]
    # The first step's adapter gradients are PEFT's on transformers from the same start (B's, module by module, as
    # shares of the gradient norm, which clipping leaves alone; A's are 0 while B is).
    want = peft_gradient_norms(model_dir, f"{checkpoint}_start_adapter", tensors, reference["before"])
    got = {name: norm for name, norm in reference["first_grads"].items() if ".lora." in name}
    assert len(got) == 2 * len(want) and all(got[name] == 0.0 for name in got if name.endswith(".A")), got
    total_got, total_want = (sum(v * v for v in norms.values()) ** 0.5 for norms in (got, want))
    for (layer, module), norm in want.items():
        (name,) = [n for n in got if f"layers.{layer}." in n and n.endswith(f".parts.{module}.B")]
        assert got[name] / total_got == pytest.approx(norm / total_want, rel=1e-4), name
    # The checkpoint holds the adapters and their optimizer state, not the frozen base.
    saved = dist_checkpointing.load_tensors_metadata(checkpoint)
    assert saved and all(key.endswith((".lora_A", ".lora_B")) for key in saved), sorted(saved)
    weights = [key for key in saved if key.startswith("model.")]
    assert len(weights) == 4 * 7 * 2 and len(saved) == 3 * len(weights), sorted(saved)  # + Adam's two moments
    # Resuming from it repeats the second step exactly at its layout, and to TOL at every other.
    for key in ("loss", "pg_loss", "grad_norm"):
        assert reference["resumed_step"][key] == reference["steps"][1][key], key
    assert torch.equal(reference["resumed"][keys.LOG_PROBS], reference["after"][keys.LOG_PROBS])
    for name, run in runs.items():
        assert max_masked_diff(run["before"], base, mask) < TOL, name  # B = 0: the base model
        assert run["base_unchanged"], name
        assert run["counts"] == {"parameters": base_size + adapters, "trainable_parameters": adapters}, name
        for key in ("loss", "pg_loss", "grad_norm"):
            assert run["resumed_step"][key] == pytest.approx(reference["steps"][1][key], abs=TOL), (name, key)
        assert max_masked_diff(run["resumed"][keys.LOG_PROBS], reference["after"][keys.LOG_PROBS], mask) < TOL
        assert all(".lora." in param for names in run["trained"] for param in names) and any(run["trained"]), name
        for step, (got, want) in enumerate(zip(run["steps"], reference["steps"])):
            for key in ("loss", "pg_loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], abs=TOL), (name, step, key)
        assert sorted(run["merged"]) == sorted(reference["merged"])
        for weight, tensor in reference["merged"].items():
            assert torch.allclose(run["merged"][weight], tensor, atol=TOL), (name, weight)
        assert max_masked_diff(run["after"][keys.LOG_PROBS], reference["after"][keys.LOG_PROBS], mask) < TOL, name
        assert max_masked_diff(run["base_model"], base, mask) < TOL, name  # adapters off: the reference
        assert max_masked_diff(run["base_model"], run["before"], mask) < 1e-6, name  # = the untrained forward
    moved = max_masked_diff(reference["after"][keys.LOG_PROBS], base, mask)
    assert moved > 1e-2, moved  # the adapters learned something
    # The merged weights are a Hugging Face model with the trained log-probs.
    merged_dir = tmp_path / "merged"
    layout_actors["tp1"].call(ReconfigurableActor.export_hf, str(merged_dir))
    merged, _ = hf_response_log_probs(str(merged_dir), tensors)
    assert max_masked_diff(merged, reference["after"][keys.LOG_PROBS], mask) < TOL
    # The adapters as a PEFT folder, gathered over TP and PP: peft puts them on transformers' base, with the trained
    # log-probs (the last resumed step repeated the second, so every layout holds the same adapters).
    adapter_dir = tmp_path / "adapter"
    written = layout_actors["tp2pp2"].call(ReconfigurableActor.export_peft, str(adapter_dir))[0]
    assert len(written) == 4 * 7 * 2, written
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir)
    adapted, _ = model_response_log_probs(model.eval(), tensors)
    assert max_masked_diff(adapted, reference["after"][keys.LOG_PROBS], mask) < TOL


CRITIC_LAYOUTS = ("tp1", "tp2pp2", "cp2")


def test_a_lora_critic_trains_its_adapters_and_value_head_alike_at_every_layout(
    layout_actors, model_dir, tensors, tmp_path
):
    """A critic with LoRA: the adapters and the value head (new, so it trains, as PEFT's modules_to_save) and nothing
    else; two value steps at TP1, TP2 x PP2 and CP2 agree; TP1's checkpoint after the first holds the adapters and
    the head, and TP2 x PP2 resumed from it repeats the second."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir).config
    adapters, base_size = dense_sizes(model_dir)
    checkpoint = str(tmp_path / "critic_tp1_step1")
    config = CriticConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, value_head=True, optimizer=OptimizerSettings(lr=1e-2), lora=LORA
        )
    )
    batch = DataProto.from_dict(tensors=tensors)
    runs = {}
    for name in CRITIC_LAYOUTS:
        group = layout_actors[name]
        group.call(ReconfigurableActor.init_model_with, config)
        frozen = group.call(ReconfigurableActor.base_weights)
        values = group.call(ReconfigurableActor.compute_values, batch).batch[keys.VALUES]
        targets = DataProto.from_dict(tensors={**tensors, keys.VALUES: values, keys.RETURNS: torch.ones_like(values)})
        steps = [group.call(ReconfigurableActor.critic_train_step, targets)[0]]
        if name == "tp1":
            group.call(ReconfigurableActor.save_checkpoint, checkpoint)
        steps.append(group.call(ReconfigurableActor.critic_train_step, targets)[0])
        runs[name] = {
            "values": values,
            "steps": steps,
            "after": group.call(ReconfigurableActor.compute_values, batch).batch[keys.VALUES],
            "frozen_unchanged": all(
                torch.equal(a[n], b[n]) for a, b in zip(frozen, group.call(ReconfigurableActor.base_weights)) for n in a
            ),
            "trained": {
                n.removeprefix("module.")
                for ns in group.call(ReconfigurableActor.optimizer_parameter_names)
                for n in ns
            },
            "counts": group.call(ReconfigurableActor.parameter_counts)[0],
        }
        if name == "tp2pp2":
            group.call(ReconfigurableActor.load_checkpoint, checkpoint)
            runs[name]["resumed_step"] = group.call(ReconfigurableActor.critic_train_step, targets)[0]
    mask = tensors[keys.RESPONSE_MASK]
    reference = runs["tp1"]
    assert max_masked_diff(reference["after"], reference["values"], mask) > 1e-3  # the steps moved the values
    head = {"output_layer.weight", "output_layer.bias"}
    for name, run in runs.items():
        assert run["frozen_unchanged"], name
        assert head <= set(run["trained"]) and all(".lora." in n or n in head for n in run["trained"]), name
        assert max_masked_diff(run["values"], reference["values"], mask) < TOL, name
        assert max_masked_diff(run["after"], reference["after"], mask) < TOL, name
        for got, want in zip(run["steps"], reference["steps"]):
            for key in ("vf_loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], abs=TOL), (name, key)
        # The value head (hidden -> 1, with a bias) stands in for the LM head and trains beside the adapters.
        value_head, lm_head = hf.hidden_size + 1, hf.vocab_size * hf.hidden_size
        want = {
            "parameters": base_size - lm_head + value_head + adapters,
            "trainable_parameters": adapters + value_head,
        }
        assert run["counts"] == want, (name, run["counts"])
    saved = dist_checkpointing.load_tensors_metadata(checkpoint)
    weights = sorted(key for key in saved if not key.startswith("optimizer."))
    head_keys = ["value_head.bias", "value_head.weight"]
    assert weights == sorted([*(k for k in weights if k.endswith((".lora_A", ".lora_B"))), *head_keys]), weights
    assert len(weights) == 4 * 7 * 2 + 2 and len(saved) == 3 * len(weights), sorted(saved)  # + Adam's moments
    for key in ("vf_loss", "grad_norm"):
        assert runs["tp2pp2"]["resumed_step"][key] == pytest.approx(reference["steps"][1][key], abs=TOL), key


MOE_LAYOUTS = ("tp1", "ep2", "pp2")


def test_lora_on_a_moe_model_adapts_attention_and_every_expert_alike_at_ep2_and_pp2(layout_actors, tensors, tmp_path):
    """Qwen2-MoE (routed experts and a gated shared expert) with adapters on attention, every routed expert and the
    shared expert: at EP2 each rank holds its experts' adapters; two steps at TP1, EP2 and PP2 agree, the merged
    weights are a transformers model with the trained log-probs, and EP2 and PP2 resume from TP1's checkpoint."""
    spec = TinyModelSpec(
        family="qwen2_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, seed=5
    )
    model_dir = str(build_tiny_model(tmp_path / "qwen2_moe", spec))
    hf = AutoModelForCausalLM.from_pretrained(model_dir).config
    checkpoint = str(tmp_path / "moe_tp1_step1")
    # The load-balancing loss (whose gradient reaches the adapters below each router) is a statistic of the
    # micro-batch: 4 rows in micro-batches of 2 are the same two micro-batches at TP1, PP2 and EP2 (one per DP rank).
    tensors = {key: value[:4] for key, value in tensors.items()}
    runs = {name: lora_run(layout_actors[name], model_dir, tensors, checkpoint, False) for name in MOE_LAYOUTS}
    mask = tensors[keys.RESPONSE_MASK]
    reference = runs["tp1"]
    base, _ = hf_response_log_probs(model_dir, tensors)
    kv = hf.num_key_value_heads * hf.hidden_size // hf.num_attention_heads
    attention = 2 * (2 * hf.hidden_size) + 2 * (hf.hidden_size + kv)  # q, o; k, v: in + out each
    experts = hf.num_experts * 3 * (hf.hidden_size + hf.moe_intermediate_size)  # gate, up, down
    shared = 3 * (hf.hidden_size + hf.shared_expert_intermediate_size)
    adapters = hf.num_hidden_layers * LORA.rank * (attention + experts + shared)
    saved = dist_checkpointing.load_tensors_metadata(checkpoint)
    weights = [key for key in saved if "optimizer." not in key]  # (MoE: chained dense and expert optimizers)
    assert len(weights) == hf.num_hidden_layers * 2 * (4 + 3 * hf.num_experts + 3), sorted(weights)
    assert f"model.layers.1.mlp.experts.{hf.num_experts - 1}.down_proj.lora_B" in weights
    assert "model.layers.0.mlp.shared_expert.gate_proj.lora_A" in weights
    for name, run in runs.items():
        assert max_masked_diff(run["before"], base, mask) < TOL, name  # B = 0: the base model
        assert run["base_unchanged"], name
        assert run["counts"]["trainable_parameters"] == adapters, (name, run["counts"])
        trained = {n for names in run["trained"] for n in names}
        assert all(".lora." in n for n in trained), name
        assert any(".local_experts." in n for n in trained) and any(".shared_experts." in n for n in trained), name
        for step, (got, want) in enumerate(zip(run["steps"], reference["steps"])):
            for key in ("loss", "pg_loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], abs=TOL), (name, step, key)
        for key in ("loss", "pg_loss", "grad_norm"):
            assert run["resumed_step"][key] == pytest.approx(reference["steps"][1][key], abs=TOL), (name, key)
        assert sorted(run["merged"]) == sorted(reference["merged"])
        for weight, tensor in reference["merged"].items():
            assert torch.allclose(run["merged"][weight], tensor, atol=TOL), (name, weight)
        assert max_masked_diff(run["after"][keys.LOG_PROBS], reference["after"][keys.LOG_PROBS], mask) < TOL, name
        assert max_masked_diff(run["base_model"], base, mask) < TOL, name  # adapters off: the reference
    expert_grads = [norm for n, norm in reference["first_grads"].items() if "experts." in n and n.endswith(".B")]
    assert len(expert_grads) == hf.num_hidden_layers * 3 * (hf.num_experts + 1) and min(expert_grads) > 0, expert_grads
    assert max_masked_diff(reference["after"][keys.LOG_PROBS], base, mask) > 1e-2  # the adapters learned something
    merged_dir = tmp_path / "moe_merged"
    layout_actors["ep2"].call(ReconfigurableActor.export_hf, str(merged_dir))
    merged, _ = hf_response_log_probs(str(merged_dir), tensors)
    assert max_masked_diff(merged, reference["after"][keys.LOG_PROBS], mask) < TOL


def peft_gradient_norms(model_dir: str, adapter_dir: str, tensors: dict, old_log_probs) -> dict:
    """{(layer, module): |gradient of lora_B|} of the PPO loss at ratio 1 (token mean of -advantage x log-prob) with
    peft's adapters (`adapter_dir`) on transformers' base."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir, is_trainable=True)
    log_probs, _ = model_response_log_probs(model, tensors)
    mask = tensors[keys.RESPONSE_MASK].float()
    (-(tensors[keys.ADVANTAGES] * log_probs * mask).sum() / mask.sum()).backward()
    norms = {}
    for name, param in model.named_parameters():
        if "lora_B" in name:
            layer, _, module = name.split("layers.")[1].split(".lora_B")[0].split(".")
            norms[(int(layer), module)] = float(param.grad.norm())
    return norms


COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def test_lora_dropout_acts_on_training_steps_alike_at_tp1_and_tp2(layout_actors, model_dir, tensors, tmp_path):
    """Adapter dropout (PEFT's, on the branch's input) on the column-parallel modules, whose input every TP rank
    holds whole, so the mask comes from the generator all ranks share: TP2 takes TP1's two steps exactly. Against the
    same adapters without dropout: the first step's loss is the same (B = 0, the branch adds nothing) and its gradient
    is not; the second step's loss differs. The forward outside training has none: it repeats itself, and
    transformers on the merged weights gives it."""
    mask = tensors[keys.RESPONSE_MASK]
    runs = {}
    for dropout in (0.0, 0.3):
        settings = LoRASettings(rank=4, alpha=8.0, dropout=dropout, target_modules=COLUMN_MODULES)
        config = ActorConfig(
            strategy=MegatronTrainConfig(
                model_path=model_dir, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-2), lora=settings
            ),
            loss=ActorLossConfig(clip_low=0.2),
        )
        for name in ("tp1", "tp2") if dropout else ("tp1",):
            group = layout_actors[name]
            group.call(ReconfigurableActor.init_model_with, config)
            before = group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch
            batch = DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: before[keys.LOG_PROBS]})
            steps = [next(m for m in group.call(ReconfigurableActor.train_step, batch) if m) for _ in range(2)]
            after = [
                group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch
                for _ in range(2)
            ]
            runs[name, dropout] = {"steps": steps, "after": after[0][keys.LOG_PROBS]}
            assert torch.equal(after[0][keys.LOG_PROBS], after[1][keys.LOG_PROBS]), name  # no dropout outside steps
    plain, dropped = runs["tp1", 0.0], runs["tp1", 0.3]
    assert dropped["steps"][0]["loss"] == pytest.approx(plain["steps"][0]["loss"], abs=1e-6)
    assert (
        abs(dropped["steps"][0]["grad_norm"] - plain["steps"][0]["grad_norm"]) > 1e-3 * plain["steps"][0]["grad_norm"]
    )
    assert abs(dropped["steps"][1]["loss"] - plain["steps"][1]["loss"]) > 1e-5
    for got, want in zip(runs["tp2", 0.3]["steps"], dropped["steps"]):
        for key in ("loss", "pg_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=TOL), key
    assert max_masked_diff(runs["tp2", 0.3]["after"], dropped["after"], mask) < TOL
    merged_dir = tmp_path / "dropout_merged"
    layout_actors["tp2"].call(ReconfigurableActor.export_hf, str(merged_dir))
    merged, _ = hf_response_log_probs(str(merged_dir), tensors)
    assert max_masked_diff(merged, runs["tp2", 0.3]["after"], mask) < TOL
