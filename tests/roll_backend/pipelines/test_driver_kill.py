"""A driver killed with SIGKILL mid-run (issue 15): every process of the run (Ray's, the ranks', the ranks'
children) is gone within 30 s, and `checkpoint.resume=auto` continues with one metrics row per step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from pipeline_fixtures import base_config, model_dir, overrides, prompt_file  # noqa: F401  (shared fixtures)
from process_checks import describe, wait_until_gone

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_with_restarts
from roll_backend.pipelines.tracking import read_metrics


def rows_written(output_dir) -> int:
    path = output_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def test_driver_sigkill_leaves_no_process_and_resume_auto_continues(
    ray_session, base_config, prompt_file, model_dir, tmp_path
):
    args = overrides(
        prompt_file,
        model_dir,
        tmp_path / "run",
        "max_steps=4",
        "checkpoint.save_steps=2",
        "algorithm.ppo_mini_batch_size=16",
        "ray_num_cpus=8",
    )
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "roll_backend.cli", "run", str(base_config), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    started = time.monotonic()
    while rows_written(tmp_path / "run") < 3:  # step 3 done: the checkpoint of step 2 is complete
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert time.monotonic() - started < 900, "the driver wrote no third step within 15 min"
        time.sleep(0.5)
    run_pids = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
    assert len(run_pids) >= 10  # Ray's own processes, 5 ranks with their watchdogs
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert describe(wait_until_gone(run_pids, within_s=30)) == []

    resumed = load_config(base_config, [*args, "checkpoint.resume=auto"])
    history = run_with_restarts(resumed)
    assert [row["step"] for row in history] == [3, 4]
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]  # step 3's first row was cut
