"""Run guards in the config: a threshold on a step metric and what to do when it is crossed (`guards:`), and the
checks of that list. The guards themselves run in roll_backend/pipelines/services/guards.py."""

from __future__ import annotations

from dataclasses import dataclass

GUARD_ACTIONS = ("warn", "stop", "skip")


@dataclass(frozen=True)
class GuardConfig:
    """Trips when the step's `metric` is above `above`, below `below`, or not finite (NaN/inf is never healthy):
    e.g. {metric: actor/rollout_logprob_gap, above: 0.05, action: skip}, {metric: actor/grad_norm, action: stop}.
    Actions: warn (a warning and guard/<metric> = 1 on the row), stop (a checkpoint of the step, then the run stops
    naming the metric, its value, the step and the checkpoint), skip (the step does not train on its batch: checked
    before the update, so its metric must be one a step has by then: reward, staleness, rollout log-prob gaps, route
    agreement)."""

    metric: (
        str  # a step metric's name as logged, e.g. actor/rollout_logprob_gap, reward/mean, async/token_staleness_max
    )
    above: float | None = None  # trips when the value is above this
    below: float | None = None  # trips when the value is below this
    action: str = "warn"  # warn | stop | skip


# Metrics only the update itself produces: a skip guard cannot act on them (the update has happened by then).
UPDATE_METRIC_PREFIXES = ("actor/", "critic/")
BEFORE_UPDATE_ACTOR_METRICS = ("actor/rollout_logprob_gap", "actor/moe/")


def guard_problems(guards: list[GuardConfig]) -> list[str]:
    problems = []
    for index, guard in enumerate(guards):
        where = f"guards[{index}] ({guard.metric})"
        if guard.action not in GUARD_ACTIONS:
            problems.append(f"{where}: action={guard.action!r}; choose one of {', '.join(GUARD_ACTIONS)}")
        if guard.above is not None and guard.below is not None and guard.below > guard.above:
            problems.append(
                f"{where}: below={guard.below} > above={guard.above} trips on every value; use one bound, or below < "
                "above for a band outside which it trips"
            )
        updated = guard.metric.startswith(UPDATE_METRIC_PREFIXES) and not guard.metric.startswith(
            BEFORE_UPDATE_ACTOR_METRICS
        )
        if guard.action == "skip" and updated:
            problems.append(
                f"{where}: action=skip needs a metric the step has before its update, and {guard.metric} comes from "
                "the update (the trainer already skips updates whose gradient is not finite); use warn or stop"
            )
    return problems
