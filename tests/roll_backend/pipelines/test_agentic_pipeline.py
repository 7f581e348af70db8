"""The agentic pipeline from YAML alone (configs/agentic_frozenlake_cpu.yaml, its engine on the hybrid engine): a tiny
model learns FrozenLake 4x4 by playing it turn by turn, validated greedily on held-out seeds before and after; a run
resumed from its checkpoint repeats the uninterrupted run's next step exactly. One run checked for all of it; a short
streaming run of two environments chosen per row (within the staleness bound, validated) beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipeline_fixtures import same_numbers
from test_streaming import check_staleness

from roll_backend.config.loader import load_config
from roll_backend.pipelines.driver import run_pipeline

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "agentic_frozenlake_cpu.yaml"
NO_PEAK_PROBE = "perf.measure_peak=false"  # the start-up GEMM probe costs every run seconds; test_recovery checks it
# The rollout engine in the actor's process (the hybrid engine): the recipe's numbers, bit for bit, one process fewer
# to start; the environments' workers run beside it.
HYBRID = "actor_infer.hybrid=true"


@pytest.fixture(scope="module")
def lake_run(ray_session, tmp_path_factory):
    output = tmp_path_factory.mktemp("frozen_lake")
    max_steps = load_config(CONFIG, []).max_steps
    # A checkpoint one step before the end, for the resume check.
    config = load_config(
        CONFIG, [f"output_dir={output}", f"checkpoint.save_steps={max_steps - 1}", NO_PEAK_PROBE, HYBRID]
    )
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
        load_config(
            CONFIG,
            [
                f"output_dir={tmp_path}",
                f"checkpoint.resume={checkpoint}",
                "eval.before_train=false",
                NO_PEAK_PROBE,
                HYBRID,
            ],
        )
    )
    theirs = next(row for row in history if row["step"] == config.max_steps)
    (ours,) = [row for row in resumed if row["step"] == config.max_steps]
    assert same_numbers(ours) == pytest.approx(same_numbers(theirs), rel=1e-6, abs=1e-7)


# Streaming: 3 steps of 4 seeds, a step's trajectories sampled while the previous step trains (max_staleness 1),
# turns in flight at an update recomputed; validation (greedy, held-out seeds) after the last step.
STREAMING = (
    "async_generation.enabled=true",
    "async_generation.mode=streaming",
    "async_generation.max_staleness=1",
    "async_generation.partial_rollout=recompute",
    "algorithm.rollout_correction.is_level=token",
    "max_steps=3",
    "rollout_batch_size=4",
    "checkpoint.save_steps=0",
    "eval.before_train=false",
)


# Two environments in the run (ROLL's env tags): rows of a prompt file naming `slippery` play the slippery lake of
# agentic.envs, the others (and the synthetic validation rows) the recipe's agentic.env.
SLIPPERY_LAKE = (
    "agentic.envs={slippery: {gymnasium: FrozenLake-v1, kwargs: {is_slippery: true, map_name: 4x4, "
    "text: {instructions: false, render: state}}}}"
)


def two_lake_rows(path: Path, count: int) -> Path:
    rows = [
        {"prompt": "", "answer": "", "seed": seed, **({"env": "slippery"} if seed % 2 else {})} for seed in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_streaming_agentic_run_of_two_environments_trains_within_the_bound_and_validates(ray_session, tmp_path):
    """Multi-turn trajectories in streaming mode: groups arrive from the ranks' trajectory loops, some are trained one
    update after they were sampled and none later, the rollout's agentic metrics of the trained groups reach each
    step, per environment too, and validation runs between steps. (A trajectory whose turns span an update, token by
    token: test_agentic_rollout.py; a streaming run's checkpoint and restart: test_streaming.py.)"""
    data = ["data.synthetic=null", f"data.train_path={two_lake_rows(tmp_path / 'lakes.jsonl', 64)}", SLIPPERY_LAKE]
    config = load_config(CONFIG, [f"output_dir={tmp_path}", *STREAMING, NO_PEAK_PROBE, *data])
    history = run_pipeline(config)
    assert [row["step"] for row in history] == [1, 2, 3]
    check_staleness(history)
    assert max(row["async/sample_lag_1"] for row in history) > 0  # the window let a step's groups run ahead
    per_step = config.rollout_batch_size * config.num_return_sequences_in_group
    for row in history:
        assert 1 <= row["agentic/turns_mean"] <= 10 and 0 <= row["agentic/success_rate"] <= 1
        # every trained trajectory counted under its environment (streaming shares a rank call's counts among the
        # steps its groups train in by rows: per environment that split is approximate, the total exact)
        counts = {env: row.get(f"agentic/env/{env}/trajectories_count", 0) for env in ("default", "slippery")}
        assert sum(counts.values()) == pytest.approx(per_step), row
    for env in ("default", "slippery"):
        assert sum(row.get(f"agentic/env/{env}/trajectories_count", 0) for row in history) > 0, env
    assert "val/agentic/success_rate" in history[-1] and "val/agentic/success_rate" not in history[0]
