"""Which columns of a prompt file hold what: verl's, ROLL's and the plain layout, declared (`data.format`) or detected.

- verl (RL parquet): `prompt` a list of chat messages, `data_source`, `reward_model: {style, ground_truth}`,
  `extra_info` a dict. The answer is `reward_model.ground_truth`, kept as it is (a list of tests stays a list).
- roll (RLVR JSONL): `messages` the conversation as a JSON string (system prompt included), `ground_truth`, `tag`
  (the reward domain, the row's source here), and `prompt` the user text alone.
- plain: `prompt` text or messages, `answer`, optional `data_source`.

`data.prompt_key` / `answer_key` (when changed from their defaults), `messages_key` and `source_key` override the
layout's columns; an answer key may be a dotted path into a dict column (`reward_model.ground_truth`).
A string column that parses as a conversation is never silently one user message: undeclared, it is an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from roll_backend.config.schema import DATA_FORMATS as FORMATS
from roll_backend.config.schema import DataConfig

logger = logging.getLogger(__name__)

MISSING = object()  # a path that is not in the row


@dataclass(frozen=True)
class RowLayout:
    """The columns one file's rows are read from."""

    format: str  # verl | roll | plain
    prompt_key: str  # the prompt as text or a message list
    messages_key: str | None  # the conversation as a JSON string (parsed; wins over prompt_key where present)
    answer_key: str | None  # the reference answer (a column or a dotted path into one); None: rows have none
    source_key: str  # the row's source (reward dispatch, per-source metrics)

    def describe(self) -> str:
        prompt = (
            f"messages JSON {self.messages_key!r}, else {self.prompt_key!r}"
            if self.messages_key
            else repr(self.prompt_key)
        )
        answer = repr(self.answer_key) if self.answer_key else "none"
        return f"{self.format} format (prompt: {prompt}; answer: {answer}; source: {self.source_key!r})"

    def consumed(self) -> set[str]:
        """Top-level columns the layout reads; the others reach reward functions in extra_info."""
        used = {self.prompt_key, self.source_key, "extra_info"}
        if self.messages_key:
            used.add(self.messages_key)
        if self.answer_key:
            used.add(self.answer_key.split(".")[0])
        return used

    def prompt(self, row: dict) -> Any:
        """The row's prompt: the parsed conversation, else the prompt column's text or messages."""
        if self.messages_key and self.messages_key in row and row[self.messages_key] is not None:
            return parse_conversation(row[self.messages_key], self.messages_key)
        return row.get(self.prompt_key)

    def answer(self, row: dict) -> Any:
        """The reference answer as stored (None when the layout has none or the row lacks it)."""
        if not self.answer_key:
            return None
        value = value_at(row, self.answer_key)
        return None if value is MISSING else value

    def source(self, row: dict, default: str = "") -> str:
        value = row.get(self.source_key)
        return default if value is None else str(value)


LAYOUTS = {
    "verl": RowLayout("verl", "prompt", None, "reward_model.ground_truth", "data_source"),
    "roll": RowLayout("roll", "prompt", "messages", "ground_truth", "tag"),
    "plain": RowLayout("plain", "prompt", None, "answer", "data_source"),
}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(DataConfig)}


def value_at(row: dict, path: str) -> Any:
    """row[path] when that column exists, else the value at a dotted path through dicts; MISSING when absent."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def detect_format(row: dict) -> str:
    """verl when `reward_model` is a dict; roll when `messages` is a JSON-string conversation; plain otherwise."""
    if isinstance(row.get("reward_model"), dict):
        return "verl"
    if isinstance(row.get("messages"), str) and looks_like_conversation(row["messages"]):
        return "roll"
    return "plain"


def layout_for(config: DataConfig, first_row: dict | None, path: str) -> RowLayout:
    """The layout of one file: `data.format` (or the detected one, said in the log) with the config's overrides."""
    if config.format not in FORMATS:
        raise ValueError(f"data.format={config.format!r}; choose one of {', '.join(FORMATS)}")
    name = config.format
    if name == "auto":
        name = detect_format(first_row or {})
    layout = LAYOUTS[name]
    changes = {
        key: getattr(config, key) for key in ("prompt_key", "answer_key") if getattr(config, key) != _DEFAULTS[key]
    }
    if config.messages_key is not None:
        changes["messages_key"] = config.messages_key
    if config.source_key is not None:
        changes["source_key"] = config.source_key
    layout = dataclasses.replace(layout, **changes)
    if config.format == "auto" and name != "plain":
        logger.info("data: %s read as %s; set data.format to choose another", path, layout.describe())
    return layout


def is_message_list(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def looks_like_conversation(text: str) -> bool:
    """A string holding a JSON list of {role, content} messages."""
    if not text.lstrip().startswith("["):
        return False
    try:
        return is_message_list(json.loads(text))
    except (json.JSONDecodeError, RecursionError):
        return False


def parse_conversation(value: Any, column: str) -> list[dict]:
    """A conversation column's messages (a JSON string or an already parsed list); ValueError naming the column."""
    messages = value
    if isinstance(value, str):
        try:
            messages = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"column {column!r} is not a JSON conversation ({exc.msg} at column {exc.colno})"
            ) from None
    if not is_message_list(messages):
        raise ValueError(f"column {column!r} is not a list of {{role, content}} messages: {str(value)[:80]!r}")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]


def undeclared_conversation(prompt: Any, layout: RowLayout) -> str | None:
    """The problem with a prompt string that is a JSON conversation nobody declared as one (None if it is not)."""
    if isinstance(prompt, str) and looks_like_conversation(prompt):
        return (
            f"column {layout.prompt_key!r} holds a conversation as a JSON string ({prompt[:60]!r}...); it would "
            f"train as one user message. Declare it: data.messages_key={layout.prompt_key} (or data.format=roll for "
            "ROLL's `messages` column)"
        )
    return None
