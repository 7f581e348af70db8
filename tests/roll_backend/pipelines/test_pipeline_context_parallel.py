"""GRPO through the pipeline with the actor (Megatron train) at PP2 x CP2 and the reference (Megatron infer) at CP2:
the demo's prompts are 25 tokens with the chat template, so each of a sequence's 4 CP chunks holds 8 tokens. The
model is a Qwen3-MoE and the actor runs routing replay R3 (issue #33): it replays the routes vLLM recorded, cut for
both stages and both CP chunks, in the old-log-prob forward and the update; its log-probs stay the rollout's to
float32 rounding, which another token's routes would break. (That replay brings a trainer closer to a rollout of
other numerics: test_layouts_router_replay.py, against transformers in bf16.)"""

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
            "build_tiny_model.family=qwen3_moe",
            "build_tiny_model.num_experts=4",
            "build_tiny_model.moe_intermediate_size=48",
            "algorithm.rollout_correction.is_level=sequence",  # (the old-log-prob pass runs: it replays too)
            "actor_train.strategy.router_replay=R3",
            "actor_train.strategy.tp=1",
            "actor_train.strategy.pp=2",
            "actor_train.strategy.cp=2",
            "actor_train.world_size=4",
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
        # The trainer's routers took exactly the experts vLLM recorded (old-log-prob forward and update), which
        # are the ones they would choose themselves at the weights that sampled (float32 on both sides).
        assert record["actor/moe/log_probs_replay_mismatched_tokens"] == 0, record
        assert record["actor/moe/replay_mismatched_tokens"] == 0, record
        assert record["actor/moe/log_probs_route_agreement"] == 1.0, record
        assert record["actor/rollout_logprob_gap"] < 1e-5, record
    # Step 1: the reference (CP2, Megatron infer) holds the actor's initial weights, so the KL starts at ~0.
    assert abs(history[0]["actor/reference_kl"]) < 1e-5
