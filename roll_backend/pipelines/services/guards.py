"""Run guards: thresholds on a step's health metrics (rollout log-prob gaps, the post-sync probe gap, token
staleness, route agreement, grad norm and loss, reward) with an action, from the config's `guards:` list
(roll_backend/config/guard_rules.GuardConfig). `skip` guards are checked before the update (a tripped one skips the
step's training and its weight sync); warn and stop guards on the step's whole row, after it is logged; a stop saves
a checkpoint of the step first and raises GuardStop naming the metric, its value, the step and the checkpoint."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

from roll_backend.config.guard_rules import GuardConfig
from roll_backend.errors import NotRestartableError

logger = logging.getLogger(__name__)


class GuardStop(NotRestartableError):
    """A `stop` guard tripped: the run stopped after saving a checkpoint (a restart would trip it again)."""


def tripped(guard: GuardConfig, value: float) -> bool:
    if not math.isfinite(value):
        return True
    return (guard.above is not None and value > guard.above) or (guard.below is not None and value < guard.below)


def describe(guard: GuardConfig, value: float) -> str:
    bounds = {"above": guard.above, "below": guard.below}
    limits = " or ".join(f"{side} {limit}" for side, limit in bounds.items() if limit is not None)
    why = "not finite" if not math.isfinite(value) else limits
    return f"{guard.metric}={value:.6g} ({why}: guard action {guard.action})"


class RunGuards:
    """The run's guards. `skip_update(metrics, step)` before an update; `after_step(metrics, step, save)` on the
    logged row (`save(step)` writes the stop's checkpoint and returns its folder)."""

    def __init__(self, guards: list[GuardConfig]):
        self.skips = [g for g in guards if g.action == "skip"]
        self.checks = [g for g in guards if g.action != "skip"]

    def _trips(self, guards: list[GuardConfig], metrics: dict[str, float]) -> list[tuple[GuardConfig, float]]:
        return [(g, float(metrics[g.metric])) for g in guards if g.metric in metrics and tripped(g, metrics[g.metric])]

    def skip_update(self, metrics: dict[str, float], step: int) -> dict[str, float] | None:
        """None to train; else the row's guard metrics: a skip guard tripped on what the step has so far."""
        trips = self._trips(self.skips, metrics)
        for guard, value in trips:
            logger.warning("step %d skips its update: %s", step, describe(guard, value))
        return {f"guard/{g.metric}": 1.0 for g, _ in trips} | {"guard/skipped_update": 1.0} if trips else None

    def flags(self, metrics: dict[str, float]) -> dict[str, float]:
        """guard/<metric> = 1 for each warn or stop guard the row trips (added to the row before it is logged)."""
        return {f"guard/{g.metric}": 1.0 for g, _ in self._trips(self.checks, metrics)}

    def after_step(self, metrics: dict[str, float], step: int, save: Callable[[int], Path | None]) -> None:
        trips = self._trips(self.checks, metrics)
        for guard, value in trips:
            if guard.action == "warn":
                logger.warning("step %d: %s", step, describe(guard, value))
        stops = [(g, v) for g, v in trips if g.action == "stop"]
        if stops:
            checkpoint = save(step)
            raise GuardStop(
                f"run guard stopped the run at step {step}: {'; '.join(describe(g, v) for g, v in stops)}. "
                f"Checkpoint: {checkpoint or 'none (no actor to save)'}; resume from it with "
                "checkpoint.resume=<that folder> once the cause is fixed, or change the guard"
            )
