"""Prompt rows from a JSONL/JSON/parquet file, checked row by row: every bad row is named by file and line.

Columns are read through the file's layout (pipelines.data.row_formats: verl, ROLL or plain). Bad rows never train
silently: a line that is not JSON, a row that is not an object, or a row whose prompt or (needed) answer is missing or
null is an error naming the file, the line and the key, unless `data.skip_invalid_rows` asks to skip such rows (their
count is logged and reported as the metric `data/skipped_rows`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_backend.config.schema import DataConfig
from roll_backend.pipelines.data.row_formats import (
    MISSING,
    RowLayout,
    layout_for,
    undeclared_conversation,
    value_at,
)

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MAX_LISTED_PROBLEMS = 10  # a report names this many bad rows, then counts the rest


class DataError(ValueError):
    """The prompt data cannot train as configured; the message names the file, the rows and what to change."""


@dataclass
class Rows:
    """Rows that passed the checks, each {prompt, answer, data_source?, extra_info} (PromptRow keys), where each came
    from ("FILE:LINE"), and how many bad rows were skipped."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    skipped: int = 0


def read_rows(path: str, config: DataConfig, answer_needed: bool = True) -> Rows:
    """The file's rows read through its layout (row_formats: data.format, declared or detected) as PromptRows; the
    answer is required when `answer_needed`. DataError lists the bad rows unless data.skip_invalid_rows."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data.train_path={path!r} does not exist; point it at a JSONL or parquet file.")
    file_format = FILE_FORMATS.get(file.suffix.lower())
    if file_format is None:
        raise DataError(f"data.train_path={path!r} has suffix {file.suffix!r}; use one of {', '.join(FILE_FORMATS)}.")
    raw = _parquet_rows(file) if file_format == "parquet" else _json_rows(file)
    if not raw:
        raise DataError(f"{path} has no rows.")
    objects = [row for _, row in raw if isinstance(row, dict)]
    try:
        layout = layout_for(config, objects[0] if objects else None, path)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    needed = _needed_columns(layout, answer_needed)
    seen_columns = list(dict.fromkeys(key for row in objects for key in row))
    missing = [label for label, options in needed if not any(_has_path(objects, key) for key in options)]
    if missing and seen_columns:  # with no object row at all, the row problems below say more
        raise DataError(
            f"{path}: no column {', '.join(missing)}; columns present: {seen_columns}. Read as the "
            f"{layout.describe()}: set data.prompt_key / data.answer_key (or data.format, data.messages_key) to the "
            "right names."
        )
    result, problems = Rows(), []
    for location, row in raw:
        problem, canonical = _read_row(row, layout, answer_needed, [label for label, _ in needed])
        if problem is None:
            result.rows.append(canonical)
            result.locations.append(location)
        else:
            problems.append(f"{location}: {problem}")
    if problems and not config.skip_invalid_rows:
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


def prompt_row(row: dict[str, Any], layout: RowLayout) -> dict[str, Any]:
    """A row as the datasets hold it: prompt, answer (typed, as stored), data_source (when the row names one) and
    extra_info (the row's other columns, then its own `extra_info` dict, as verl passes it)."""
    skip = layout.consumed()
    info = {key: value for key, value in row.items() if key not in skip}
    if isinstance(row.get("extra_info"), dict):
        info |= row["extra_info"]
    canonical = {"prompt": layout.prompt(row), "answer": layout.answer(row), "extra_info": info}
    if row.get(layout.source_key) is not None:
        canonical["data_source"] = layout.source(row)
    return canonical


def _needed_columns(layout: RowLayout, answer_needed: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(label, paths any of which serves) per column the rows need."""
    prompt = (layout.messages_key, layout.prompt_key) if layout.messages_key else (layout.prompt_key,)
    needed = [(" or ".join(repr(key) for key in prompt), prompt)]
    if answer_needed:
        if layout.answer_key is None:
            raise DataError(
                "data.answer_key is null but the run needs a reference answer (a built-in reward such as math_verify "
                "compares with it; sft trains on it; reward_model and dpo take it as the chosen response); name the "
                "answer column"
            )
        needed.append((repr(layout.answer_key), (layout.answer_key,)))
    return needed


def _has_path(rows: list[dict], path: str) -> bool:
    return any(value_at(row, path) is not MISSING for row in rows)


def _read_row(row: Any, layout: RowLayout, answer_needed: bool, labels: list[str]) -> tuple[str | None, dict | None]:
    """(problem, None) for a row that cannot train, else (None, its PromptRow)."""
    if isinstance(row, _NotJson):
        return f"not valid JSON ({row.message})", None
    if not isinstance(row, dict):
        return f"expected a JSON object with {' and '.join(labels)}, got {type(row).__name__}", None
    try:
        canonical = prompt_row(row, layout)
    except ValueError as exc:  # a conversation column that does not parse
        return str(exc), None
    if canonical["prompt"] is None:
        key = layout.prompt_key
        return (f"no {key!r} key (the row has {sorted(row)})" if key not in row else f"{key!r} is null"), None
    undeclared = undeclared_conversation(canonical["prompt"], layout)
    if undeclared:  # a setting to change, not a bad row: never skipped
        raise DataError(undeclared)
    if answer_needed and canonical["answer"] is None:
        key = layout.answer_key
        absent = value_at(row, key) is MISSING
        return (f"no {key!r} key (the row has {sorted(row)})" if absent else f"{key!r} is null"), None
    return None, canonical


def rows_error(headline: str, problems: list[str], fix: str) -> DataError:
    """One DataError listing the first bad rows (each "LOCATION: problem"), then what to do."""
    listed = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED_PROBLEMS])
    more = f"\n  ... and {len(problems) - MAX_LISTED_PROBLEMS} more" if len(problems) > MAX_LISTED_PROBLEMS else ""
    return DataError(f"{headline}:\n{listed}{more}\n{fix}")


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
