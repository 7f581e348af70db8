"""What the restart supervisor restarts, config checks of fault_tolerance, and the metrics cut on resume (no Ray)."""

from __future__ import annotations

import json

import pytest
import ray

from roll_backend.config.loader import load_config
from roll_backend.config.schema import LoggingConfig
from roll_backend.config.typed import ConfigError
from roll_backend.distributed.cluster import GroupBrokenError, GroupTimeoutError, RankDiedError, RankRaisedError
from roll_backend.distributed.dispatch import DispatchError
from roll_backend.distributed.placement import PlacementError
from roll_backend.errors import NotRestartableError
from roll_backend.pipelines.recovery import is_restartable
from roll_backend.pipelines.phases import WeightSyncError
from roll_backend.pipelines.tracking import MetricsTracker, read_metrics


def test_lost_or_stuck_ranks_restart_and_nothing_else_does():
    died, timed_out = RankDiedError("rank died"), GroupTimeoutError("no answer")
    for error in (died, timed_out, RankRaisedError("a rank raised"), GroupBrokenError("broken", died),
                  ray.exceptions.NodeDiedError("node gone")):
        assert is_restartable(error), error
    user_code = RankRaisedError("a reward function raised", restartable=False)
    for error in (user_code, GroupBrokenError("broken", user_code), WeightSyncError("probe failed"),
                  NotRestartableError("bad data"), PlacementError("could not reserve"), DispatchError("bad arguments"),
                  ValueError("a data file is malformed"), ConfigError(["bad key"])):
        assert not is_restartable(error), error


def test_fault_tolerance_config_is_checked_before_ray_starts():
    with pytest.raises(ConfigError) as info:
        load_config("configs/grpo_tiny_cpu.yaml", ["fault_tolerance.max_restarts=-1", "fault_tolerance.timeouts.generate=0",
                                                   "fault_tolerance.inject=kill:actor_train:1:nap:3"])
    message = str(info.value)
    assert "fault_tolerance.max_restarts=-1 must be >= 0" in message
    assert "fault_tolerance.timeouts.generate=0.0 must be > 0 seconds" in message
    assert "fault_tolerance.inject: fault injection 'kill:actor_train:1:nap:3': phase 'nap'" in message
    with pytest.raises(ConfigError, match="max_restarts=2 restarts from checkpoints, but checkpoint.save_steps=0"):
        load_config("configs/grpo_tiny_cpu.yaml", ["fault_tolerance.max_restarts=2"])
    with pytest.raises(ConfigError, match="role 'actor' is not in this run; one of actor_train, actor_infer, reference, reward"):
        load_config("configs/grpo_tiny_cpu.yaml", ["fault_tolerance.inject=kill:actor:0:train:1"])
    with pytest.raises(ConfigError, match="actor_train has ranks 0..1"):
        load_config("configs/grpo_tiny_cpu.yaml", ["fault_tolerance.inject=kill:actor_train:2:train:1"])
    config = load_config("configs/grpo_tiny_cpu.yaml", ["fault_tolerance.max_restarts=2", "checkpoint.save_steps=5"])
    assert config.fault_tolerance.max_restarts == 2 and config.fault_tolerance.timeouts.train > 3600


def test_resume_cuts_metrics_after_the_checkpoint_step_and_purges_tensorboard(tmp_path):
    logging = LoggingConfig(jsonl=True, tensorboard=True, progress_bar=False)
    first = MetricsTracker(tmp_path, logging, total_steps=5)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as torn:
        torn.write('{"step": 4, "rew')  # the driver died mid-line
    resumed = MetricsTracker(tmp_path, logging, total_steps=5, first_step=2)  # resumes after the step-2 checkpoint
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    resumed.log(3, {"reward/mean": 30.0})
    resumed.close()
    assert [(row["step"], row["reward/mean"]) for row in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
    # TensorBoard reads both event files of the folder; the resumed writer's purge hides the first step 3.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
