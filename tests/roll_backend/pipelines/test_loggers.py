"""The logging backends get the same scalars at the same steps: metrics.jsonl, read back next to the offline W&B
run file and the MLflow store; a resume continues the same W&B and MLflow runs; unknown names are refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from roll_backend.config.loader import load_config
from roll_backend.config.schema import LoggingConfig
from roll_backend.config.typed import ConfigError
from roll_backend.pipelines.services.loggers import RUN_ID_FILE, mlflow_tracking_uri
from roll_backend.pipelines.services.tracking import MetricsTracker, read_metrics

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"
BACKENDS = ("jsonl", "wandb", "mlflow")


@pytest.fixture(autouse=True)
def wandb_stays_local(tmp_path, monkeypatch):
    """W&B's own settings and caches go to tmp_path; a request to a server would hit a closed local port."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the backend's own mode is what is tested


def step_metrics(step: int) -> dict[str, float]:
    return {"reward/mean": 0.1 * step, "actor/pg_loss": -0.3 / step, "timing/train": 1.5 + step, "data/rows": 16}


def wandb_records(run_file: Path):
    """The protobuf records of a W&B run file (`run-<id>.wandb`): LevelDB's log format, after a 7-byte header
    (':W&B', magic 0xBEE1, version). wandb 0.31 ships no Python reader for it any more."""
    from wandb.proto import wandb_internal_pb2

    block_size, chunk_header = 32768, 7
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    position, pending = 7, b""
    while position + chunk_header <= len(data):
        left_in_block = block_size - position % block_size
        if left_in_block < chunk_header:  # the block's tail is padding
            position += left_in_block
            continue
        _crc, length, chunk_type = struct.unpack("<IHB", data[position : position + chunk_header])
        if chunk_type == 0:  # zero fill up to the next block
            position += left_in_block
            continue
        pending += data[position + chunk_header : position + chunk_header + length]
        position += chunk_header + length
        if chunk_type in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_runs(run_dir: Path) -> list[Path]:
    """The offline run files, once complete: `run.finish()` returns before W&B's service has closed the run's
    stream, which writes the file's last records (a loaded CI machine read it without its history); teardown
    waits for the service to exit."""
    import wandb

    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_run(run_file: Path) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """(the run record's id, project, name and config; each metric's (step, value) points) of one run file."""
    run, series = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            run = {"id": record.run.run_id, "project": record.run.project, "name": record.run.display_name}
            run["config"] = config
        elif kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)  # W&B keeps some keys as a one-item nested_key
                if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    series.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return run, series


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_tracking_uri(run_dir))
    run_id = (run_dir / "mlflow" / RUN_ID_FILE).read_text()
    run = client.get_run(run_id)
    series = {
        key: [(point.step, point.value) for point in client.get_metric_history(run_id, key)] for key in run.data.metrics
    }
    return client, run, series


def jsonl_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series = {}
    for row in read_metrics(run_dir):
        for key, value in row.items():
            if key != "step":
                series.setdefault(key, []).append((row["step"], value))
    return series


def test_jsonl_wandb_and_mlflow_hold_the_same_metrics_at_the_same_steps(tmp_path):
    run_dir = tmp_path / "grpo_demo"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("exp_name: grpo_demo\nseed: 7\nalgorithm: {adv_estimator: grpo}\n")
    tracker = MetricsTracker(run_dir, LoggingConfig(backends=BACKENDS), total_steps=3)
    for step in (1, 2, 3):
        tracker.log(step, step_metrics(step))
    tracker.close()

    expected = jsonl_series(run_dir)
    assert sorted(expected) == sorted(step_metrics(1)) and expected["data/rows"] == [(1, 16), (2, 16), (3, 16)]
    (run_file,) = wandb_offline_runs(run_dir)
    wandb_info, wandb_series = wandb_run(run_file)
    assert wandb_series == expected
    assert wandb_info["id"] == (run_dir / "wandb" / RUN_ID_FILE).read_text()
    assert (wandb_info["project"], wandb_info["name"]) == ("roll-backend", "grpo_demo")  # defaults: output_dir's name
    assert wandb_info["config"]["seed"] == 7 and wandb_info["config"]["algorithm"] == {"adv_estimator": "grpo"}
    client, run, mlflow_series = mlflow_run(run_dir)
    assert mlflow_series == expected
    assert (run.info.run_name, run.info.status) == ("grpo_demo", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "roll-backend"


def test_a_resumed_tracker_continues_the_same_wandb_and_mlflow_runs(tmp_path):
    logging = LoggingConfig(backends=BACKENDS, project="resume-test", run_name="first")
    first = MetricsTracker(tmp_path, logging, total_steps=4)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    wandb_id = (tmp_path / "wandb" / RUN_ID_FILE).read_text()
    mlflow_id = (tmp_path / "mlflow" / RUN_ID_FILE).read_text()

    resumed = MetricsTracker(tmp_path, logging, total_steps=4, first_step=2)  # resumes after the step-2 checkpoint
    resumed.log(3, {"reward/mean": 30.0})
    resumed.log(4, {"reward/mean": 40.0})
    resumed.close()

    assert [(row["step"], row["reward/mean"]) for row in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 30), (4, 40)]
    # Offline, each attempt is its own run folder with the same id; `wandb sync` puts both into that run.
    first_file, resumed_file = wandb_offline_runs(tmp_path)
    assert wandb_run(first_file)[0]["id"] == wandb_run(resumed_file)[0]["id"] == wandb_id
    assert wandb_run(resumed_file)[1] == {"reward/mean": [(3, 30.0), (4, 40.0)]}
    assert (tmp_path / "mlflow" / RUN_ID_FILE).read_text() == mlflow_id
    client, run, series = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1
    # MLflow cannot delete metric points: the step redone after the checkpoint is there twice, the resumed one last.
    assert series == {"reward/mean": [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]}

    fresh = MetricsTracker(tmp_path, logging, total_steps=4)  # first_step 0: a new run, not a resume
    fresh.close()
    assert (tmp_path / "wandb" / RUN_ID_FILE).read_text() != wandb_id
    assert (tmp_path / "mlflow" / RUN_ID_FILE).read_text() != mlflow_id


def test_without_backends_the_switches_pick_them_as_before():
    assert LoggingConfig().enabled_backends() == ("jsonl", "tensorboard", "console")
    assert LoggingConfig(tensorboard=False, progress_bar=False).enabled_backends() == ("jsonl",)
    assert LoggingConfig(backends=("wandb", "jsonl", "wandb")).enabled_backends() == ("wandb", "jsonl")


def test_config_names_backends_and_refuses_unknown_ones_naming_the_allowed(tmp_path):
    base = [f"output_dir={tmp_path}/run"]
    config = load_config(CONFIG, [*base, "logging.backends=[jsonl,wandb,mlflow]", "logging.project=p"])
    assert config.logging.enabled_backends() == ("jsonl", "wandb", "mlflow") and config.logging.project == "p"
    with pytest.raises(ConfigError) as refused:
        load_config(
            CONFIG,
            [*base, "logging.backends=[jsonl,wandbb]", "logging.wandb_mode=cloud", "logging.jsonl=false"],
        )
    assert refused.value.problems == [
        "logging.backends: unknown backend 'wandbb'; choose from console, jsonl, mlflow, tensorboard, wandb",
        "logging.jsonl=false contradicts logging.backends, which names 'jsonl'; drop one of the two",
        "logging.wandb_mode='cloud'; choose one of offline, online",
    ]
