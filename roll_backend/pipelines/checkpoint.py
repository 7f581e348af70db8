"""Run checkpoints: one folder per saved step, written under a temporary name and renamed when complete,
so a kill while saving leaves the previous checkpoint as the latest loadable one."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d+)$")
DRIVER_STATE = "driver_state.json"
NEXT_BATCH = "next_batch.dataproto"  # asynchronous mode: the batch generated for the step after the checkpoint


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder (half-written `.tmp` folders are ignored)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / DRIVER_STATE).is_file()]
    return max(steps)[1] if steps else None


def staging_dir(output_dir: str | Path, step: int) -> Path:
    """Where role checkpoints for `step` are written before `commit_checkpoint` publishes them."""
    path = checkpoint_root(output_dir) / f"step_{step}.tmp"
    if path.exists():
        shutil.rmtree(path)  # left over from a save that was killed
    path.mkdir(parents=True)
    return path


def commit_checkpoint(staged: Path, driver_state: dict, keep_last: int) -> Path:
    """Write the driver's state, then atomically rename the staged folder; prune old checkpoints."""
    (staged / DRIVER_STATE).write_text(json.dumps(driver_state))
    final = staged.with_name(staged.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    steps = sorted(int(m.group(1)) for p in final.parent.iterdir() if (m := STEP_DIR.match(p.name)))
    for old in steps[: max(0, len(steps) - keep_last)]:
        shutil.rmtree(final.parent / f"step_{old}", ignore_errors=True)
    return final


def load_driver_state(checkpoint: Path) -> dict:
    path = Path(checkpoint) / DRIVER_STATE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no {DRIVER_STATE}); pick another or resume=auto")
    return json.loads(path.read_text())


def driver_rng_state() -> dict:
    """Python, numpy and torch RNG states of the driver, JSON-serialisable (no pickle)."""
    np_state = np.random.get_state()
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_driver_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys_, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys_, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
