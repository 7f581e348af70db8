"""Run guards (roll_backend/pipelines/services/guards.py): what trips, which action runs where, what a stop says; the
config's checks of a guard list (roll_backend/config/guard_rules.py)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from roll_backend.config.guard_rules import GuardConfig, guard_problems
from roll_backend.pipelines.services.guards import GuardStop, RunGuards, tripped


@pytest.mark.parametrize(
    "guard,value,trips",
    [
        (GuardConfig("m", above=0.1), 0.1, False),  # a bound itself does not trip
        (GuardConfig("m", above=0.1), 0.1000001, True),
        (GuardConfig("m", below=0.5), 0.49, True),
        (GuardConfig("m", below=0.5), 0.5, False),
        (GuardConfig("m", below=0.0, above=1.0), 0.5, False),  # a band
        (GuardConfig("m", below=0.0, above=1.0), -0.1, True),
        (GuardConfig("m"), 1e30, False),  # no bound: only a non-finite value trips
        (GuardConfig("m"), math.nan, True),
        (GuardConfig("m", above=10.0), -math.inf, True),
    ],
)
def test_a_guard_trips_outside_its_bounds_and_on_any_non_finite_value(guard, value, trips):
    assert tripped(guard, value) is trips


def test_skip_guards_act_before_the_update_and_the_others_after_the_step(caplog, tmp_path):
    guards = RunGuards(
        [
            GuardConfig("actor/rollout_logprob_gap", above=0.05, action="skip"),
            GuardConfig("reward/mean", below=0.1, action="warn"),
            GuardConfig("actor/grad_norm", action="stop"),
        ]
    )
    assert guards.skip_update({"actor/rollout_logprob_gap": 0.01}, 3) is None
    skipped = guards.skip_update({"actor/rollout_logprob_gap": 0.2, "reward/mean": 0.0}, 3)
    assert skipped == {"guard/actor/rollout_logprob_gap": 1.0, "guard/skipped_update": 1.0}  # warn waits for the row
    saved: list[int] = []

    def save(step: int) -> Path:
        saved.append(step)
        return tmp_path / f"step_{step}"

    row = {"reward/mean": 0.05, "actor/grad_norm": 1.0}
    assert guards.flags(row) == {"guard/reward/mean": 1.0}
    with caplog.at_level(logging.WARNING):
        guards.after_step(row, 4, save)
    assert "step 4: reward/mean=0.05 (below 0.1: guard action warn)" in caplog.text and saved == []
    with pytest.raises(GuardStop) as stop:
        guards.after_step({"reward/mean": 0.5, "actor/grad_norm": math.nan}, 5, save)
    assert saved == [5]
    message = str(stop.value)
    assert "step 5" in message and "actor/grad_norm=nan (not finite" in message and str(tmp_path / "step_5") in message
    assert guards.after_step({"other": math.nan}, 6, save) is None  # a metric a row does not have trips nothing


def test_the_config_refuses_guards_that_cannot_act():
    problems = guard_problems(
        [
            GuardConfig("reward/mean", action="pause"),
            GuardConfig("reward/mean", above=0.1, below=0.9),
            GuardConfig("actor/grad_norm", action="skip"),
            GuardConfig("actor/rollout_logprob_gap", above=0.1, action="skip"),  # known before the update: fine
        ]
    )
    assert len(problems) == 3, problems
    assert "action='pause'; choose one of warn, stop, skip" in problems[0]
    assert "below=0.9 > above=0.1" in problems[1]
    assert "actor/grad_norm comes from the update" in problems[2]
