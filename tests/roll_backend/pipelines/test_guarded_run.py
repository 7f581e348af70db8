"""A run guard on a real run (issue #52): a NaN gradient injected at step 2 (fault injection's `nan` on actor rank 0)
is skipped by the trainer on every rank, and the `stop` guard on actor/grad_norm stops the run within that step with
a checkpoint of it, naming the metric, its value, the step and the checkpoint; a `warn` guard flags the same row. A
`skip` guard tripping on every step leaves the policy untrained and unsynced, which the ledger records."""

from __future__ import annotations

import json

import pytest
from pipeline_fixtures import base_config, model_dir, overrides, prompt_file  # noqa: F401  (shared fixtures)

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_pipeline
from roll_backend.pipelines.services import checkpoint as ckpt
from roll_backend.pipelines.services.guards import GuardStop
from roll_backend.pipelines.services.ledger import report


def test_a_nan_gradient_is_skipped_and_stops_the_run_with_a_checkpoint(
    ray_session,
    base_config,
    prompt_file,
    model_dir,
    tmp_path,  # noqa: F811
):
    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path,
            "max_steps=4",
            "checkpoint.save_steps=0",
            "algorithm.ppo_mini_batch_size=16",  # one train call per step: the fault falls on step 2
            "fault_tolerance.inject=nan:actor_train:0:train:2",
            "guards=[{metric: actor/grad_norm, action: stop}, {metric: actor/update_ok, below: 1, action: warn}]",
        ),
    )
    with pytest.raises(GuardStop) as stop:
        run_pipeline(config)
    message = str(stop.value)
    folder = ckpt.checkpoint_root(tmp_path) / "step_2"
    assert "at step 2" in message and "actor/grad_norm=nan (not finite: guard action stop)" in message
    assert str(folder) in message and ckpt.checkpoint_problem(folder) is None
    assert ckpt.load_driver_state(folder)["policy_version"] == 2  # (an update skipped still counts as a step)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["actor/update_ok"] == 1.0 and "guard/actor/grad_norm" not in rows[0]
    assert rows[1]["actor/update_ok"] == 0.0 and rows[1]["guard/actor/grad_norm"] == 1.0
    assert rows[1]["guard/actor/update_ok"] == 1.0


def test_a_skip_guard_skips_the_update_and_the_sync_and_the_ledger_says_so(
    ray_session,
    base_config,
    prompt_file,
    model_dir,
    tmp_path,  # noqa: F811
):
    """A skip guard that trips on every step (the reward is never above 2): no update, no weight sync, the policy
    stays at version 0; every prompt is in the ledger as skipped_by_guard, none trained."""
    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path,
            "max_steps=2",
            "checkpoint.save_steps=2",
            "guards=[{metric: reward/mean, below: 2.0, action: skip}]",
        ),
    )
    history = run_pipeline(config)
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert row["guard/skipped_update"] == 1.0 and row["guard/reward/mean"] == 1.0
        assert not any(key.startswith(("weight_sync/", "actor/pg_loss")) for key in row), row
        assert row["ledger/skipped_by_guard"] == 4.0 and "ledger/trained" not in row
    assert ckpt.load_driver_state(ckpt.checkpoint_root(tmp_path) / "step_2")["policy_version"] == 0
    summary, problems = report(tmp_path)
    assert problems == [] and "skipped_by_guard 8" in summary
