"""Automatic restart around a pipeline run: when a rank dies, hangs past its phase deadline or its node goes away,
shut every group down, rebuild them and resume from the latest complete checkpoint, at most
`fault_tolerance.max_restarts` times. What a restart cannot fix (config, data, user code, a failed weight-sync
probe, a checkpoint that does not load: anything that is not a lost or stuck rank) stops the run with its own
message. `fault_tolerance/seconds_lost` counts the whole wall time a restart costs (see RestartClock)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import ray

from roll_backend.config.schema import PipelineConfig
from roll_backend.distributed.faults import remaining_faults
from roll_backend.distributed.worker_group import GroupBrokenError, GroupTimeoutError, RankDiedError, RankRaisedError
from roll_backend.errors import NotRestartableError
from roll_backend.pipelines.driver import run_pipeline
from roll_backend.pipelines.run import StepHistory
from roll_backend.pipelines.services import checkpoint as ckpt

logger = logging.getLogger(__name__)

RESTARTS = "fault_tolerance/restarts"
SECONDS_LOST = "fault_tolerance/seconds_lost"  # wall time restarts cost, until the run was back where it failed
# Ray's own errors for a process or node that went away outside a group call (e.g. an object on a lost node).
LOST_WORKER_ERRORS = (
    ray.exceptions.RayActorError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.OwnerDiedError,
    ray.exceptions.WorkerCrashedError,
)


def is_restartable(error: BaseException) -> bool:
    """A lost, stuck or crashed rank: yes. A NotRestartableError anywhere, or any other error: no."""
    if isinstance(error, NotRestartableError):
        return False
    if isinstance(error, (RankDiedError, GroupTimeoutError, GroupBrokenError, RankRaisedError)):
        return getattr(error, "restartable", True)
    return isinstance(error, LOST_WORKER_ERRORS)


class RestartClock:
    """Seconds lost to restarts: from the moment the run last stood at its furthest step before a failure (that step
    logged, or the run built and resumed after it) until a rebuilt run stands at that step again. That holds the
    part of the failed step already run, the wait that detected the failure, the shutdown, the rebuild and resume,
    and the redone steps: what a run without the failure would not have spent. A failure while the rebuilt run is
    still catching up extends the same span. `counters` are added to the current attempt's rows; a row carries the
    total known when it is built, so a restart's cost shows from the first row after the run caught up."""

    def __init__(self, with_counters: bool, now: Callable[[], float] = time.monotonic):
        self.with_counters, self._now = with_counters, now
        self.restarts, self.seconds_lost = 0, 0.0
        self.counters: dict[str, float] = {}
        self.furthest_step, self.furthest_at = 0, now()  # a run that fails before its first build stood at 0 here
        self.lost_since: float | None = None  # set from a failure until the run stands at furthest_step again

    def new_attempt(self) -> dict[str, float]:
        """The counters a (re)started attempt adds to its rows; updated in place when a restart's cost is known."""
        self.counters = {RESTARTS: float(self.restarts), SECONDS_LOST: self.seconds_lost} if self.with_counters else {}
        return self.counters

    def failed(self) -> None:
        self.restarts += 1
        if self.lost_since is None:
            self.lost_since = self.furthest_at

    def stands_at(self, step: int) -> None:
        """The run has logged `step`, or has been built and resumed after it (0: from the start)."""
        now = self._now()
        if self.lost_since is not None:
            if step < self.furthest_step:
                return  # still redoing steps
            lost, self.lost_since = now - self.lost_since, None
            self.seconds_lost += lost
            if self.counters:
                self.counters[SECONDS_LOST] = self.seconds_lost
            logger.info(
                "restart %d: the run stands at step %d again %.1f s after it first did (the failed step's "
                "lost part, shutdown, rebuild, resume, redone steps); %s=%.1f",
                self.restarts,
                step,
                lost,
                SECONDS_LOST,
                self.seconds_lost,
            )
        if step >= self.furthest_step:
            self.furthest_step, self.furthest_at = step, now


class TimedHistory(StepHistory):
    """The rows of a run across its attempts; tells the clock where the run stands."""

    def __init__(self, clock: RestartClock):
        super().__init__()
        self.clock = clock

    def append(self, row: dict) -> None:
        super().append(row)
        self.clock.stands_at(row["step"])

    def resumed(self, step: int) -> None:
        super().resumed(step)
        self.clock.stands_at(step)


def run_with_restarts(config: PipelineConfig) -> list[dict]:
    """Run `config` to max_steps, restarting after restartable failures; returns one metrics row per step."""
    max_restarts = config.fault_tolerance.max_restarts
    clock = RestartClock(with_counters=max_restarts > 0)
    attempt_config, history = config, TimedHistory(clock)
    while True:
        try:
            return list(run_pipeline(attempt_config, clock.new_attempt(), history))
        except Exception as error:
            if clock.restarts >= max_restarts or not is_restartable(error):
                if clock.restarts < max_restarts:
                    logger.error("not restarting: %s cannot be fixed by a restart", type(error).__name__)
                raise
            clock.failed()
            checkpoint, resume_step = _restart_point(config)
            logger.warning(
                "restart %d/%d after: %s. The last step logged was %d; resuming from %s (step %d); the time until "
                "the run stands at step %d again counts in %s",
                clock.restarts,
                max_restarts,
                error,
                max((row["step"] for row in history), default=0),
                checkpoint or "the start (no checkpoint yet)",
                resume_step,
                clock.furthest_step,
                SECONDS_LOST,
            )
            # Later attempts resume from the latest complete checkpoint (dropping the rows of the steps they redo)
            # and inject the next attempt's fault, if any (the one that fired does not fire again).
            attempt_config = dataclasses.replace(
                config,
                checkpoint=dataclasses.replace(config.checkpoint, resume="auto"),
                fault_tolerance=dataclasses.replace(
                    config.fault_tolerance, inject=remaining_faults(attempt_config.fault_tolerance.inject)
                ),
            )


def _restart_point(config: PipelineConfig) -> tuple[Path | None, int]:
    """(the checkpoint a restart resumes from, its step); (None, 0) when there is none yet."""
    checkpoint, _ = ckpt.newest_complete_checkpoint(config.output_dir)  # the resume itself logs what it skips
    return checkpoint, int(ckpt.load_driver_state(checkpoint)["step"]) if checkpoint else 0
