"""GRPO and PPO end to end on real groups (Megatron actor, vLLM rollout, Megatron reference/critic, rule reward),
and an asynchronous run that restarts from a checkpoint ending like an uninterrupted one. The plain GRPO run's metrics
and its exact resume (the actor at PP2 with an MTP layer) are checked in test_recovery.py."""

from __future__ import annotations

import math
import os
import random

import pytest
from pipeline_fixtures import (  # noqa: F401  (fixtures)
    assert_every_prompt_trained_once,
    base_config,
    hybrid_roles,
    model_dir,
    overrides,
    prompt_file,
)

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline, run_with_restarts
from roll_backend.pipelines.services.ledger import LEDGER_FILE, read_events, report

STEP_KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl", "response_length/mean")
# The bf16 run's reward rank dies at this call of its reward method (one per generation round; 3 steps of 1-6 rounds).
REWARD_KILL_CALL = random.Random(int(os.environ.get("ROLL_BACKEND_PROPERTY_SEED", "2811"))).randint(2, 5)
ASYNC_STEP_KEYS = (*STEP_KEYS, "async/staleness_max", "rollout_correction/kl_k3", "rollout_correction/weight_mean")


def test_ppo_run_with_critic_gae_and_rollout_correction(ray_session, base_config, prompt_file, model_dir, tmp_path):
    """PPO with a critic, GAE, KL in the reward (adaptive) and two epochs; FLOPs per phase add up. The rollout
    correction compares the old log-probs with the sampler's: both engines compute in float32 with the same
    weights, so it must find ~no mismatch (weights of 1, nothing rejected); a wrong old pass (another
    temperature, stale weights, misaligned tokens) fails. The actor is at TP1 x DP2 with a token budget (balanced
    by tokens over DP), the reference and critic with budgets too: the old log-probs and the weight-sync probe, scored
    by the trainer through the balanced, regrouped path, still agree with vLLM's row by row."""
    critic = (
        "critic={model_path: " + str(model_dir) + ", world_size: 1, strategy: {name: megatron_train, "
        "micro_batch_size: 4, max_tokens_per_microbatch: 96, optimizer: {lr: 1.0e-3}}}"
    )
    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path / "ppo",
            "pipeline=ppo",
            "algorithm.adv_estimator=gae",
            critic,
            "max_steps=2",
            "actor_train.strategy.tp=1",
            "actor_train.strategy.max_tokens_per_microbatch=96",
            "reference.strategy.max_tokens_per_microbatch=96",
            "algorithm.ppo_epochs=2",
            "algorithm.use_kl_loss=false",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "perf.peak_tflops=0.25",
            "algorithm.rollout_correction.is_level=token",
            "algorithm.rollout_correction.rejection=sequence",
        ),
    )
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [1, 2]
    for record in history:
        for key in (
            "critic/loss",
            "actor/pg_loss",
            "actor/kl_coef",
            "timing/values",
            "timing/critic_train",
            "timing/log_probs",
        ):
            assert math.isfinite(record[key]), (key, record)
        flops = {
            phase: record[f"perf/{phase}_tflops"] * record[f"timing/{phase}"]
            for phase in ("reference", "log_probs", "values", "train", "critic_train")
        }
        # actor, reference and critic share one model (the critic's output layer is hidden -> 1): the same batch
        # costs the same forward FLOPs, and a train pass three forwards per epoch (ppo_epochs=2)
        assert flops["reference"] == pytest.approx(flops["log_probs"], rel=1e-9)
        assert flops["train"] == pytest.approx(2 * 3 * flops["log_probs"], rel=1e-9)
        assert flops["critic_train"] == pytest.approx(2 * 3 * flops["values"], rel=1e-9)
        assert flops["values"] < flops["log_probs"]
        for phase, ranks in (("generate", 1), ("train", 2), ("critic_train", 1)):  # perf.peak_tflops is per rank
            assert record[f"perf/{phase}_mfu"] == pytest.approx(record[f"perf/{phase}_tflops"] / 0.25 / ranks, rel=1e-9)
        assert 0 <= record["rollout_correction/kl_k3"] < 1e-6
        assert record["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert record["rollout_correction/weight_max"] == pytest.approx(1.0, abs=1e-3)
        assert record["rollout_correction/masked_token_fraction"] == 0.0
        assert record["rollout_correction/masked_sequence_fraction"] == 0.0
        assert record["async/staleness_max"] == 0.0  # synchronous: every batch comes from the trainer's weights
        assert record["weight_sync/logprob_gap"] < 1e-4
        assert 1.0 <= record["actor/dp_token_imbalance_after"] <= record["actor/dp_token_imbalance_before"]
    assert history[1]["actor/kl_coef"] != history[0]["actor/kl_coef"]  # the adaptive controller moved


def test_grpo_in_bf16_mixed_precision(ray_session, base_config, prompt_file, model_dir, tmp_path):
    """Megatron actor and reference in bf16 (fp32 main weights in the optimizer) and vLLM in bf16, on the hybrid
    engine (all three in the actor's two processes, every part of their state offloaded while idle: the fp32 main
    copies and Adam's moments leave and come back around each phase): the weights the engine receives score like the
    trainer's to within bf16 rounding, well inside the 16-bit probe limit.
    With dynamic sampling on a reward most groups get alike (1 for a response whose CRC32 is a multiple of 10: a
    group of 4 differs with chance 1 - 0.9^4 - 0.1^4 = 0.34): each step refills until it has rollout_batch_size
    groups with differing rewards, or says it ran out of rounds. The reward rank is killed at its k-th call (k drawn
    from ROLL_BACKEND_PROPERTY_SEED: in some step's first round or a refill round, issue #52): the run restarts from
    its last checkpoint and its ledger still has every prompt generated trained or filtered, none trained twice."""
    rare = tmp_path / "rare_reward.py"
    rare.write_text(
        "import zlib\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(zlib.crc32(solution_str.encode()) % 10 == 0)\n"
    )
    from roll_backend.config.schema import HALF_PRECISION_LOGPROB_GAP

    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path / "bf16",
            "max_steps=3",
            "algorithm.ppo_mini_batch_size=16",
            "actor_train.strategy.params_dtype=bfloat16",
            "reference.strategy.params_dtype=bfloat16",
            "actor_infer.strategy.dtype=bfloat16",
            "reward.rewards={exact_match: 0.0}",
            f"reward.functions=[{{path: {rare}, name: compute_score, weight: 1.0}}]",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_generation_rounds=6",
            "algorithm.refill_oversample=2",
            "checkpoint.save_steps=1",
            "fault_tolerance.max_restarts=1",
            f"fault_tolerance.inject=kill:reward:0:reward:{REWARD_KILL_CALL}",
            *hybrid_roles(2, 2),
        ),
    )
    assert config.logprob_gap_limit() == HALF_PRECISION_LOGPROB_GAP
    history = run_with_restarts(config)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[-1]["fault_tolerance/restarts"] == 1.0, f"the reward rank's call {REWARD_KILL_CALL} was not reached"
    for record in history:
        for key in (*STEP_KEYS, "weight_sync/logprob_gap"):
            assert math.isfinite(record[key]), (key, record)
        assert 0 < record["weight_sync/logprob_gap"] < HALF_PRECISION_LOGPROB_GAP / 3
    assert abs(history[0]["actor/reference_kl"]) < 0.05  # step 1: bf16 rollout and bf16 reference hold the same weights
    for record in history:
        rounds, kept = record["dynamic_sampling/rounds"], record["dynamic_sampling/groups_kept"]
        assert (kept == 4 and rounds <= 6) if record["dynamic_sampling/filled"] else rounds == 6, record
        # Every group generated was kept or dropped; refill rounds drew 2 prompts per group still missing.
        prompts = record["dynamic_sampling/prompts"]
        assert kept + record["dynamic_sampling/groups_dropped"] >= prompts - 2 * 4 + 1, record  # (the last surplus)
        assert (rounds == 1) == (prompts == 4) and prompts <= 4 + (rounds - 1) * 2 * 4, record
        assert record["dynamic_sampling/dropped_responses"] == 4 * record["dynamic_sampling/groups_dropped"]
    assert any(record["dynamic_sampling/rounds"] > 1 for record in history)  # a refill happened
    # The ledger: every prompt a round generated, refill prompts included, was trained or filtered, none twice, across
    # the restart (the killed attempt's step was generated again from its checkpoint: the same positions).
    assert report(tmp_path / "bf16")[1] == []
    trained = [p for _, event, p in read_events(tmp_path / "bf16" / LEDGER_FILE) if event == "trained"]
    assert len(trained) == len(set(trained)) == sum(record["ledger/trained"] for record in history)
    for record in history:
        assert record["ledger/admitted"] == record["dynamic_sampling/prompts"], record
        assert record["ledger/trained"] == record["dynamic_sampling/groups_kept"], record
        assert record["ledger/trained"] + record.get("ledger/filtered", 0.0) == record["ledger/admitted"], record
    for record in history:  # the optimizer's fp32 state is its own part: training holds it, generation does not
        assert record["memory/train/allocated_gib"] > 2 * record["memory/reference/allocated_gib"] > 0, record
        assert record["memory/generate/allocated_gib"] == 0.0, record


def test_async_runs_prepared_inline_ahead_and_after_a_restart_agree(
    ray_session, base_config, prompt_file, model_dir, tmp_path
):
    """One-step off-policy: from step 2 on, each batch was generated one update behind the trainer. A run that
    prepares each batch inline and one that prepares it ahead (reward and reference log-probs while the actor
    trains, the reference on the rollout's resources) give the same steps. In the second, the reference rank dies
    while preparing step 4's batch on the driver thread (its 4th call, during step 3's training): the failure
    reaches the trainer, the run restarts from its step-2 checkpoint, which kept the prepared batch for step 3,
    and still ends like the first run. The first run also validates every 2 steps (queued after the generation in
    flight): its training is the second's all the same. Both run ReMax (verl's remax): each batch's greedy baselines
    are generated with the weights that sampled it, kept in the saved next batch, and agree between the runs."""
    async_keys = ("async_generation.enabled=true", "algorithm.rollout_correction.is_level=sequence", "max_steps=4")
    async_keys += ("algorithm.adv_estimator=remax",)
    validated = (f"data.val_path={prompt_file}", "eval.every_steps=2", "eval.before_train=false")
    inline = load_config(base_config, overrides(prompt_file, model_dir, tmp_path / "inline", *async_keys, *validated))
    history = run_pipeline(inline)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert ["val/all/mean@1" in h for h in history] == [False, True, False, True]
    assert [h["async/staleness_max"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    # Step 1 trains on the batch of the weights it holds; later batches are one update old: the mismatch is real.
    assert history[0]["rollout_correction/kl_k3"] < 1e-6 < history[2]["rollout_correction/kl_k3"]

    ahead = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path / "ahead",
            *async_keys,
            "checkpoint.save_steps=2",
            "async_generation.prepare_ahead=true",
            "reference.colocate_with=actor_infer",
            "fault_tolerance.max_restarts=1",
            "fault_tolerance.inject=kill:reference:0:log_probs:4",
        ),
    )
    ahead_history = run_with_restarts(ahead)
    assert [h["step"] for h in ahead_history] == [1, 2, 3, 4]
    assert [h["fault_tolerance/restarts"] for h in ahead_history] == [0.0, 0.0, 1.0, 1.0]
    assert [h["async/prepared_ahead"] for h in history + ahead_history] == [0.0] * 4 + [1.0] * 4
    assert (tmp_path / "ahead" / "checkpoints" / "step_2" / "next_batch.dataproto").is_file()
    assert_every_prompt_trained_once(tmp_path / "ahead", 4, 4)  # across the restart, the saved next batch included
    for record, ahead_record in zip(history, ahead_history):
        for key in (
            "async/trainer_wait_s",
            "async/rollout_idle_s",
            "timing/reference",
            "perf/reference_tflops",
            "weight_sync/logprob_gap",
        ):
            assert math.isfinite(ahead_record[key]), (key, ahead_record)
        # (step 3 trains on the batch restored from the checkpoint: how long it took to generate is not known)
        assert ahead_record["step"] == 3 or math.isfinite(ahead_record["timing/generate"]), ahead_record
        for key in (*ASYNC_STEP_KEYS, "remax/baseline_mean"):
            assert ahead_record[key] == pytest.approx(record[key], rel=1e-6, abs=1e-7), (record["step"], key)
