"""Per-step metrics: phase timers, JSONL and TensorBoard writers, and a tqdm progress bar."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from roll_backend import roles
from roll_backend.config.schema import LoggingConfig, PhaseTimeouts
from roll_backend.distributed.deadlines import deadline_scope


def phase_deadline(timeouts: PhaseTimeouts | None, name: str):
    """A deadline scope for every group call of phase (or deadline) `name` (none without `timeouts`)."""
    key = roles.deadline_of(name)
    seconds = getattr(timeouts, key, None) if timeouts is not None else None
    return deadline_scope(seconds, f"phase '{name}' (fault_tolerance.timeouts.{key})")


PROGRESS_MFU = ("perf/generate_mfu", "perf/train_mfu")  # shown in the progress bar next to reward and loss


class PhaseTimer:
    """Wall time of each phase of a step, reported as `timing/<phase>` seconds; with `timeouts`, each phase's
    group calls together must finish within its deadline."""

    def __init__(self, timeouts: PhaseTimeouts | None = None):
        self.seconds: dict[str, float] = {}
        self.timeouts = timeouts

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            with phase_deadline(self.timeouts, name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{name}": value for name, value in self.seconds.items()}


class MetricsTracker:
    """Writes one JSON line per step to `run_dir/metrics.jsonl` and the same scalars to TensorBoard.

    `first_step` is 0 for a fresh run, else the step the run resumes after: rows of later steps (written before a
    crash or restart) are cut from metrics.jsonl and purged from TensorBoard, so every step appears once."""

    def __init__(self, run_dir: Path, config: LoggingConfig, total_steps: int, first_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = None
        if config.jsonl:
            cut_metrics_after(self.run_dir, first_step)
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        self._tensorboard = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides events of this step and later from earlier writers of the folder.
            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=first_step + 1)
        self._progress = None
        if config.progress_bar:
            from tqdm import tqdm

            self._progress = tqdm(total=total_steps, initial=first_step, desc="steps", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in record.items():
                if name != "step":
                    self._tensorboard.add_scalar(name, value, step)
        if self._progress is not None:
            shown = {k: f"{record[k]:.3f}" for k in ("reward/mean", "actor/pg_loss") if k in record}
            shown |= {k.split("/")[1].replace("_mfu", " mfu"): f"{record[k]:.0%}" for k in PROGRESS_MFU if k in record}
            self._progress.set_postfix(shown)
            self._progress.update(1)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._progress is not None:
            self._progress.close()


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


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of a run (for plots and tests)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
