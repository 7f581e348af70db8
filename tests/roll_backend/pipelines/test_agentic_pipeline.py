"""The agentic pipeline from YAML alone (configs/agentic_frozenlake_cpu.yaml): a tiny model learns FrozenLake 4x4 by
playing it turn by turn, validated greedily on held-out seeds before and after; a run resumed from its checkpoint
repeats the uninterrupted run's next step exactly. One run checked for all of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_recovery import same_numbers

from roll_backend.config.loader import load_config
from roll_backend.pipelines.driver import run_pipeline

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "agentic_frozenlake_cpu.yaml"


@pytest.fixture(scope="module")
def lake_run(ray_session, tmp_path_factory):
    output = tmp_path_factory.mktemp("frozen_lake")
    max_steps = load_config(CONFIG, []).max_steps
    # A checkpoint one step before the end, for the resume check.
    config = load_config(CONFIG, [f"output_dir={output}", f"checkpoint.save_steps={max_steps - 1}"])
    return config, run_pipeline(config), output


def test_a_tiny_model_learns_frozen_lake_from_yaml(lake_run):
    config, history, output = lake_run
    rows = {row["step"]: row for row in history}
    assert rows[1]["agentic/success_rate"] <= 0.05  # the random policy: holes, turns lost to text that is no action
    last = [rows[step]["agentic/success_rate"] for step in range(config.max_steps - 2, config.max_steps + 1)]
    assert min(last) >= 0.8, last
    assert rows[config.max_steps]["agentic/turns_mean"] < 8  # the shortest path is 6 moves; it stops wandering
    # Greedy validation on other seeds, before training and after the last step.
    assert rows[0]["val/agentic/success_rate"] == 0.0
    assert rows[config.max_steps]["val/agentic/success_rate"] == 1.0
    samples = [json.loads(line) for line in (output / "validation.jsonl").read_text().splitlines()]
    assert {sample["step"] for sample in samples} == {0, config.max_steps}


def test_a_resumed_agentic_run_repeats_the_next_step(lake_run, tmp_path):
    config, history, output = lake_run
    saved = config.max_steps - 1
    checkpoint = output / "checkpoints" / f"step_{saved}"
    assert checkpoint.is_dir(), sorted(p.name for p in (output / "checkpoints").iterdir())
    resumed = run_pipeline(
        load_config(CONFIG, [f"output_dir={tmp_path}", f"checkpoint.resume={checkpoint}", "eval.before_train=false"])
    )
    theirs = next(row for row in history if row["step"] == config.max_steps)
    (ours,) = [row for row in resumed if row["step"] == config.max_steps]
    assert same_numbers(ours) == pytest.approx(same_numbers(theirs), rel=1e-6, abs=1e-7)
