"""The rest of RLHF from YAML on real groups (Megatron actor, reference and reward model; vLLM rollout; Ray):
- a reward model trained from configs/reward_model_cpu.yaml on the copy task's preferences (the right digit over
  any other) reaches >= 0.9 held-out accuracy from chance, and its export loads as transformers'
  *ForSequenceClassification that orders the held-out pairs as well;
- PPO from configs/ppo_reward_model_cpu.yaml, rewarded by that model alone, raises its reward/mean;
- DPO from configs/dpo_cpu.yaml on the same preferences raises the policy's chosen-over-rejected log-prob margin on
  held-out pairs;
- SFT from configs/sft_cpu.yaml lowers the held-out NLL, and a run resumed from its step-4 checkpoint repeats the
  uninterrupted run's later steps exactly;
- on-policy distillation from configs/grpo_distill_cpu.yaml, with the SFT run's export as the teacher and no reward,
  lowers the student's reverse KL to it.
The per-objective numbers (losses against TRL, layout independence) are in tests/roll_backend/algorithms/
test_preference.py and tests/strategies/megatron/test_layouts_offline.py."""

from __future__ import annotations

import pytest
import torch

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline

QUIET = ("logging.progress_bar=false", "perf.measure_peak=false")


def _run(config_path: str, output_dir, *overrides: str) -> list[dict]:
    return run_pipeline(load_config(config_path, [f"output_dir={output_dir}", *QUIET, *overrides]))


def _mean(history: list[dict], key: str, steps) -> float:
    return sum(row[key] for row in history if row["step"] in steps) / len(steps)


@pytest.fixture(scope="module")
def reward_model_run(ray_session, tmp_path_factory):
    output = tmp_path_factory.mktemp("reward_model")
    return output, _run("configs/reward_model_cpu.yaml", output)


def test_reward_model_learns_the_preferences_and_exports_a_classifier(reward_model_run):
    output, history = reward_model_run
    first, last = history[0], history[-1]
    assert first["step"] == 0 and last["step"] == 150
    assert first["val/reward_model/accuracy"] < 0.7  # chance on held-out pairs before training
    assert last["val/reward_model/accuracy"] >= 0.9, [r.get("val/reward_model/accuracy") for r in history]
    assert last["val/reward_model/loss"] < 0.3 < first["val/reward_model/loss"]
    # The export is a transformers reward model that orders the held-out pairs as well.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from roll_backend.pipelines.data.synthetic_tasks import generate_task

    export = output / "reward_model_hf"
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)

    def score(prompt: str, response: str) -> float:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ids += tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, 0])

    pairs = generate_task("copy_digit_pairs", 64, 1)  # configs/reward_model_cpu.yaml's data.val_synthetic
    correct = [score(row["prompt"], row["answer"]) > score(row["prompt"], row["rejected"]) for row in pairs]
    assert sum(correct) / len(pairs) >= 0.85  # (exact score parity of the export: tests/strategies/megatron)


def test_ppo_with_the_trained_reward_model_raises_its_reward(reward_model_run, tmp_path):
    output, _ = reward_model_run
    history = _run(
        "configs/ppo_reward_model_cpu.yaml",
        tmp_path / "ppo",
        f"reward_model.model_path={output / 'reward_model_hf'}",
        "max_steps=12",
        "actor_infer.hybrid=true",  # the engine and the critic in the actor's process (the same numbers, two
        "critic.hybrid=true",  # processes fewer to start)
    )
    assert [row["step"] for row in history] == list(range(1, 13))
    # no rule reward: the reward is the model's score, reported raw and as the step's reward
    assert all(row["reward/mean"] == pytest.approx(row["reward_model/raw_mean"], abs=1e-5) for row in history)
    early, late = _mean(history, "reward/mean", (1, 2, 3)), _mean(history, "reward/mean", (10, 11, 12))
    assert late > early + 2.0, [round(row["reward/mean"], 2) for row in history]


def test_dpo_raises_the_held_out_preference_margin(ray_session, tmp_path):
    history = _run("configs/dpo_cpu.yaml", tmp_path / "dpo", "max_steps=30", "eval.every_steps=0")
    before, after = history[0], history[-1]
    assert before["step"] == 0 and after["step"] == 30
    assert before["val/dpo/margin"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert after["val/dpo/logp_margin"] > before["val/dpo/logp_margin"] + 1.0
    assert after["val/dpo/accuracy"] >= 0.9
    assert after["val/dpo/loss"] < before["val/dpo/loss"]
    assert all(row["dpo/chosen_logps"] <= 0 and row["dpo/rejected_logps"] <= 0 for row in history[1:])


@pytest.fixture(scope="module")
def sft_runs(ray_session, tmp_path_factory):
    """An 8-step SFT run checkpointing at step 4 and exporting at the end, and a run resumed from that checkpoint."""
    root = tmp_path_factory.mktemp("sft")
    settings = (
        "max_steps=8",
        "checkpoint.save_steps=4",
        "eval.every_steps=4",
        "actor_train.strategy.optimizer.lr=1e-2",
    )
    full = _run("configs/sft_cpu.yaml", root / "full", *settings)
    resumed = _run(
        "configs/sft_cpu.yaml",
        root / "resumed",
        *settings,
        "checkpoint.export_hf_dir=null",
        f"checkpoint.resume={root / 'full' / 'checkpoints' / 'step_4'}",
        f"model_path={root / 'full' / 'tiny_model'}",
    )
    return root, full, resumed


def test_sft_lowers_the_held_out_nll_and_resumes_exactly(sft_runs):
    _, full, resumed = sft_runs
    assert full[-1]["val/sft/nll"] < full[0]["val/sft/nll"] - 1.0
    assert [row["step"] for row in resumed] == [5, 6, 7, 8]
    for got, expected in zip(resumed, full[-4:]):
        for key in ("actor/loss", "actor/grad_norm", "val/sft/nll"):
            if key in expected:
                assert got[key] == expected[key], (key, got["step"])


def test_on_policy_distillation_from_the_sft_teacher(sft_runs, tmp_path):
    """GRPO with no reward but the reverse KL to a teacher (the SFT run's export) as a dense reward: the student's
    reverse KL to the teacher falls (8 SFT steps teach the answer format, not yet the copy: the copy accuracy
    follows with a teacher that copies, as configs/sft_cpu.yaml's 40 steps give)."""
    root, _, _ = sft_runs
    history = _run(
        "configs/grpo_distill_cpu.yaml",
        tmp_path / "distill",
        f"teacher.model_path={root / 'full' / 'sft_hf'}",
        "max_steps=12",
        "actor_infer.hybrid=true",  # the engine in the actor's process (the same numbers, one process fewer to start)
    )
    early, late = (1, 2, 3), (10, 11, 12)
    assert all(row["reward/score_mean"] == 0.0 for row in history)  # nothing but the teacher trains it
    assert all(row["timing/teacher"] > 0 for row in history)
    kl = [round(row["distill/reverse_kl"], 3) for row in history]
    assert _mean(history, "distill/reverse_kl", late) < 0.85 * _mean(history, "distill/reverse_kl", early), kl
