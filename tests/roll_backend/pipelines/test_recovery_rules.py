"""What the restart supervisor restarts, what a restart costs (seconds_lost), config checks of fault_tolerance, and
the metrics cut on resume (no Ray)."""

from __future__ import annotations

import json

import pytest
import ray

from roll_backend.config.loader import load_config
from roll_backend.config.schema import LoggingConfig
from roll_backend.config.typed import ConfigError
from roll_backend.distributed.dispatch import DispatchError
from roll_backend.distributed.placement import PlacementError
from roll_backend.distributed.worker_group import GroupBrokenError, GroupTimeoutError, RankDiedError, RankRaisedError
from roll_backend.errors import NotRestartableError
from roll_backend.pipelines.loops.phases import WeightSyncError
from roll_backend.pipelines.services.recovery import RESTARTS, SECONDS_LOST, RestartClock, TimedHistory, is_restartable
from roll_backend.pipelines.services.tracking import MetricsTracker, read_metrics


def test_lost_or_stuck_ranks_restart_and_nothing_else_does():
    died, timed_out = RankDiedError("rank died"), GroupTimeoutError("no answer")
    for error in (
        died,
        timed_out,
        RankRaisedError("a rank raised"),
        GroupBrokenError("broken", died),
        ray.exceptions.NodeDiedError("node gone"),
    ):
        assert is_restartable(error), error
    user_code = RankRaisedError("a reward function raised", restartable=False)
    for error in (
        user_code,
        GroupBrokenError("broken", user_code),
        WeightSyncError("probe failed"),
        NotRestartableError("bad data"),
        PlacementError("could not reserve"),
        DispatchError("bad arguments"),
        ValueError("a data file is malformed"),
        ConfigError(["bad key"]),
    ):
        assert not is_restartable(error), error


class Attempts:
    """Drives a TimedHistory as PipelineRun and run_with_restarts do, on a clock that reads `self.now`."""

    def __init__(self):
        self.now = 0.0
        self.clock = RestartClock(with_counters=True, now=lambda: self.now)
        self.history = TimedHistory(self.clock)
        self.counters = self.clock.new_attempt()

    def at(self, now: float) -> Attempts:
        self.now = now
        return self

    def resumed(self, after_step: int) -> None:  # groups built, checkpoint loaded
        self.history.resumed(after_step)

    def logged(self, step: int) -> None:
        self.history.append({"step": step, **self.counters})

    def failed(self) -> None:
        self.clock.failed()
        self.counters = self.clock.new_attempt()

    def lost_by_step(self) -> dict[int, float]:
        return {row["step"]: row[SECONDS_LOST] for row in self.history}


def test_seconds_lost_runs_from_the_last_step_before_a_failure_until_the_run_stands_there_again():
    # Killed in step 3, resuming from the step-2 checkpoint: the lost part of step 3, the shutdown and the rebuild
    # (20 -> 80) count; the rerun of step 3 does not (a run without the failure runs it too).
    run = Attempts()
    run.at(5).resumed(0)
    for step in (1, 2):
        run.at(10.0 * step).logged(step)
    run.at(40).failed()
    run.at(80).resumed(2)
    run.at(90).logged(3)
    assert run.lost_by_step() == {1: 0.0, 2: 0.0, 3: 60.0} and run.clock.restarts == 1
    # Hung in step 4 after step 3 was logged: from step 3's row (30) until step 3 is logged again (125).
    run = Attempts()
    run.at(5).resumed(0)
    for step in (1, 2, 3):
        run.at(10.0 * step).logged(step)
    run.at(50).failed()
    run.at(110).resumed(2)
    assert [row["step"] for row in run.history] == [1, 2]  # step 3 runs again
    run.at(125).logged(3)
    run.at(135).logged(4)
    assert run.lost_by_step() == {1: 0.0, 2: 0.0, 3: 0.0, 4: 95.0}
    assert run.history[-1][RESTARTS] == 1.0


def test_a_failure_while_catching_up_extends_the_same_loss_and_a_clean_run_loses_nothing():
    run = Attempts()
    run.at(5).resumed(0)
    for step in (1, 2, 3, 4):
        run.at(10.0 * step).logged(step)
    run.at(45).failed()  # resumes from step 2
    run.at(100).resumed(2)
    run.at(110).logged(3)
    run.at(115).failed()  # again before the run is back at step 4
    run.at(170).resumed(2)
    run.at(180).logged(3)
    run.at(190).logged(4)
    run.at(200).logged(5)
    assert run.lost_by_step() == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 150.0} and run.clock.restarts == 2
    # A failure before the first step: the groups' first start is not lost, their rebuild is.
    run = Attempts()
    run.at(30).resumed(0)
    run.at(35).failed()
    run.at(90).resumed(0)
    run.at(100).logged(1)
    assert run.lost_by_step() == {1: 60.0}
    clean = Attempts()
    for step in (1, 2):
        clean.at(step).logged(step)
    assert clean.lost_by_step() == {1: 0.0, 2: 0.0}
    assert RestartClock(with_counters=False).new_attempt() == {}  # max_restarts=0: no counters in the rows


def test_fault_tolerance_config_is_checked_before_ray_starts():
    with pytest.raises(ConfigError) as info:
        load_config(
            "configs/grpo_tiny_cpu.yaml",
            [
                "fault_tolerance.max_restarts=-1",
                "fault_tolerance.timeouts.generate=0",
                "fault_tolerance.inject=kill:actor_train:1:nap:3",
            ],
        )
    message = str(info.value)
    assert "fault_tolerance.max_restarts=-1 must be >= 0" in message
    assert "fault_tolerance.timeouts.generate=0.0 must be > 0 seconds" in message
    assert "fault_tolerance.inject: fault injection 'kill:actor_train:1:nap:3': phase 'nap'" in message
    with pytest.raises(ConfigError, match="max_restarts=2 restarts from checkpoints, but checkpoint.save_steps=0"):
        load_config("configs/grpo_tiny_cpu.yaml", ["fault_tolerance.max_restarts=2"])
    with pytest.raises(
        ConfigError, match="role 'actor' is not in this run; one of actor_train, actor_infer, reference, reward"
    ):
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
