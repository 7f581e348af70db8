"""Run checkpoints: one folder per saved step, staged under a temporary name, sealed by a manifest and renamed; a
resume loads only a checkpoint whose files still match its manifest.

A checkpoint is `output_dir/checkpoints/step_N/` holding the roles' folders (`actor/`, `critic/`: every rank's
shards), `driver_state.json`, in asynchronous mode `next_batch.dataproto`, and `manifest.json`, written last:

    {"version": 1, "files": {"actor/__0_0.distcp": {"size": 52316, "blake2b": "9f0c..."},
                             "actor/big_shard.distcp": {"size": 9663676416, "blake2b_ends": "51aa..."}, ...}}

Every file of the folder (relative path, '/'-separated) has its size. Files up to FULL_HASH_BYTES (64 MiB: driver
state, dist_checkpointing's metadata and common state, the shards of small models) also have a blake2b digest of
their whole content; larger ones the digest of their first and last 8 MiB only (`blake2b_ends`), so sealing or
checking a checkpoint reads at most 16 MiB of each big shard and costs seconds, not minutes, on multi-GB
checkpoints. What kills, full disks and unfinished copies leave behind (missing or truncated files, a half-written
head or tail) is caught; a changed byte in the middle of a big shard is not: the ranks then load it as it is (a
tensor's bytes are not checked again) or fail, and `loading` turns such a failure into an error naming the
checkpoint and the files to suspect.

A folder without a manifest, or whose files disagree with it, is incomplete: `resume=auto` skips it with a warning
naming the file, an explicit `resume=<folder>` is refused (CheckpointError). Checkpoints written before manifests
existed (issue #27) count as incomplete too. `resume_checkpoint` makes this choice; `roll-backend run` and
`validate` call it on the driver before Ray starts, and the run calls it again when it resumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from roll_backend.errors import NotRestartableError

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
DRIVER_STATE = "driver_state.json"
NEXT_BATCH = "next_batch.dataproto"  # asynchronous mode: the batch generated for the step after the checkpoint
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
FULL_HASH_BYTES = 64 << 20  # files up to this size are hashed whole; larger ones by their first and last block
HASH_BLOCK_BYTES = 8 << 20
HASH_THREADS = 8  # hashlib releases the GIL on large blocks: shards are read and hashed in parallel


class CheckpointError(NotRestartableError):
    """A checkpoint that cannot be resumed from: incomplete (the message names the folder and the file) or failing
    to load on the ranks. A restart would pick the same one, so the run stops instead."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


# ---- manifest ---------------------------------------------------------------------------------------------
def _digest(path: Path, size: int) -> tuple[str, str]:
    """(record key, hex digest): the whole file when it is small, else its first and last HASH_BLOCK_BYTES."""
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as file:
        if size <= FULL_HASH_BYTES:
            while block := file.read(HASH_BLOCK_BYTES):
                digest.update(block)
            return "blake2b", digest.hexdigest()
        digest.update(file.read(HASH_BLOCK_BYTES))
        file.seek(max(size - HASH_BLOCK_BYTES, 0))
        digest.update(file.read(HASH_BLOCK_BYTES))
        return "blake2b_ends", digest.hexdigest()


def _record(path: Path) -> dict:
    size = path.stat().st_size
    key, digest = _digest(path, size)
    return {"size": size, key: digest}


def write_manifest(folder: Path) -> dict:
    """List every file of `folder` (all ranks' shards included) with its size and digest in folder/manifest.json;
    returns the manifest."""
    names = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    names = [name for name in names if name != MANIFEST]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        records = list(pool.map(_record, [folder / name for name in names]))
    manifest = {"version": MANIFEST_VERSION, "files": dict(zip(names, records))}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _read_manifest(folder: Path) -> dict[str, dict]:
    """The manifest's {file: record}; ValueError when it is not one `write_manifest` wrote."""
    manifest = json.loads((folder / MANIFEST).read_text())
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("size"), int) for r in files.values()
    ):
        raise ValueError("no 'files' table of {file: {size, digest}}")
    return files


def _file_problem(folder: Path, name: str, record: dict) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name} is missing (its manifest lists {record['size']} bytes)"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{name} has {size} bytes, its manifest says {record['size']} (truncated or overwritten)"
    key, digest = _digest(path, size)
    if record.get(key) != digest:
        return f"{name} has the recorded size but other content than its manifest's {key} digest (damaged)"
    return None


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why `folder` is not a complete checkpoint (naming the file at fault), or None when every file its manifest
    lists is there with the recorded size and digest."""
    folder = Path(folder)
    if not folder.is_dir():
        return "it does not exist" if not folder.exists() else "it is not a folder"
    if not (folder / MANIFEST).is_file():
        return (
            f"it has no {MANIFEST}: its save did not finish, or it was written before checkpoints had manifests "
            f"(issue #27), so nothing says its files are whole"
        )
    try:
        files = _read_manifest(folder)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        return f"its {MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        problems = pool.map(lambda item: _file_problem(folder, *item), sorted(files.items()))
        return next((problem for problem in problems if problem is not None), None)


# ---- choosing the checkpoint to resume from -----------------------------------------------------------------
def _step_folders(output_dir: str | Path) -> list[Path]:
    """Committed checkpoint folders (no `.tmp` staging folders), newest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    steps = ((int(m.group(1)), path) for path in root.iterdir() if (m := STEP_DIR.match(path.name)))
    return [path for _, path in sorted(steps, reverse=True)]


def newest_complete_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest complete checkpoint or None, [(newer folder skipped, why)]); logs nothing."""
    skipped = []
    for folder in _step_folders(output_dir):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, skipped
        skipped.append((folder, problem))
    return None, skipped


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir (what `resume=auto` loads); each newer folder it passes
    over is logged as a warning with the reason, naming the file."""
    chosen, skipped = newest_complete_checkpoint(output_dir)
    for folder, problem in skipped:
        logger.warning("resume=auto skips checkpoint %s: %s", folder, problem)
    return chosen


def resume_checkpoint(resume: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint a run with `checkpoint.resume=resume` loads (None: it starts from step 1), logging the choice
    and what auto skipped. An explicit folder that is not a complete checkpoint raises CheckpointError naming the
    folder and the file."""
    if not resume:
        return None
    if resume != "auto":
        verify_checkpoint(resume)
        logger.info("resume: the run resumes from %s", resume)
        return Path(resume)
    chosen = latest_checkpoint(output_dir)
    if chosen is None:
        logger.info(
            "resume=auto: no complete checkpoint under %s; the run starts from step 1", checkpoint_root(output_dir)
        )
    else:
        logger.info("resume=auto: the run resumes from %s", chosen)
    return chosen


def verify_checkpoint(folder: str | Path) -> None:
    """Raise CheckpointError unless `folder` is a complete checkpoint (manifest present, every file matching)."""
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {folder} is not complete: {problem}. Resume from an older complete checkpoint "
            f"(checkpoint.resume=<output_dir>/checkpoints/step_N) or use checkpoint.resume=auto, which takes the "
            f"newest complete one"
        )


def _suspects(folder: Path, rank_message: str) -> str:
    """Which files of `folder` to suspect when a rank failed to load it although the manifest check passed."""
    try:
        files = _read_manifest(folder)
    except (OSError, ValueError):
        return "its manifest could not be read again"
    named = [name for name in files if PurePosixPath(name).name in rank_message]
    if named:
        return f"the rank's error names {', '.join(named)}"
    big = [name for name, record in files.items() if "blake2b_ends" in record]
    if big:
        return (
            f"the manifest checks only the size, head and tail of {len(big)} big file(s) ({', '.join(big[:4])}"
            f"{', ...' if len(big) > 4 else ''}): damage in the middle of one of them is not seen before loading"
        )
    return (
        "every file matches its manifest's digest of its whole content, so the files are as they were saved: the "
        "checkpoint does not fit this run (another model, or a layout or code that reads it differently)"
    )


@contextlib.contextmanager
def loading(folder: str | Path) -> Iterator[None]:
    """Around the ranks' loads of `folder`: a rank that raises while loading (damage its manifest cannot see, a
    checkpoint of another model) becomes a CheckpointError naming the folder and the files to suspect (a restart
    would load the same one)."""
    from roll_backend.distributed.worker_group import RankRaisedError

    try:
        yield
    except RankRaisedError as exc:
        if not exc.restartable:
            raise
        raise CheckpointError(
            f"loading checkpoint {folder} failed although its files match its manifest: {exc}. Suspect: "
            f"{_suspects(Path(folder), str(exc))}. Resume from an older checkpoint "
            f"(checkpoint.resume=<output_dir>/checkpoints/step_N)"
        ) from exc


# ---- saving -----------------------------------------------------------------------------------------------
def staging_dir(output_dir: str | Path, step: int) -> Path:
    """Where role checkpoints for `step` are written before `commit_checkpoint` publishes them."""
    path = checkpoint_root(output_dir) / f"step_{step}.tmp"
    if path.exists():
        shutil.rmtree(path)  # left over from a save that was killed
    path.mkdir(parents=True)
    return path


def commit_checkpoint(staged: Path, driver_state: dict, keep_last: int) -> Path:
    """Write the driver's state, then the manifest (last), then atomically rename the staged folder; prune old
    checkpoints: of those up to this step, the newest `keep_last` stay. Later ones (left by a run this one resumed
    before, e.g. a damaged one auto skipped) do not count, so they never push out the checkpoint just written;
    the run replaces them when it saves their step."""
    (staged / DRIVER_STATE).write_text(json.dumps(driver_state))
    write_manifest(staged)
    final = staged.with_name(staged.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    step = int(STEP_DIR.match(final.name).group(1))
    steps = sorted(int(m.group(1)) for p in final.parent.iterdir() if (m := STEP_DIR.match(p.name)))
    older = [s for s in steps if s <= step]
    for old in older[: max(0, len(older) - keep_last)]:
        shutil.rmtree(final.parent / f"step_{old}", ignore_errors=True)
    return final


def load_driver_state(checkpoint: str | Path) -> dict:
    """The driver's state saved with `checkpoint` (one `resume_checkpoint` or `latest_checkpoint` chose: this reads,
    it does not check the other files again)."""
    path = Path(checkpoint) / DRIVER_STATE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {checkpoint} is not complete: it has no {DRIVER_STATE}. Resume from another "
            f"checkpoint or use checkpoint.resume=auto"
        )
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
