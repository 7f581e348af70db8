"""GRPO through the pipeline with the actor (Megatron train) and the reference (Megatron infer) at CP2: the demo's
prompts are 25 tokens with the chat template, so each of a sequence's 4 CP chunks holds 8 tokens."""

from __future__ import annotations

import math
from pathlib import Path

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml"


def test_grpo_with_actor_and_reference_at_cp2(ray_session, tmp_path):
    config = load_config(
        CONFIG,
        [
            f"output_dir={tmp_path}/run",
            "max_steps=2",
            "rollout_batch_size=4",
            "num_return_sequences_in_group=4",
            "response_length=4",
            "algorithm.ppo_mini_batch_size=16",
            "data.synthetic.num_prompts=16",
            "actor_train.strategy.tp=1",
            "actor_train.strategy.cp=2",
            "actor_train.world_size=2",
            "actor_train.strategy.micro_batch_size=8",
            "reference.strategy.cp=2",
            "reference.world_size=2",
            "logging.progress_bar=false",
            "perf.measure_peak=false",
        ],
    )
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl", "weight_sync/logprob_gap"):
            assert math.isfinite(record[key]), (key, record)
        # vLLM scores the synced weights like the CP2 actor does: the actor's CP log-probs are the model's.
        assert record["weight_sync/logprob_gap"] < 1e-4
    # Step 1: the reference (CP2, Megatron infer) holds the actor's initial weights, so the KL starts at ~0.
    assert abs(history[0]["actor/reference_kl"]) < 1e-5
