"""Per-step metrics: phase timers, and the tracker that sends each step's scalars to the logging backends."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import yaml

from roll_backend import roles
from roll_backend.config.schema import LoggingConfig, PhaseTimeouts
from roll_backend.distributed.deadlines import deadline_scope
from roll_backend.pipelines.services.loggers import LOGGERS, LogTarget, StepLogger


def phase_deadline(timeouts: PhaseTimeouts | None, name: str):
    """A deadline scope for every group call of phase (or deadline) `name` (none without `timeouts`)."""
    key = roles.deadline_of(name)
    seconds = getattr(timeouts, key, None) if timeouts is not None else None
    return deadline_scope(seconds, f"phase '{name}' (fault_tolerance.timeouts.{key})")


class PhaseTimer:
    """Wall time of each phase of a step, reported as `timing/<phase>` seconds; with `timeouts`, each phase's
    group calls together must finish within its deadline."""

    def __init__(self, timeouts: PhaseTimeouts | None = None):
        self.seconds: dict[str, float] = {}
        self.timeouts = timeouts

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            with phase_deadline(self.timeouts, name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{name}": value for name, value in self.seconds.items()}


class MetricsTracker:
    """Sends each step's scalars to every backend of `logging` (pipelines.loggers), all with the same step.

    `first_step` is 0 for a fresh run, else the step the run resumes after: rows of later steps (written before a
    crash or restart) are cut from metrics.jsonl and purged from TensorBoard, so every step appears once there;
    W&B and MLflow continue the run they wrote before. `run_config` (W&B's run config) defaults to the
    `config.yaml` the run wrote to `run_dir`."""

    def __init__(
        self,
        run_dir: Path,
        config: LoggingConfig,
        total_steps: int,
        first_step: int = 0,
        run_config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if run_config is None:
            run_config = read_run_config(self.run_dir)
        target = LogTarget(self.run_dir, config, total_steps, first_step, run_config)
        self._closers = contextlib.ExitStack()  # closes every opened backend even when one of them fails
        self.loggers: dict[str, StepLogger] = {}
        try:
            for name in config.enabled_backends():
                self.loggers[name] = LOGGERS[name](target)
                self._closers.callback(self.loggers[name].close)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        scalars = {name: float(value) for name, value in metrics.items()}
        for logger in self.loggers.values():
            logger.log(step, scalars)

    def close(self) -> None:
        self._closers.close()


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config a run wrote to `run_dir/config.yaml` (empty when there is none)."""
    path = Path(run_dir) / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of a run (for plots and tests)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
