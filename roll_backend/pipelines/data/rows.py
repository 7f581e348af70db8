"""Prompt rows from a JSONL/JSON/parquet file, checked row by row: every bad row is named by file and line.

Bad rows never train silently: a line that is not JSON, a row that is not an object, or a row whose prompt or
answer is missing or null is an error naming the file, the line and the key, unless `data.skip_invalid_rows`
asks to skip such rows (their count is logged and reported as the metric `data/skipped_rows`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MAX_LISTED_PROBLEMS = 10  # a report names this many bad rows, then counts the rest


class DataError(ValueError):
    """The prompt data cannot train as configured; the message names the file, the rows and what to change."""


@dataclass
class Rows:
    """Rows that passed the checks, where each came from ("FILE:LINE"), and how many bad rows were skipped."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    skipped: int = 0


def read_rows(path: str, prompt_key: str, answer_key: str, skip_invalid_rows: bool = False) -> Rows:
    """The file's rows with non-null `prompt_key` and `answer_key`; DataError lists the bad ones unless skipped."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data.train_path={path!r} does not exist; point it at a JSONL or parquet file.")
    file_format = FILE_FORMATS.get(file.suffix.lower())
    if file_format is None:
        raise DataError(f"data.train_path={path!r} has suffix {file.suffix!r}; use one of {', '.join(FILE_FORMATS)}.")
    raw = _parquet_rows(file) if file_format == "parquet" else _json_rows(file)
    if not raw:
        raise DataError(f"{path} has no rows.")
    keys = (prompt_key, answer_key)
    seen_columns = list(dict.fromkeys(key for _, row in raw if isinstance(row, dict) for key in row))
    missing = [key for key in keys if key not in seen_columns]
    if missing and seen_columns:  # with no object row at all, the row problems below say more
        raise DataError(
            f"{path}: no column {', '.join(repr(key) for key in missing)}; columns present: "
            f"{seen_columns}. Set data.prompt_key / data.answer_key to the right names."
        )
    result, problems = Rows(), []
    for location, row in raw:
        problem = _row_problem(row, keys)
        if problem is None:
            result.rows.append(dict(row))  # every column: the other ones reach reward functions (extra_info)
            result.locations.append(location)
        else:
            problems.append(f"{location}: {problem}")
    if problems and not skip_invalid_rows:
        raise rows_error(
            f"{path}: {len(problems)} of {len(raw)} rows cannot train",
            problems,
            "Fix those rows, or set data.skip_invalid_rows=true to skip them (the count is logged and reported "
            "as the metric data/skipped_rows).",
        )
    if problems:
        logger.warning(
            "data.skip_invalid_rows: skipped %d of %d rows of %s (first: %s)",
            len(problems),
            len(raw),
            path,
            problems[0],
        )
        result.skipped = len(problems)
    if not result.rows:
        raise DataError(f"{path}: all {len(raw)} rows are invalid (first: {problems[0]}); nothing is left to train on.")
    return result


def rows_error(headline: str, problems: list[str], fix: str) -> DataError:
    """One DataError listing the first bad rows (each "LOCATION: problem"), then what to do."""
    listed = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED_PROBLEMS])
    more = f"\n  ... and {len(problems) - MAX_LISTED_PROBLEMS} more" if len(problems) > MAX_LISTED_PROBLEMS else ""
    return DataError(f"{headline}:\n{listed}{more}\n{fix}")


def _row_problem(row: Any, keys: tuple[str, str]) -> str | None:
    if isinstance(row, _NotJson):
        return f"not valid JSON ({row.message})"
    if not isinstance(row, dict):
        return f"expected a JSON object with {' and '.join(repr(k) for k in keys)}, got {type(row).__name__}"
    for key in keys:
        if key not in row:
            return f"no {key!r} key (the row has {sorted(row)})"
        if row[key] is None:
            return f"{key!r} is null"
    return None


@dataclass(frozen=True)
class _NotJson:
    message: str


def _json_rows(file: Path) -> list[tuple[str, Any]]:
    """(FILE:LINE, parsed row or _NotJson) per non-blank line; a .json file holding one array gives its items."""
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        return [(f"{file}: item {index}", item) for index, item in enumerate(items)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"{file}:{number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            rows.append((f"{file}:{number}", _NotJson(f"{exc.msg} at column {exc.colno}")))
    return rows


def _parquet_rows(file: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{file}: cannot be read as parquet ({type(exc).__name__}: {exc})") from None
    return [(f"{file}: row {index + 1}", row) for index, row in enumerate(table.to_pylist())]


def dropped_characters(tokenizer, texts: list[str]) -> list[str]:
    """The characters of `texts` that `tokenizer` encodes to no token at all, i.e. drops silently (a char
    tokenizer does this with anything outside its alphabet: "larger" would train as "arer")."""
    chars = sorted({char for text in texts for char in text})
    return [char for char in chars if not char.isspace() and not tokenizer.encode(char, add_special_tokens=False)]
