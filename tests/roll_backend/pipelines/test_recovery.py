"""Automatic restart on real groups (issue 15): a hung rollout rank, a killed actor rank (the two in one run, one per
attempt) and a rank killed while writing a checkpoint each cost one restart from the latest complete checkpoint
(passing over one whose shard was truncated after it was committed, saying so), and the run ends with the same
metrics as an uninterrupted one
(timings aside); metrics.jsonl keeps one row per step; seconds_lost holds the whole restart (the wait that saw the
failure, the rebuild, the redone steps). The actor runs at PP2 with an MTP layer, so every restart also shows that a
run resumed from a checkpoint repeats the uninterrupted run exactly at that layout (the MTP stage's checkpoint is the
case that used to fail). The uninterrupted GRPO run is also where a plain run's metrics are checked; the checkpoints
of the last run are where a changed byte in a shard is shown to be seen before Ray starts."""

from __future__ import annotations

import json
import logging
import math
import re
import time

import pytest
from pipeline_fixtures import (  # noqa: F401  (shared fixtures)
    assert_every_prompt_trained_once,
    base_config,
    model_dir,
    overrides,
    prompt_file,
    same_numbers,
)

from roll_backend import cli
from roll_backend.config.loader import load_config
from roll_backend.pipelines import evaluate, run_with_restarts
from roll_backend.pipelines.services import checkpoint as ckpt
from roll_backend.pipelines.services.recovery import RESTARTS, SECONDS_LOST
from roll_backend.pipelines.services.tracking import read_metrics

STEPS = 6
ACTOR_AT_PP2_WITH_MTP = (
    "actor_train.strategy.tp=1",
    "actor_train.strategy.pp=2",
    "actor_train.strategy.mtp_num_layers=1",
)
# Deadlines far above what a phase of the tiny model takes even on a loaded machine, far below the defaults.
DEADLINES = [
    f"fault_tolerance.timeouts.{phase}=60" for phase in ("generate", "reward", "log_probs", "train", "weight_sync")
]


def six_step_config(base_config, prompt_file, model_dir, output_dir, *extra):
    return load_config(base_config, six_step_overrides(prompt_file, model_dir, output_dir, *extra))


def six_step_overrides(prompt_file, model_dir, output_dir, *extra) -> list[str]:
    return overrides(
        prompt_file,
        model_dir,
        output_dir,
        f"max_steps={STEPS}",
        "checkpoint.save_steps=2",
        "checkpoint.keep_last=3",
        "algorithm.ppo_mini_batch_size=16",
        "fault_tolerance.max_restarts=1",
        *ACTOR_AT_PP2_WITH_MTP,
        *DEADLINES,
        *extra,
    )


@pytest.fixture(scope="module")
def uninterrupted_run(ray_session, base_config, prompt_file, model_dir, tmp_path_factory):
    """(history, output folder) of the run without faults."""
    output_dir = tmp_path_factory.mktemp("full")
    history = run_with_restarts(
        six_step_config(base_config, prompt_file, model_dir, output_dir, "perf.measure_peak=true")
    )
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    assert {row[RESTARTS] for row in history} == {0.0} and {row[SECONDS_LOST] for row in history} == {0.0}
    return history, output_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[0]


def test_a_grpo_run_reports_every_step(uninterrupted_run):
    history, output_dir = uninterrupted_run
    for record in history:
        for key in (
            "reward/mean",
            "actor/pg_loss",
            "actor/mtp_loss",
            "actor/grad_norm",
            "actor/reference_kl",
            "response_length/mean",
            "timing/generate",
            "timing/train",
            "timing/weight_sync",
            "weight_sync/logprob_gap",
            "throughput/generated_tokens_per_s",
            "actor/broadcast_seconds",
        ):
            assert math.isfinite(record[key]), (key, record)
        assert record["weight_sync/logprob_gap"] < 1e-4
        assert "timing/log_probs" not in record  # on-policy: the loss used the current log-probs, detached
        for phase in ("generate", "reference", "train"):  # against the GEMM peak the ranks measured at start-up
            assert record[f"perf/{phase}_tflops"] > 0 and record[f"perf/{phase}_mfu"] > 0, (phase, record)
    assert (output_dir / "metrics.jsonl").read_text().count("\n") == STEPS
    assert any((output_dir / "tensorboard").iterdir())


def training_rows(history: list[dict]) -> list[dict]:
    """The steps' rows without validation (its step-0 row and val/ metrics)."""
    return [{k: v for k, v in row.items() if not k.startswith("val/")} for row in history if row["step"] > 0]


def assert_finished_like(uninterrupted, history, output_dir, restarted_at: int, restarts: int = 1) -> None:
    history = training_rows(history)
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    for ours, theirs in zip(history, uninterrupted):
        assert same_numbers(ours) == pytest.approx(same_numbers(theirs), rel=1e-6, abs=1e-7), ours["step"]
    assert [row[RESTARTS] for row in history] == [0.0 if row["step"] < restarted_at else restarts for row in history]
    logged = [row["step"] for row in read_metrics(output_dir) if row["step"] > 0]
    assert logged == list(range(1, STEPS + 1))  # the redone step once
    assert_every_prompt_trained_once(output_dir, STEPS, 4)  # (the fixtures' rollout_batch_size)


def run_with_one_restart(config, caplog) -> tuple[list[dict], str, float]:
    """The run's history, its one restart's log line and the seconds it lost. Checks seconds_lost against the times of
    the run's own log lines: it holds at least the span from the restart line (written after the failure was seen and
    the groups shut down) to the line saying the run stands where it was again, which comes after the rebuilt run's
    "resumed from" line; it shows from the first row after the last step logged before the failure."""
    started = time.time()
    with caplog.at_level(logging.INFO, logger="roll_backend.pipelines"):
        history = run_with_restarts(config)
    wall = time.time() - started
    (restart,) = [r for r in caplog.records if "restart 1/1 after" in r.getMessage()]
    (resumed,) = [
        r for r in caplog.records if r.getMessage().startswith("resumed from") and r.created > restart.created
    ]
    (back,) = [r for r in caplog.records if r.getMessage().startswith("restart 1: the run stands at step")]
    last_logged = int(re.search(r"The last step logged was (\d+);", restart.getMessage()).group(1))
    assert {row[SECONDS_LOST] for row in history if row["step"] <= last_logged} == {0.0}
    (lost,) = {row[SECONDS_LOST] for row in history if row["step"] > last_logged}
    assert resumed.created <= back.created and back.created - restart.created <= lost < wall, (
        back.created - restart.created,
        lost,
        wall,
    )
    assert f"the run stands at step {last_logged} again {lost:.1f} s after it first did" in back.getMessage()
    return history, restart.getMessage(), lost


def damage_after_commit(monkeypatch, step: int) -> dict:
    """Truncates the biggest actor shard of checkpoint `step` once it is committed, the first time only (what a full
    disk or an unflushed write leaves behind); returns {name, size, kept} once it did."""
    damaged, commit = {}, ckpt.commit_checkpoint

    def commit_then_truncate(staged, driver_state, keep_last):
        final = commit(staged, driver_state, keep_last)
        if final.name == f"step_{step}" and not damaged:
            shard = max((final / "actor").glob("*.distcp"), key=lambda path: path.stat().st_size)
            damaged.update(name=shard.relative_to(final).as_posix(), size=shard.stat().st_size)
            damaged["kept"] = damaged["size"] // 2
            shard.write_bytes(shard.read_bytes()[: damaged["kept"]])
        return final

    monkeypatch.setattr(ckpt, "commit_checkpoint", commit_then_truncate)
    return damaged


def test_a_hung_rollout_rank_then_a_killed_actor_rank_each_restart_the_run(
    uninterrupted, base_config, prompt_file, model_dir, tmp_path, caplog, monkeypatch
):
    """Two faults, one per attempt. The rollout rank hangs in step 3's generate: it is seen at the phase deadline
    (10 s), and the run restarts from step_2. The restarted run commits step_4, a shard of which is then truncated,
    and an actor rank dies in step 5's update: the second restart passes over step_4, saying why, and resumes from
    step_2 again."""
    damaged = damage_after_commit(monkeypatch, 4)
    config = six_step_config(
        base_config,
        prompt_file,
        model_dir,
        tmp_path,
        "fault_tolerance.max_restarts=2",
        "fault_tolerance.inject=hang:actor_infer:0:generate:3;kill:actor_train:1:train:3",
        "fault_tolerance.timeouts.generate=10",
    )
    started = time.time()
    with caplog.at_level(logging.INFO, logger="roll_backend.pipelines"):
        history = run_with_restarts(config)
    wall = time.time() - started
    assert_finished_like(uninterrupted, history, tmp_path, restarted_at=3, restarts=2)
    hung, killed = [r.getMessage() for r in caplog.records if re.match(r"restart \d/2 after", r.getMessage())]
    assert "The last step logged was 2; resuming from" in hung and "step_2 (step 2)" in hung  # step 3 hung
    assert "actor_infer.generate: no answer from [rank 0/1" in hung
    assert "within the deadline of phase 'generate' (fault_tolerance.timeouts.generate) (10s)" in hung
    assert "actor_train.train_step: the actor of [rank 1/2" in killed
    assert "The last step logged was 4; resuming from" in killed and "step_2 (step 2)" in killed
    # Seconds lost grow with each restart (the hang's 10 s wait, both rebuilds, the steps redone); none before.
    lost = [row[SECONDS_LOST] for row in training_rows(history)]
    assert lost[:2] == [0.0, 0.0] and 10 < lost[2] and lost[2:] == sorted(lost[2:]) and lost[-1] < wall, lost
    root = ckpt.checkpoint_root(tmp_path)
    messages = [r.getMessage() for r in caplog.records if r.name == ckpt.__name__]
    assert messages == [  # the rebuilt runs' resume=auto (the first run started without resume)
        f"resume=auto: the run resumes from {root / 'step_2'}",
        (
            f"resume=auto skips checkpoint {root / 'step_4'}: {damaged['name']} has {damaged['kept']} bytes, its "
            f"manifest says {damaged['size']} (truncated or overwritten)"
        ),
        f"resume=auto: the run resumes from {root / 'step_2'}",
    ]
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_6" and ckpt.checkpoint_problem(root / "step_4") is None


def test_rank_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
    uninterrupted, base_config, prompt_file, model_dir, tmp_path, caplog
):
    # The 2nd checkpoint save (step 4) dies half-written: step_4.tmp exists, step_2 is the latest complete one.
    # The run also validates (before training and every 2 steps, again after the restart): its training steps are
    # still those of the run without validation.
    config = six_step_config(
        base_config,
        prompt_file,
        model_dir,
        tmp_path,
        "fault_tolerance.inject=kill:actor_train:0:checkpoint:2",
        *validation_overrides(tmp_path),
    )
    history, restart, _ = run_with_one_restart(config, caplog)
    assert_finished_like(uninterrupted, history, tmp_path, restarted_at=3)
    assert_validated(history, tmp_path, steps=[0, 2, 4, 6])
    # `roll-backend eval` on the last checkpoint repeats the run's own validation of that step.
    eval_config, checkpoint = cli.eval_target(
        str(base_config),
        [*six_step_overrides(prompt_file, model_dir, tmp_path, *validation_overrides(tmp_path)), "checkpoint=auto"],
    )
    assert checkpoint.name == "step_6" and eval_config.output_dir == str(tmp_path / "eval" / "step_6")
    evaluated = evaluate(eval_config)
    (last,) = [row for row in history if row["step"] == STEPS]
    assert evaluated["step"] == STEPS
    val_keys = [key for key in last if key.startswith("val/")]
    assert {k: evaluated[k] for k in val_keys} == pytest.approx({k: last[k] for k in val_keys}, rel=1e-6, abs=1e-7)
    assert "actor_train.save_checkpoint: the actor of [rank 0/2" in restart
    assert "The last step logged was 4; resuming from" in restart and "step_2 (step 2)" in restart
    assert (tmp_path / "checkpoints" / "step_6").is_dir()  # the half-written step_4.tmp was never loaded
    assert_a_changed_byte_is_seen_before_ray(tmp_path, caplog)


VAL_ROWS = {"arith": [("copy: 11", "11"), ("copy: 3", "3")], "words": [("copy: 42", "42")]}


def validation_overrides(output_dir) -> tuple[str, ...]:
    """Two validation files (sources from a column, and from the file name), 2 samples per prompt."""
    paths = []
    for name, rows in VAL_ROWS.items():
        path = output_dir / f"{name}.jsonl"
        column = {"data_source": "arith"} if name == "arith" else {}
        path.write_text("".join(json.dumps({"prompt": p, "answer": a, **column}) + "\n" for p, a in rows))
        paths.append(str(path))
    return (
        f"data.val_path=[{','.join(paths)}]",
        "eval.every_steps=2",
        "eval.n=2",
        "eval.pass_k=[1,2]",
        "eval.maj_k=[2]",
        "eval.correct_threshold=0.5",
    )


def assert_validated(history: list[dict], output_dir, steps: list[int]) -> None:
    """val/ metrics at exactly `steps`, equal to what the written samples give (pass@2 from each prompt's pair)."""
    assert [row["step"] for row in history if "val/all/mean@2" in row] == steps
    samples = [json.loads(line) for line in (output_dir / "validation.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == steps and len(samples) == len(steps) * 3 * 2
    for row in (row for row in history if row["step"] in steps):
        ours = [s for s in samples if s["step"] == row["step"]]
        assert {s["data_source"] for s in ours} == {"arith", "words"}
        for source in ("arith", "words"):
            rewards = [s["reward"] for s in ours if s["data_source"] == source]
            assert row[f"val/{source}/mean@2"] == pytest.approx(sum(rewards) / len(rewards))
            pairs = [rewards[i : i + 2] for i in range(0, len(rewards), 2)]
            expected = sum(max(p) >= 0.5 for p in pairs) / len(pairs)
            assert row[f"val/{source}/pass@2"] == pytest.approx(expected)
            assert 0 <= row[f"val/{source}/maj@2"] <= row[f"val/{source}/pass@2"]


def assert_a_changed_byte_is_seen_before_ray(output_dir, caplog) -> None:
    """On this run's real checkpoints (step_2, 4, 6): one changed byte in the middle of step_6's biggest shard (its
    size unchanged) makes resume=auto take step_4, saying why, and an explicit resume=step_6 is refused naming the
    file; all on the driver, as `roll-backend run` does before Ray starts."""
    root = ckpt.checkpoint_root(output_dir)
    assert ckpt.resume_checkpoint("auto", output_dir) == root / "step_6"
    shard = max((root / "step_6" / "actor").glob("*.distcp"), key=lambda path: path.stat().st_size)
    assert shard.stat().st_size <= ckpt.FULL_HASH_BYTES  # the tiny model's shards are hashed whole
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0xFF
    shard.write_bytes(content)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.resume_checkpoint("auto", output_dir) == root / "step_4"
    problem = (
        f"{shard.relative_to(root / 'step_6').as_posix()} has the recorded size but other content than its "
        "manifest's blake2b digest (damaged)"
    )
    assert [r.getMessage() for r in caplog.records] == [f"resume=auto skips checkpoint {root / 'step_6'}: {problem}"]
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.resume_checkpoint(str(root / "step_6"), output_dir)
    assert str(info.value).startswith(f"checkpoint {root / 'step_6'} is not complete: {problem}. Resume from an older")
