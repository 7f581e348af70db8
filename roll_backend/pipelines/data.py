"""Prompt data: rows from JSONL/parquet (via `datasets`) or a synthetic task, served as deterministic per-step batches.

`batch_at(step, batch_size)` depends only on (seed, step, batch_size), so a run resumed at step k gets exactly
the batch the uninterrupted run had: step k reads rows [k*B, (k+1)*B) of an endless stream made of epochs,
each epoch a permutation drawn from its own seed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from roll_backend import keys
from roll_backend.config.schema import DataConfig
from roll_backend.pipelines.synthetic_tasks import generate_task
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class PromptDataset:
    """Prompts with their reference answers, chat-templated and length-filtered, served as `DataProto` batches.

    PROMPT_TEXT holds chat messages `[{"role": "user", "content": text}]` when `apply_chat_template` (the
    rollout applies the tokenizer's template to them), else the raw text.
    """

    def __init__(self, config: DataConfig, tokenizer, seed: int):
        self.config = config
        self.seed = seed
        rows = _load_rows(config)
        prompts = [_as_prompt(row[config.prompt_key], config.apply_chat_template) for row in rows]
        lengths = [len(_encode(tokenizer, prompt)) for prompt in prompts]
        kept = [index for index, length in enumerate(lengths) if length <= config.max_prompt_length]
        if not kept:
            raise ValueError(
                f"all {len(rows)} prompts are longer than data.max_prompt_length={config.max_prompt_length} tokens "
                f"(shortest: {min(lengths)} tokens{' with the chat template' if config.apply_chat_template else ''}); "
                f"raise data.max_prompt_length to at least {min(lengths)}."
            )
        if len(kept) < len(rows):
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (longest: %d)",
                len(rows) - len(kept), len(rows), config.max_prompt_length, max(lengths),
            )
        self.prompts = _object_column([prompts[index] for index in kept])  # [N] str or list of messages
        self.answers = _object_column([str(rows[index][config.answer_key]) for index in kept])  # [N] str

    def __len__(self) -> int:
        return len(self.prompts)

    def indices_at(self, step: int, batch_size: int) -> np.ndarray:
        """Row indices of step `step`'s batch: positions [step*B, (step+1)*B) of the epoch-by-epoch stream."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"batch_at needs step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}.")
        start = step * batch_size
        positions = np.arange(start, start + batch_size)
        epochs, offsets = np.divmod(positions, len(self))
        return np.array([self._epoch_order(int(epoch))[offset] for epoch, offset in zip(epochs, offsets)], dtype=np.int64)

    def batch_at(self, step: int, batch_size: int) -> DataProto:
        """The prompts of step `step`: non-tensor PROMPT_TEXT and ANSWER, [batch_size] each."""
        indices = self.indices_at(step, batch_size)
        return DataProto.from_dict(
            non_tensors={keys.PROMPT_TEXT: self.prompts[indices], keys.ANSWER: self.answers[indices]},
            meta_info={"step": step},
        )

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.config.shuffle:
            return np.arange(len(self))
        # One generator per (seed, epoch): the order of epoch e never depends on which steps ran before.
        return np.random.default_rng([self.seed, epoch]).permutation(len(self))


def _load_rows(config: DataConfig) -> list[dict[str, Any]]:
    """Rows with the prompt and answer columns, from `train_path` or the synthetic task."""
    if config.train_path is not None:
        return _read_file(config.train_path, config.prompt_key, config.answer_key)
    if config.synthetic is not None:
        synthetic = config.synthetic
        return generate_task(synthetic.task, synthetic.num_prompts, synthetic.seed)
    raise ValueError("no prompts: set data.train_path (JSONL or parquet) or data.synthetic.")


def _read_file(path: str, prompt_key: str, answer_key: str) -> list[dict[str, Any]]:
    import datasets

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data.train_path={path!r} does not exist; point it at a JSONL or parquet file.")
    file_format = FILE_FORMATS.get(file.suffix.lower())
    if file_format is None:
        raise ValueError(f"data.train_path={path!r} has suffix {file.suffix!r}; use one of {', '.join(FILE_FORMATS)}.")
    table = datasets.load_dataset(file_format, data_files=str(file), split="train")
    missing = [key for key in (prompt_key, answer_key) if key not in table.column_names]
    if missing:
        raise ValueError(
            f"{path}: no column {', '.join(repr(key) for key in missing)}; columns present: {table.column_names}. "
            f"Set data.prompt_key / data.answer_key to the right names."
        )
    if len(table) == 0:
        raise ValueError(f"{path} has no rows.")
    return table.select_columns([prompt_key, answer_key]).to_list()


def _as_prompt(text: Any, apply_chat_template: bool) -> str | list[dict[str, str]]:
    """Chat messages for the rollout's template, or the raw text. A prompt already given as messages is kept."""
    if isinstance(text, list):
        return [dict(message) for message in text]
    return [{"role": "user", "content": str(text)}] if apply_chat_template else str(text)


def _encode(tokenizer, prompt: str | Sequence[dict[str, str]]) -> list[int]:
    """Token ids as the rollout will see them (strategies/vllm_rollout.py: encode_prompt)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)  # 1-D even when the entries are lists of messages
    for index, value in enumerate(values):
        column[index] = value
    return column
