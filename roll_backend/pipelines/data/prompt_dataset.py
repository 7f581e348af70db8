"""Prompt data: rows from JSONL/parquet (via `datasets`) or a synthetic task, served as deterministic per-step batches.

`batch_at(step, batch_size)` depends only on (seed, step, batch_size), so a run resumed at step k gets exactly
the batch the uninterrupted run had: step k reads rows [k*B, (k+1)*B) of an endless stream made of epochs,
each epoch a permutation drawn from its own seed. No sampler state is needed in a checkpoint. Several files mixed
by weight (data.train_path as a list) are a PromptMixture (pipelines.data_mixture), built on one PromptDataset each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from roll_backend import keys
from roll_backend.config.schema import DataConfig, PipelineConfig
from roll_backend.pipelines.data.procedural_tasks import reasoning_gym_rows
from roll_backend.pipelines.data.row_formats import LAYOUTS
from roll_backend.pipelines.data.rows import DataError, Rows, dropped_characters, prompt_row, read_rows, rows_error
from roll_backend.pipelines.data.synthetic_tasks import generate_task
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)


class PromptDataset:
    """Prompts with their reference answers, chat-templated and length-filtered, served as `DataProto` batches.

    PROMPT_TEXT holds chat messages `[{"role": "user", "content": text}]` when `apply_chat_template` (the
    rollout applies the tokenizer's template to them), else the raw text.
    """

    def __init__(
        self,
        config: DataConfig,
        tokenizer,
        seed: int,
        order_key: tuple[int, ...] = (),
        answer_needed: bool = True,
    ):
        self.config = config
        self.seed = seed
        self.order_key = order_key  # joins the seed of each epoch's order: a mixture's files shuffle independently
        loaded = _load_rows(config, answer_needed)
        rows = loaded.rows  # PromptRows (pipelines.data.rows): prompt, answer, data_source?, extra_info
        self.skipped_rows = loaded.skipped  # bad rows skipped under data.skip_invalid_rows
        _check_encodable(tokenizer, [row["prompt"] for row in rows], loaded.locations)
        prompts = [_as_prompt(row["prompt"], config.apply_chat_template) for row in rows]
        lengths = [len(encode_prompt(tokenizer, prompt)) for prompt in prompts]
        kept = [index for index, length in enumerate(lengths) if length <= config.max_prompt_length]
        if not kept:
            raise DataError(
                f"all {len(rows)} prompts are longer than data.max_prompt_length={config.max_prompt_length} tokens "
                f"(shortest: {min(lengths)} tokens{' with the chat template' if config.apply_chat_template else ''}); "
                f"raise data.max_prompt_length to at least {min(lengths)}."
            )
        if len(kept) < len(rows):
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (longest: %d)",
                len(rows) - len(kept),
                len(rows),
                config.max_prompt_length,
                max(lengths),
            )
        self.prompts = _object_column([prompts[index] for index in kept])  # [N] str or list of messages
        # [N] as stored: text, a number, a list of accepted answers or tests, a dict; None where rows have none
        self.answers = _object_column([rows[index]["answer"] for index in kept])
        default_source = config.synthetic.task if config.train_path is None and config.synthetic else ""
        self.data_sources = _object_column([str(rows[index].get("data_source", default_source)) for index in kept])
        self.extra_infos = _object_column([rows[index]["extra_info"] for index in kept])  # [N] dict

    def __len__(self) -> int:
        return len(self.prompts)

    def metrics(self) -> dict[str, float]:
        """What the step metrics report about the data: the bad rows skipped under data.skip_invalid_rows."""
        return {"data/skipped_rows": self.skipped_rows} if self.skipped_rows else {}

    def step_metrics(self, step: int, batch_size: int) -> dict[str, float]:
        """Per-step data metrics; none for one file (a mixture counts its sources' prompts)."""
        return {}

    def indices_at(self, step: int, batch_size: int) -> np.ndarray:
        """Row indices of step `step`'s batch: positions [step*B, (step+1)*B) of the epoch-by-epoch stream."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"batch_at needs step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}.")
        return self.indices_from(step * batch_size, batch_size)

    def indices_from(self, start: int, count: int) -> np.ndarray:
        """Row indices at positions [start, start + count) of the endless stream of epochs, each a permutation."""
        return epoch_stream(start, count, len(self), self._epoch_order)

    def columns_at(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The rows' non-tensor columns: PROMPT_TEXT, ANSWER, DATA_SOURCE and EXTRA_INFO, [len(indices)] each."""
        return {
            keys.PROMPT_TEXT: self.prompts[indices],
            keys.ANSWER: self.answers[indices],
            keys.DATA_SOURCE: self.data_sources[indices],
            keys.EXTRA_INFO: self.extra_infos[indices],
        }

    def batch_at(self, step: int, batch_size: int) -> DataProto:
        """The prompts of step `step`: non-tensor PROMPT_TEXT, ANSWER, DATA_SOURCE and EXTRA_INFO, [batch_size] each."""
        return DataProto.from_dict(
            non_tensors=self.columns_at(self.indices_at(step, batch_size)), meta_info={"step": step}
        )

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return epoch_order(len(self), self.config.shuffle, (self.seed, *self.order_key), epoch)


def epoch_stream(start: int, count: int, size: int, order_of_epoch) -> np.ndarray:
    """Indices into `size` rows at positions [start, start + count) of an endless stream of epochs, epoch e in the
    order `order_of_epoch(e)` gives (a permutation of range(size))."""
    epochs, offsets = np.divmod(np.arange(start, start + count), size)
    indices = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):  # one permutation per epoch touched, not one per row
        in_epoch = epochs == epoch
        indices[in_epoch] = order_of_epoch(int(epoch))[offsets[in_epoch]]
    return indices


def epoch_order(size: int, shuffle: bool, key: tuple[int, ...], epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of `size` rows: one generator per (key, epoch), so it never depends on which steps ran
    before; the stored order without data.shuffle."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([*key, epoch]).permutation(size)


def _load_rows(config: DataConfig, answer_needed: bool) -> Rows:
    """Checked PromptRows from `train_path`, a reasoning-gym dataset or the synthetic task."""
    if isinstance(config.train_path, str):
        return read_rows(config.train_path, config, answer_needed)
    if config.train_path is not None:  # a list: PromptMixture reads each file with a PromptDataset of its own
        raise DataError("a PromptDataset reads one file; use training_prompts() for a list of data.train_path files.")
    if config.reasoning_gym is not None:
        return _generated(reasoning_gym_rows(config.reasoning_gym))
    if config.synthetic is not None:
        synthetic = config.synthetic
        try:
            rows = generate_task(synthetic.task, synthetic.num_prompts, synthetic.seed)
        except ValueError as exc:  # an unknown task name: a data problem like the others
            raise DataError(f"data.synthetic: {exc}") from None
        return _generated(Rows(rows, [f"data.synthetic task {synthetic.task!r} row {i + 1}" for i in range(len(rows))]))
    raise DataError("no prompts: set data.train_path (JSONL or parquet), data.reasoning_gym or data.synthetic.")


def _check_encodable(tokenizer, prompts: list, locations: list[str]) -> None:
    """DataError naming the rows whose prompt text has characters the tokenizer would drop."""
    texts = [_plain_text(prompt) for prompt in prompts]
    dropped = set(dropped_characters(tokenizer, texts))
    if not dropped:
        return
    problems = []
    for location, text in zip(locations, texts):
        lost = sorted(set(text) & dropped)
        if lost:
            kept = "".join(char for char in text if char not in dropped)
            problems.append(f"{location}: {', '.join(map(repr, lost))} in {text!r} (would train as {kept!r})")
    raise rows_error(
        f"{len(problems)} prompts have characters the tokenizer has no token for "
        f"({', '.join(map(repr, sorted(dropped)))})",
        problems,
        "A char tokenizer knows only build_tiny_model.char_alphabet and its chat template's characters: add the "
        "characters to char_alphabet (and delete the model built at model_path so it is rebuilt), or remove them "
        "from the data.",
    )


def _plain_text(prompt) -> str:
    """A prompt's text: the string, or the messages' contents joined."""
    if isinstance(prompt, list):
        return "\n".join(str(message.get("content", "")) for message in prompt if isinstance(message, dict))
    return str(prompt)


def driver_tokenizer(config: PipelineConfig):
    """The tokenizer the run will use, without writing anything: the model folder's, else the one
    `build_tiny_model` would write there (None when there is neither: the config check reports that)."""
    if (Path(config.model_path) / "config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.model_path)
    if config.build_tiny_model is not None:
        from roll_backend.models.tiny import TinyModelSpec, tokenizer_for

        spec = TinyModelSpec(**{"seed": config.seed, **config.build_tiny_model})
        return tokenizer_for(spec)
    return None


def _generated(rows: Rows) -> Rows:
    """Rows a task generated ({prompt, answer, other columns}) as PromptRows."""
    rows.rows = [prompt_row(row, LAYOUTS["plain"]) for row in rows.rows]
    return rows


def _as_prompt(text: Any, apply_chat_template: bool) -> str | list[dict[str, str]]:
    """Chat messages for the rollout's template, or the raw text. A prompt already given as messages is kept."""
    if isinstance(text, list):
        return [dict(message) for message in text]
    return [{"role": "user", "content": str(text)}] if apply_chat_template else str(text)


def encode_prompt(tokenizer, prompt: str | Sequence[dict[str, str]]) -> list[int]:
    """Token ids as the rollout will see them (strategies/vllm/strategy.py: encode_prompt)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)  # 1-D even when the entries are lists of messages
    for index, value in enumerate(values):
        column[index] = value
    return column
