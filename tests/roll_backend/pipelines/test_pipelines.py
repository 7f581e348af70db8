"""GRPO and PPO end to end on real groups (Megatron actor, vLLM rollout, Megatron reference/critic, rule reward),
and resume: a run resumed from a checkpoint repeats the uninterrupted run's next step exactly."""

from __future__ import annotations

import json
import math

import pytest

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline
from roll_backend.pipelines.checkpoint import latest_checkpoint

PROMPTS = [{"prompt": f"copy: {d}", "answer": str(d)} for d in range(10)]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", TinyModelSpec(hidden_size=128, intermediate_size=256, seed=3))  # vLLM CPU attention needs head_dim >= 32


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    """The demo config with an exact-match reward (dict overrides merge into, not replace, the demo's rewards)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.load("configs/grpo_tiny_cpu.yaml")
    tree.reward.rewards = {"exact_match": 1.0}
    path = tmp_path_factory.mktemp("config") / "pipeline.yaml"
    OmegaConf.save(tree, path)
    return path


def overrides(prompt_file, model_dir, output_dir, *extra: str) -> list[str]:
    return [
        f"output_dir={output_dir}", f"model_path={model_dir}", "build_tiny_model=null",
        f"data.train_path={prompt_file}", "data.synthetic=null",
        "rollout_batch_size=4", "num_return_sequences_in_group=4", "response_length=6",
        "algorithm.ppo_mini_batch_size=8", "actor_train.strategy.micro_batch_size=4",
        "reference.strategy.micro_batch_size=8", "logging.progress_bar=false", *extra,
    ]


STEP_KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl", "response_length/mean")


def test_grpo_run_and_resume_repeats_the_next_step_exactly(ray_session, base_config, prompt_file, model_dir, tmp_path):
    full = load_config(base_config, overrides(
        prompt_file, model_dir, tmp_path / "full", "max_steps=3", "checkpoint.save_steps=2",
        "algorithm.ppo_mini_batch_size=16"))  # one mini-batch, one epoch: on-policy, no old-log-prob pass
    history = run_pipeline(full)
    assert [h["step"] for h in history] == [1, 2, 3]
    for record in history:
        for key in (*STEP_KEYS, "timing/generate", "timing/train", "timing/weight_sync", "weight_sync/logprob_gap",
                    "throughput/generated_tokens_per_s", "actor/broadcast_seconds"):
            assert math.isfinite(record[key]), (key, record)
        assert record["weight_sync/logprob_gap"] < 1e-4
        assert "timing/log_probs" not in record  # on-policy: the loss used the current log-probs, detached
    checkpoint = latest_checkpoint(tmp_path / "full")
    assert checkpoint is not None and checkpoint.name == "step_2"
    assert (tmp_path / "full" / "metrics.jsonl").read_text().count("\n") == 3
    assert any((tmp_path / "full" / "tensorboard").iterdir())

    resumed = load_config(base_config, overrides(
        prompt_file, model_dir, tmp_path / "resumed", "max_steps=3", f"checkpoint.resume={checkpoint}",
        "algorithm.ppo_mini_batch_size=16"))
    resumed_history = run_pipeline(resumed)
    assert [h["step"] for h in resumed_history] == [3]
    for key in STEP_KEYS:
        assert resumed_history[0][key] == pytest.approx(history[2][key], rel=1e-6, abs=1e-7), key


def test_ppo_run_with_critic_and_gae(ray_session, base_config, prompt_file, model_dir, tmp_path):
    critic = ("critic={model_path: " + str(model_dir) + ", world_size: 1, strategy: {name: megatron_train, "
              "micro_batch_size: 4, optimizer: {lr: 1.0e-3}}}")
    config = load_config(base_config, overrides(
        prompt_file, model_dir, tmp_path / "ppo", "pipeline=ppo", "algorithm.adv_estimator=gae", critic,
        "max_steps=2", "actor_train.world_size=1", "actor_train.strategy.tp=1", "algorithm.ppo_epochs=2",
        "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"))
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        for key in ("critic/loss", "actor/pg_loss", "actor/kl_coef", "timing/values", "timing/critic_train", "timing/log_probs"):
            assert math.isfinite(record[key]), (key, record)
    assert history[1]["actor/kl_coef"] != history[0]["actor/kl_coef"]  # the adaptive controller moved


def test_grpo_in_bf16_mixed_precision(ray_session, base_config, prompt_file, model_dir, tmp_path):
    """Megatron actor and reference in bf16 (fp32 main weights in the optimizer) and vLLM in bf16: the weights
    the engine receives score like the trainer's to within bf16 rounding, well inside the 16-bit probe limit."""
    from roll_backend.config.schema import HALF_PRECISION_LOGPROB_GAP

    config = load_config(base_config, overrides(
        prompt_file, model_dir, tmp_path / "bf16", "max_steps=2", "algorithm.ppo_mini_batch_size=16",
        "actor_train.strategy.params_dtype=bfloat16", "reference.strategy.params_dtype=bfloat16",
        "actor_infer.strategy.dtype=bfloat16"))
    assert config.logprob_gap_limit() == HALF_PRECISION_LOGPROB_GAP
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        for key in (*STEP_KEYS, "weight_sync/logprob_gap"):
            assert math.isfinite(record[key]), (key, record)
        assert 0 < record["weight_sync/logprob_gap"] < HALF_PRECISION_LOGPROB_GAP / 3
    assert abs(history[0]["actor/reference_kl"]) < 0.05  # step 1: bf16 rollout and bf16 reference hold the same weights
