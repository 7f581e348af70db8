"""Automatic restart on real groups (issue 15): a killed actor rank, a hung rollout rank and a rank killed while
writing a checkpoint each cost one restart from the latest complete checkpoint, and the run ends with the same
metrics as an uninterrupted one (timings aside); metrics.jsonl keeps one row per step. The uninterrupted GRPO run
is also where a plain run's metrics are checked."""

from __future__ import annotations

import logging
import math

import pytest

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_with_restarts
from roll_backend.pipelines.recovery import RESTARTS
from roll_backend.pipelines.tracking import read_metrics
from pipeline_fixtures import base_config, model_dir, overrides, prompt_file  # noqa: F401  (shared fixtures)

STEPS = 6
# Deadlines far above what a phase of the tiny model takes even on a loaded machine, far below the defaults.
DEADLINES = [f"fault_tolerance.timeouts.{phase}=60" for phase in ("generate", "reward", "log_probs", "train", "weight_sync")]


def six_step_config(base_config, prompt_file, model_dir, output_dir, *extra):
    return load_config(base_config, overrides(
        prompt_file, model_dir, output_dir, f"max_steps={STEPS}", "checkpoint.save_steps=2", "checkpoint.keep_last=3",
        "algorithm.ppo_mini_batch_size=16", "fault_tolerance.max_restarts=1", *DEADLINES, *extra))


def same_numbers(row: dict) -> dict:
    """A step's metrics without wall times, rates and restart counters."""
    return {k: v for k, v in row.items()
            if not k.startswith(("timing/", "throughput/", "perf/", "fault_tolerance/")) and not k.endswith(("_seconds", "_per_s"))}


@pytest.fixture(scope="module")
def uninterrupted_run(ray_session, base_config, prompt_file, model_dir, tmp_path_factory):
    """(history, output folder) of the run without faults."""
    output_dir = tmp_path_factory.mktemp("full")
    history = run_with_restarts(six_step_config(base_config, prompt_file, model_dir, output_dir))
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    assert {row[RESTARTS] for row in history} == {0.0}
    return history, output_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[0]


def test_a_grpo_run_reports_every_step(uninterrupted_run):
    history, output_dir = uninterrupted_run
    for record in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl", "response_length/mean",
                    "timing/generate", "timing/train", "timing/weight_sync", "weight_sync/logprob_gap",
                    "throughput/generated_tokens_per_s", "actor/broadcast_seconds"):
            assert math.isfinite(record[key]), (key, record)
        assert record["weight_sync/logprob_gap"] < 1e-4
        assert "timing/log_probs" not in record  # on-policy: the loss used the current log-probs, detached
        for phase in ("generate", "reference", "train"):  # against the GEMM peak the ranks measured at start-up
            assert record[f"perf/{phase}_tflops"] > 0 and record[f"perf/{phase}_mfu"] > 0, (phase, record)
    assert (output_dir / "metrics.jsonl").read_text().count("\n") == STEPS
    assert any((output_dir / "tensorboard").iterdir())


def assert_finished_like(uninterrupted, history, output_dir, restarted_at: int) -> None:
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    for ours, theirs in zip(history, uninterrupted):
        assert same_numbers(ours) == pytest.approx(same_numbers(theirs), rel=1e-6, abs=1e-7), ours["step"]
    assert [row[RESTARTS] for row in history] == [0.0 if row["step"] < restarted_at else 1.0 for row in history]
    assert [row["step"] for row in read_metrics(output_dir)] == list(range(1, STEPS + 1))  # the redone step once


def run_with_one_restart(config, caplog) -> tuple[list[dict], str]:
    """The run's history and its one restart's log line."""
    with caplog.at_level(logging.WARNING, logger="roll_backend.pipelines.recovery"):
        history = run_with_restarts(config)
    (restart,) = [r.getMessage() for r in caplog.records if "restart 1/1" in r.getMessage()]
    return history, restart


def test_actor_rank_killed_in_train_restarts_from_the_last_checkpoint(uninterrupted, base_config, prompt_file, model_dir, tmp_path, caplog):
    config = six_step_config(base_config, prompt_file, model_dir, tmp_path, "fault_tolerance.inject=kill:actor_train:1:train:3")
    history, restart = run_with_one_restart(config, caplog)
    assert_finished_like(uninterrupted, history, tmp_path, restarted_at=3)
    assert "actor_train.train_step: the actor of [rank 1/2" in restart
    assert "The last step logged was 2; resuming from" in restart and "step_2 (step 2)" in restart


def test_hung_rollout_rank_is_detected_at_the_phase_deadline_and_restarted(uninterrupted, base_config, prompt_file, model_dir, tmp_path, caplog):
    config = six_step_config(base_config, prompt_file, model_dir, tmp_path, "fault_tolerance.inject=hang:actor_infer:0:generate:4",
                             "fault_tolerance.timeouts.generate=15")
    history, restart = run_with_one_restart(config, caplog)
    assert_finished_like(uninterrupted, history, tmp_path, restarted_at=3)
    assert "The last step logged was 3; resuming from" in restart and "step_2 (step 2)" in restart  # step 4 hung
    assert "actor_infer.generate: no answer from [rank 0/1" in restart
    assert "within the deadline of phase 'generate' (fault_tolerance.timeouts.generate) (15s)" in restart


def test_rank_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(uninterrupted, base_config, prompt_file, model_dir, tmp_path, caplog):
    # The 2nd checkpoint save (step 4) dies half-written: step_4.tmp exists, step_2 is the latest complete one.
    config = six_step_config(base_config, prompt_file, model_dir, tmp_path, "fault_tolerance.inject=kill:actor_train:0:checkpoint:2")
    history, restart = run_with_one_restart(config, caplog)
    assert_finished_like(uninterrupted, history, tmp_path, restarted_at=3)
    assert "actor_train.save_checkpoint: the actor of [rank 0/2" in restart
    assert "The last step logged was 4; resuming from" in restart and "step_2 (step 2)" in restart
    assert (tmp_path / "checkpoints" / "step_6").is_dir()  # the half-written step_4.tmp was never loaded
