"""GRPO through the pipeline with the actor (Megatron train) and the reference (Megatron infer) at PP2 x CP2 with the
experts split over the two CP ranks of each stage (EP2), on the hybrid engine (a vLLM engine and the reference in each
of the actor's four processes): the demo's prompts are 25 tokens with the chat template, so each of a sequence's 4 CP
chunks holds 8 tokens. The
model is a Qwen3-MoE whose routers are nearly tied (tests/support/router_tools.tie_routers): vLLM and Megatron, both
float32, choose different experts for some tokens, as a bf16 rollout does for a large model. The actor runs routing
replay R3 (issue #33): it replays the routes vLLM recorded, cut for both stages and both CP chunks, in the
old-log-prob forward and the update, and its log-probs stay the rollout's to float32 rounding; the reference routes
live, and on step 1 (the weights that sampled) its log-probs are as far from the rollout's as the flipped routes make
them: the gap without replay, measured in the same run on the same tokens."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from router_tools import tie_routers

from roll_backend.config.loader import load_config
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
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
            # On the hybrid engine: the engine (four, one per rank) and the reference (at the actor's PP2 x CP2) in
            # the actor's four processes, so routing replay and CP meet the hand-over and the in-process sync.
            "actor_train.strategy.ep=2",  # the experts split over the two CP ranks of each stage
            "reference.strategy.ep=2",
            "reference.strategy.cp=2",
            "reference.strategy.pp=2",
            "reference.world_size=4",
            "reference.hybrid=true",
            "actor_infer.world_size=4",
            "actor_infer.hybrid=true",
            "actor_infer.strategy.max_prompt_length=32",
            "logging.progress_bar=false",
            "perf.measure_peak=false",
            # The post-sync probe routes live on both sides: the tied routers flip there too (its gap is a gap
            # without replay, at the updated weights), so its limit is the flips', not float32 rounding's.
            "weight_sync_max_logprob_gap=0.5",
        ],
    )
    build_tiny_model(config.model_path, TinyModelSpec(**{"seed": config.seed, **config.build_tiny_model}))
    tie_routers(config.model_path, spread=1e-6)
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl"):
            assert math.isfinite(record[key]), (key, record)
        # The trainer's routers took exactly the experts vLLM recorded (old-log-prob forward and update), and its
        # CP2 x PP2 log-probs are the rollout's: R3 removes the train/inference gap the routes cause.
        assert record["actor/moe/log_probs_replay_mismatched_tokens"] == 0, record
        assert record["actor/moe/replay_mismatched_tokens"] == 0, record
        assert record["actor/rollout_logprob_gap"] < 1e-5, record
    first = history[0]
    print(
        f"step 1, tied routers: agreement with vLLM's routes {first['reference/moe/log_probs_route_agreement']:.3f} "
        f"(reference, live), {first['actor/moe/log_probs_route_agreement']:.3f} (actor's live top-k while replaying); "
        f"|log-prob - rollout's| {first['reference/rollout_logprob_gap']:.2e} live, "
        f"{first['actor/rollout_logprob_gap']:.2e} replayed (R3)"
    )
    # Step 1, the weights that sampled on both sides: left to themselves, the trainer's routers and the reference's
    # choose other experts than vLLM for some tokens, and those flips alone put the reference's log-probs far from
    # the rollout's (the gap without replay), while the actor replaying the rollout's routes matches it.
    assert first["actor/moe/log_probs_route_agreement"] < 0.99, first
    assert first["reference/moe/log_probs_route_agreement"] < 0.99, first
    # Far above both the replaying actor's gap and float32 rounding of a log-prob (eps x a magnitude of ~10): how
    # far above depends on how many routes the CPU's rounding flips (7.5e-4 to 1.8e-3 on the CPUs seen).
    rounding = torch.finfo(torch.float32).eps * 10
    assert first["reference/rollout_logprob_gap"] > 100 * max(first["actor/rollout_logprob_gap"], rounding), first
