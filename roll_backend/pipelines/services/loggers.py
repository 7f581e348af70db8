"""Step-metric backends (JSONL, TensorBoard, console, W&B, MLflow), one small class each, chosen by name.

Each opens from a `LogTarget`, takes `log(step, metrics)` with float scalars and `close()`. Third-party
packages are imported when their backend is opened, so a run that does not select them never loads them.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from roll_backend.config.schema import LOGGER_NAMES, LoggingConfig

PROGRESS_MFU = ("perf/generate_mfu", "perf/train_mfu")  # shown in the progress bar next to reward and loss
RUN_ID_FILE = "run_id"  # in a backend's folder: the run id a resumed run continues


@dataclass(frozen=True)
class LogTarget:
    """What every backend opens with: the run's folder and logging section, and where the run resumes."""

    run_dir: Path
    config: LoggingConfig
    total_steps: int
    first_step: int = 0  # 0: a fresh run; else the step the run resumes after (later rows are dropped)
    run_config: dict[str, Any] = field(default_factory=dict)  # the resolved run config, for W&B's run config

    @property
    def run_name(self) -> str:
        return self.config.run_name or self.run_dir.resolve().name


class StepLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON line per step in `run_dir/metrics.jsonl`; a resume first cuts the rows after its step."""

    def __init__(self, target: LogTarget):
        cut_metrics_after(target.run_dir, target.first_step)
        self._file = (target.run_dir / "metrics.jsonl").open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """TensorBoard scalars under `run_dir/tensorboard`."""

    def __init__(self, target: LogTarget):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides events of this step and later from earlier writers of the folder.
        self._writer = SummaryWriter(str(target.run_dir / "tensorboard"), purge_step=target.first_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class ConsoleLogger:
    """A tqdm progress bar showing reward, policy loss and the generate/train MFU."""

    def __init__(self, target: LogTarget):
        from tqdm import tqdm

        self._bar = tqdm(total=target.total_steps, initial=target.first_step, desc="steps", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: f"{metrics[k]:.3f}" for k in ("reward/mean", "actor/pg_loss") if k in metrics}
        shown |= {k.split("/")[1].replace("_mfu", " mfu"): f"{metrics[k]:.0%}" for k in PROGRESS_MFU if k in metrics}
        self._bar.set_postfix(shown)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


class WandbLogger:
    """Weights & Biases, offline unless `wandb_mode: online`: the run is written under `run_dir/wandb` (upload it
    later with `wandb sync`). A resume continues the run id stored there."""

    def __init__(self, target: LogTarget):
        import wandb

        folder = target.run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        run_id = stored_run_id(folder, target.first_step) or uuid.uuid4().hex[:12]
        self._run = wandb.init(
            mode=target.config.wandb_mode,
            dir=str(target.run_dir),
            project=target.config.project,
            name=target.run_name,
            id=run_id,
            resume="allow",
            config=target.run_config,
            # create_new: with the default, an init while another run of the process is active returns that run.
            reinit="create_new",
            # console off: W&B would otherwise wrap the driver's stdout/stderr, which tqdm and Ray also write to.
            settings=wandb.Settings(silent=True, console="off"),
        )
        (folder / RUN_ID_FILE).write_text(run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowLogger:
    """MLflow, in a SQLite store at `run_dir/mlflow/mlflow.db` (experiment = project). MLflow 3 refuses the plain
    file store (`./mlruns`) unless an environment variable allows it, so the local store is its SQLite backend.
    A resume continues the run id stored in `run_dir/mlflow`."""

    def __init__(self, target: LogTarget):
        from mlflow.tracking import MlflowClient

        folder = (target.run_dir / "mlflow").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=mlflow_tracking_uri(target.run_dir))
        project = target.config.project
        experiment = self._client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # artifacts beside the store: MLflow's default is relative to the working directory
            experiment_id = self._client.create_experiment(project, artifact_location=(folder / "artifacts").as_uri())
        self.run_id = self._resumable_run(stored_run_id(folder, target.first_step))
        if self.run_id is None:
            self.run_id = self._client.create_run(experiment_id, run_name=target.run_name).info.run_id
            self._client.log_dict(self.run_id, target.run_config, "config.yaml")
        (folder / RUN_ID_FILE).write_text(self.run_id)

    def _resumable_run(self, run_id: str | None) -> str | None:
        """`run_id`, set running again, when the store still holds it."""
        from mlflow.exceptions import MlflowException

        if run_id is None:
            return None
        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException:  # the store was deleted or replaced since the id was written
            return None
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in metrics.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


LOGGERS: dict[str, type[StepLogger]] = {  # one per name of config.schema.LOGGER_NAMES
    "jsonl": JsonlLogger,
    "tensorboard": TensorBoardLogger,
    "console": ConsoleLogger,
    "wandb": WandbLogger,
    "mlflow": MlflowLogger,
}


def mlflow_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(Path(run_dir) / 'mlflow' / 'mlflow.db').resolve()}"


def stored_run_id(folder: Path, first_step: int) -> str | None:
    """The run id a resumed run continues; none for a fresh run (`first_step` 0), which starts a new run."""
    path = folder / RUN_ID_FILE
    if first_step > 0 and path.is_file():
        return path.read_text().strip() or None
    return None


def cut_metrics_after(run_dir: Path, step: int) -> None:
    """Keep only metrics.jsonl rows of steps <= `step` (rewritten atomically; a torn last line is dropped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the driver was killed mid-write
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    staged = path.with_suffix(".jsonl.tmp")
    staged.write_text("".join(kept))
    staged.replace(path)


assert sorted(LOGGERS) == sorted(LOGGER_NAMES), "every logging.backends name needs its StepLogger"
