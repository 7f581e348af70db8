"""The prompt ledger: every prompt-stream position a run admits, and what became of it.

A position is a prompt's place in the run's data stream (step k's batch is positions [k*B, (k+1)*B); dynamic sampling's
refill prompts get positions of their own, from REFILL_BASE up). Events, in the order they happen:

    admitted                 generation of it started (again, after a regeneration or a resume)
    trained                  its group was in the batch of a training step
    filtered                 dynamic sampling dropped it (its samples all scored alike, or the batch was full)
    dropped_stale            streaming: older than max_staleness when the trainer took it (on_stale: drop)
    regenerate               streaming: older than max_staleness, queued to be generated again (on_stale: regenerate)
    skipped_by_guard         a run guard skipped the update of its batch
    in_flight_at_checkpoint  being generated when a checkpoint was taken: a resumed run generates it again
    unfinished_at_end        generated or buffered when the run ended (streaming's look-ahead)

The ledger lives in `output_dir/ledger.jsonl`, one line per flush ({"step": k, "<event>": [positions], ...}); every
checkpoint holds a copy, and a resumed run starts from the copy of the checkpoint it resumes from, so the events of
steps it redoes are not counted twice. `report` (and `roll-backend ledger RUN_DIR`) checks that each admitted position
was trained exactly once or has a reason why not.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

LEDGER_FILE = "ledger.jsonl"
EVENTS = (
    "admitted",
    "trained",
    "filtered",
    "dropped_stale",
    "regenerate",
    "skipped_by_guard",
    "in_flight_at_checkpoint",
    "unfinished_at_end",
)
# Events after which a position needs nothing more (the others wait for its next admission).
SETTLED = ("trained", "filtered", "dropped_stale", "skipped_by_guard", "unfinished_at_end")
REFILL_BASE = 1 << 62  # refill prompt (step, round, row): REFILL_BASE + ((step * MAX_ROUNDS + round) << 20) + row


def refill_positions(step: int, round_index: int, max_rounds: int, count: int) -> list[int]:
    base = REFILL_BASE + ((step * max_rounds + round_index) << 20)
    return list(range(base, base + count))


class PromptLedger:
    """The run's ledger: `record(event, positions)` from the loops (thread-safe: streaming's pump admits),
    `flush(step)` once a step is logged (returns the step's `ledger/<event>` counts), `save_to` a checkpoint folder;
    `begin` before the first step."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LEDGER_FILE
        self.pending: dict[str, list[int]] = {}
        self.lock = threading.Lock()

    def record(self, event: str, positions: Iterable[int]) -> None:
        positions = [int(p) for p in positions]
        if positions:
            with self.lock:
                self.pending.setdefault(event, []).extend(positions)

    def flush(self, step: int) -> dict[str, float]:
        with self.lock:
            pending, self.pending = self.pending, {}
        if pending:
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, **pending}) + "\n")
        return {f"ledger/{event}": float(len(positions)) for event, positions in pending.items()}

    def save_to(self, folder: Path) -> None:
        if self.path.is_file():
            shutil.copyfile(self.path, folder / LEDGER_FILE)

    def begin(self, checkpoint: Path | None) -> bool:
        """Before a run's first step: continue from the copy in the checkpoint it resumed from (the events of the
        steps it redoes go), else start empty (a ledger another run left in the folder is not this one's). False when
        the checkpoint has no copy (written before ledgers existed): the ledger then starts at its step."""
        saved = None if checkpoint is None else Path(checkpoint) / LEDGER_FILE
        if saved is not None and saved.is_file():
            shutil.copyfile(saved, self.path)
            return True
        self.path.write_text("")
        return checkpoint is None


def read_events(path: str | Path) -> list[tuple[int, str, int]]:
    """(step, event, position) in the order recorded; a torn last line (a killed driver) is left out."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        events += [(row["step"], event, p) for event in EVENTS for p in row.get(event, [])]
    return events


def report(run_dir: str | Path) -> tuple[str, list[str]]:
    """(a summary of the run's ledger, its problems): a position trained more than once, or admitted and then neither
    trained nor given a reason."""
    path = Path(run_dir) / LEDGER_FILE
    if not path.is_file():
        return f"no {LEDGER_FILE} in {run_dir}", [f"{path} does not exist: is {run_dir} a run's output_dir?"]
    events = read_events(path)
    trained: Counter = Counter()
    last: dict[int, tuple[str, int]] = {}
    for step, event, position in events:
        if event == "trained":
            trained[position] += 1
        last[position] = (event, step)
    problems = [
        f"position {p} was trained {n} times (last at step {last[p][1]})" for p, n in sorted(trained.items()) if n > 1
    ]
    open_ = sorted(p for p, (event, _) in last.items() if event not in SETTLED)
    problems += [f"position {p}: last '{last[p][0]}' at step {last[p][1]}, then nothing" for p in open_]
    main = [p for p in last if p < REFILL_BASE]
    fates = Counter(last[p][0] for p in last)
    steps = [step for step, _, _ in events]
    summary = (
        f"{len(last)} positions ({len(main)} of the data stream, {len(last) - len(main)} refill) over steps "
        f"{min(steps, default=0)}-{max(steps, default=0)}: "
        + ", ".join(f"{event} {fates[event]}" for event in EVENTS if fates[event])
        + f"; {sum(1 for n in trained.values() if n == 1)} trained exactly once"
    )
    return summary, problems


def positions_of(batch) -> list[int]:
    """The distinct stream positions of a batch's rows (keys.STREAM_POSITION), sorted."""
    from roll_backend import keys

    if len(batch) == 0 or batch.batch is None or keys.STREAM_POSITION not in batch.batch.keys():
        return []
    return sorted(set(batch.batch[keys.STREAM_POSITION].tolist()))


def admit_prompts(prompts, positions: list[int], ledger: PromptLedger | None):
    """`prompts` tagged with their stream positions (keys.STREAM_POSITION, carried to every sample) and recorded as
    admitted."""
    import torch

    from roll_backend import keys

    tagged = prompts.union(
        type(prompts).from_dict(tensors={keys.STREAM_POSITION: torch.as_tensor(positions, dtype=torch.int64)})
    )
    if ledger is not None:
        ledger.record("admitted", positions)
    return tagged
