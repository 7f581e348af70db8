"""Automatic restart around a pipeline run: when a rank dies, hangs past its phase deadline or its node goes away,
shut every group down, rebuild them and resume from the latest complete checkpoint, at most
`fault_tolerance.max_restarts` times. What a restart cannot fix (config, data, user code, a failed weight-sync
probe: anything that is not a lost or stuck rank) stops the run with its own message."""

from __future__ import annotations

import dataclasses
import logging
import time

import ray

from roll_backend.config.schema import PipelineConfig
from roll_backend.distributed.cluster import GroupBrokenError, GroupTimeoutError, RankDiedError, RankRaisedError
from roll_backend.distributed.faults import FAULTS_OFF
from roll_backend.errors import NotRestartableError
from roll_backend.pipelines import checkpoint as ckpt
from roll_backend.pipelines.driver import run_pipeline

logger = logging.getLogger(__name__)

RESTARTS = "fault_tolerance/restarts"
SECONDS_LOST = "fault_tolerance/seconds_lost"  # work after the checkpoint that was redone, plus the teardown
# Ray's own errors for a process or node that went away outside a group call (e.g. an object on a lost node).
LOST_WORKER_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
                      ray.exceptions.OwnerDiedError, ray.exceptions.WorkerCrashedError)


def is_restartable(error: BaseException) -> bool:
    """A lost, stuck or crashed rank: yes. A NotRestartableError anywhere, or any other error: no."""
    if isinstance(error, NotRestartableError):
        return False
    if isinstance(error, (RankDiedError, GroupTimeoutError, GroupBrokenError, RankRaisedError)):
        return getattr(error, "restartable", True)
    return isinstance(error, LOST_WORKER_ERRORS)


def run_with_restarts(config: PipelineConfig) -> list[dict]:
    """Run `config` to max_steps, restarting after restartable failures; returns one metrics row per step."""
    max_restarts = config.fault_tolerance.max_restarts
    attempt_config, history = config, []
    restarts, seconds_lost = 0, 0.0
    while True:
        counters = {RESTARTS: float(restarts), SECONDS_LOST: seconds_lost} if max_restarts else {}
        try:
            return run_pipeline(attempt_config, counters, history)
        except Exception as error:
            failed_at = time.time()
            if restarts >= max_restarts or not is_restartable(error):
                if restarts < max_restarts:
                    logger.error("not restarting: %s cannot be fixed by a restart", type(error).__name__)
                raise
            restarts += 1
            resume_step, lost = _log_restart(config, error, restarts, failed_at, history)
            seconds_lost += lost
            history[:] = [row for row in history if row["step"] <= resume_step]  # later steps run again
            # Later attempts resume from the latest complete checkpoint and inject no fault (it already fired).
            attempt_config = dataclasses.replace(
                config,
                checkpoint=dataclasses.replace(config.checkpoint, resume="auto"),
                fault_tolerance=dataclasses.replace(config.fault_tolerance, inject=FAULTS_OFF),
            )


def _log_restart(config: PipelineConfig, error: BaseException, restart: int, failed_at: float, history: list[dict]) -> tuple[int, float]:
    """Log reason, step and time lost; returns the step it resumes after and the seconds of work since then."""
    checkpoint = ckpt.latest_checkpoint(config.output_dir)
    resume_step = int(ckpt.load_driver_state(checkpoint)["step"]) if checkpoint else 0
    since = (checkpoint / ckpt.DRIVER_STATE).stat().st_mtime if checkpoint else None
    last_logged = max((row["step"] for row in history), default=0)
    lost = failed_at - since if since is not None else 0.0
    logger.warning(
        "restart %d/%d after: %s. The last step logged was %d; resuming from %s (step %d); %.1f s of work since "
        "that checkpoint is redone", restart, config.fault_tolerance.max_restarts, error, last_logged,
        checkpoint or "the start (no checkpoint yet)", resume_step, lost)
    return resume_step, lost
