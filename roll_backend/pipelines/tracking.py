"""Per-step metrics: phase timers, JSONL and TensorBoard writers, and a tqdm progress bar."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from roll_backend.config.schema import LoggingConfig


class PhaseTimer:
    """Wall time of each phase of a step, reported as `timing/<phase>` seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{name}": value for name, value in self.seconds.items()}


class MetricsTracker:
    """Writes one JSON line per step to `run_dir/metrics.jsonl` and the same scalars to TensorBoard."""

    def __init__(self, run_dir: Path, config: LoggingConfig, total_steps: int, first_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a") if config.jsonl else None
        self._tensorboard = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
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
            self._progress.set_postfix(shown)
            self._progress.update(1)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._progress is not None:
            self._progress.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of a run (for plots and tests)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
