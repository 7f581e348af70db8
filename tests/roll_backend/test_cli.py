"""The `roll-backend` command line: validate (no Ray), plot, and submit through Ray Jobs to a loopback head.

The submit tests start their own head with `ray start --head --block` in a new process group and end it by
that group's id: `ray stop` would kill every Ray of this user on the machine, the session's own included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from pipeline_fixtures import hybrid_roles

from roll_backend import cli

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"
BIN = Path(sys.executable).parent
ROLL_BACKEND = str(BIN / "roll-backend")


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ROLL_BACKEND, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


# ---- validate -------------------------------------------------------------------------------------------
def test_validate_prints_resolved_yaml_and_starts_no_ray():
    # In-process through main(), then check what got imported: the config layer never needs Ray or the backends.
    code = (
        "import sys; from roll_backend.cli import main; rc = main(['validate', sys.argv[1], 'max_steps=3']);"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'vllm', 'megatron'});"
        "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(CONFIG)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr
    assert "pipeline: grpo" in done.stdout and "max_steps: 3" in done.stdout
    # Interpolations are resolved in what is printed.
    assert "${" not in done.stdout


def test_validate_console_script_reports_bad_override_with_exit_2():
    done = run_cli("validate", str(CONFIG), "max_step=3", "actor_train.strategy.tp")
    assert done.returncode == 2
    assert done.stdout == ""
    assert "override 'actor_train.strategy.tp' is not key=value" in done.stderr


def test_validate_reports_every_problem_at_once(capsys):
    rc = cli.main(["validate", str(CONFIG), "max_step=3", "algorithm.ppo_epochs=one", "actor_train.strategy.tpp=2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "max_step: unknown key; did you mean 'max_steps'?" in err
    assert "algorithm.ppo_epochs: expected int, got str 'one'" in err
    assert "actor_train.strategy.tpp: unknown key for strategy 'megatron_train'; did you mean 'tp'?" in err


def test_validate_missing_config_file(capsys, tmp_path):
    assert cli.main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml' does not exist" in capsys.readouterr().err


# ---- plot -----------------------------------------------------------------------------------------------
def test_plot_writes_a_png_of_the_reward_curve(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": 0.1 * s, "actor/pg_loss": 0.0} for s in range(1, 11)]
    rows[4]["val/reward"] = 0.3
    rows[9]["val/reward"] = 0.8
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "reward_curve.png"
    assert capsys.readouterr().out.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000

    out = tmp_path / "sub" / "curve.png"
    assert cli.main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_metrics_says_what_to_pass(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'} does not exist; pass the run's output_dir" in capsys.readouterr().err


def test_plot_rejects_rows_without_reward(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "no rows with both 'step' and 'reward/mean'; pass --metric with one of loss" in capsys.readouterr().err


def test_plot_draws_any_metric_of_an_offline_run(tmp_path, capsys):
    rows = [{"step": s, "actor/loss": 2.0 / s} for s in range(1, 6)] + [{"step": 5, "val/sft/nll": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["plot", str(tmp_path), "--metric", "actor/loss", "--val-metric", "val/sft/nll"]) == 0
    png = tmp_path / "actor_loss.png"
    assert capsys.readouterr().out.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- submit: the pieces that need no cluster ------------------------------------------------------------
def test_job_entrypoint_quotes_overrides():
    command = cli.job_entrypoint("configs/a b.yaml", ["exp_name=my run", "seed=1"])
    assert command == "python -m roll_backend.cli run 'configs/a b.yaml' 'exp_name=my run' seed=1"


def test_job_runtime_env_uploads_the_working_dir_without_big_folders(tmp_path):
    env = cli.job_runtime_env(tmp_path)
    assert env["working_dir"] == str(tmp_path)
    assert {".venv", ".git", "runs"} <= set(env["excludes"])
    assert env["env_vars"]["RAY_AUTH_MODE"] == "disabled"


def test_submit_rejects_a_config_outside_the_working_dir(tmp_path, monkeypatch, capsys):
    outside = tmp_path / "cfg.yaml"
    shutil.copy(CONFIG, outside)
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    assert cli.main(["submit", "--address", "http://127.0.0.1:1", str(outside)]) == 2
    assert "lies outside the job's working dir" in capsys.readouterr().err


def test_submit_validates_before_contacting_the_cluster_and_takes_overrides_after_options(monkeypatch, capsys):
    # The overrides after --no-wait make the config invalid: exit 2 with the config message shows they reached
    # validation, and that nothing was sent (no cluster answers on port 1).
    monkeypatch.chdir(REPO)
    argv = [
        "submit",
        "--address",
        "http://127.0.0.1:1",
        "configs/grpo_tiny_cpu.yaml",
        "max_steps=2",
        "--no-wait",
        "actor_train.strategy.tp=2",
        "actor_train.world_size=3",
    ]
    assert cli.main(argv) == 2
    assert "does not divide actor_train.world_size=3" in capsys.readouterr().err


def test_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["validate", str(CONFIG), "max_steps=2", "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ---- submit to a real head on loopback ------------------------------------------------------------------
def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head with the dashboard (Jobs API) on loopback: own temp dir and ports, so it cannot meet the
    session's in-process Ray. Yields the dashboard URL."""
    (gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env_agent, node_manager, object_manager) = (
        free_ports(9)
    )
    temp_dir = tempfile.mkdtemp(prefix="rbh", dir="/tmp")  # unix socket paths must stay short
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # a job's `python` is then this venv's
    command = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env_agent}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--temp-dir={temp_dir}",
        "--num-cpus=4",
        "--disable-usage-stats",
    ]
    log = open(Path(temp_dir) / "ray_start.log", "w")
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_jobs_api(url, head, timeout_s=120)
        yield url
    finally:
        stop_process_group(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_process_group(head: subprocess.Popen) -> None:
    """SIGTERM the head's process group (the head and everything it started), SIGKILL what outlives 2 s (a throwaway
    head: something of it always did outlive 10 s)."""
    for sig, grace_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            head.poll()  # reap the head itself, or the group never looks empty
            try:
                os.killpg(head.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def wait_for_jobs_api(url: str, head: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/jobs/", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Jobs API at {url} did not answer within {timeout_s}s")


@pytest.fixture()
def job_dir(tmp_path):
    """A small working dir to upload: the demo config (exact-match reward on a prompt file, a model vLLM's CPU
    attention takes), its prompts, and a second prompt file that .gitignore keeps out of the upload."""
    from omegaconf import OmegaConf

    tree = OmegaConf.load(CONFIG)
    tree.reward.rewards = {"exact_match": 1.0}
    tree.build_tiny_model = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    tree.data.synthetic = None
    tree.data.train_path = "prompts.jsonl"
    OmegaConf.save(tree, tmp_path / "grpo.yaml")
    rows = "".join(json.dumps({"prompt": f"copy: {d}", "answer": str(d)}) + "\n" for d in range(10))
    (tmp_path / "prompts.jsonl").write_text(rows)
    (tmp_path / "ignored_prompts.jsonl").write_text(rows)
    (tmp_path / ".gitignore").write_text("ignored_prompts.jsonl\n")
    return tmp_path


def test_submit_reports_a_failed_job_with_exit_1(ray_head, job_dir):
    # Valid here, but the job's copy of the working dir lacks the git-ignored prompt file: the job's own
    # validation fails, so the job ends FAILED and submit says so.
    start = time.monotonic()
    done = run_cli(
        "submit",
        "--address",
        ray_head,
        "grpo.yaml",
        "data.train_path=ignored_prompts.jsonl",
        "--poll-s=0.5",
        cwd=job_dir,
        timeout=180,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "data.train_path='ignored_prompts.jsonl' does not exist" in done.stdout  # the job's log, followed
    assert "ended FAILED" in done.stderr
    print(f"failed job round trip: {time.monotonic() - start:.1f}s")


def test_submit_runs_a_one_step_pipeline_to_success(ray_head, job_dir):
    """The job also loads a user reward function by a path relative to the working dir it was uploaded with. It
    trains on a reasoning-gym task from YAML alone (prompts from the library's generator, the reward from its own
    verifier) and validates on another draw of it before and after the step, on the hybrid engine."""
    from omegaconf import OmegaConf

    (job_dir / "my_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'chars': float(len(solution_str))}\n"
    )
    tree = OmegaConf.load(job_dir / "grpo.yaml")
    tree.reward.functions = [
        {"path": "my_rewards.py", "name": "compute_score", "weight": 1.0},
        {"path": "roll_backend.rewards.procedural", "name": "compute_score", "weight": 1.0},
    ]
    tree.data.train_path = None
    tree.data.reasoning_gym = {"name": "basic_arithmetic", "size": 20, "seed": 1}
    tree.data.val_reasoning_gym = {"name": "basic_arithmetic", "size": 3, "seed": 2}
    tree.data.max_prompt_length = tree.actor_infer.strategy.max_prompt_length = 96
    tree.actor_infer.strategy.max_model_len = 128
    OmegaConf.save(tree, job_dir / "grpo.yaml")
    out = job_dir / "out"
    start = time.monotonic()
    done = run_cli(
        "submit",
        "--address",
        ray_head,
        "grpo.yaml",
        "max_steps=1",
        f"output_dir={out}",
        "--poll-s=0.5",
        "rollout_batch_size=2",
        "num_return_sequences_in_group=4",
        "response_length=6",
        "algorithm.ppo_mini_batch_size=8",
        "actor_train.strategy.micro_batch_size=4",
        "reference.strategy.micro_batch_size=8",
        "logging.progress_bar=false",
        "perf.measure_peak=false",
        "logging.tensorboard=false",
        *hybrid_roles(2, 2),  # the job on the hybrid engine: two rank processes and a reward worker to start
        cwd=job_dir,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUCCEEDED" in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows][-1] == 1 and "reward/mean" in rows[-1]
    assert "reward/my_rewards.compute_score/chars" in rows[-1]  # the function ran in the job's reward workers
    assert "reward/roll_backend.rewards.procedural.compute_score/mean" in rows[-1]
    assert [row["step"] for row in rows if "val/basic_arithmetic/mean@1" in row] == [0, 1]
    samples = [json.loads(line) for line in (out / "validation.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 3 + [1] * 3 and {s["data_source"] for s in samples} == {
        "basic_arithmetic"
    }
    assert [s["prompt"][0]["content"] for s in samples[:3]] == [s["prompt"][0]["content"] for s in samples[3:]]
    for row in (row for row in rows if "val/basic_arithmetic/mean@1" in row):  # the accuracy of its own samples
        rewards = [s["reward"] for s in samples if s["step"] == row["step"]]
        assert row["val/basic_arithmetic/mean@1"] == pytest.approx(sum(rewards) / len(rewards))
    print(f"one-step job round trip: {time.monotonic() - start:.1f}s")
