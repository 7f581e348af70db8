"""Datasets of the offline pipelines: (prompt, response) examples or whole conversations (the last assistant message
is the response) for sft and (prompt, chosen, rejected) pairs for reward_model and dpo, served as rollout-layout
batches (left-padded prompts, right-padded responses ending in EOS) so the Megatron strategies take them as they take
a rollout's. Rows are read, checked, chat-templated and ordered by the prompt datasets (pipelines.data: the answer
column holds the response or the chosen one, the rejected response rides in extra_info), so `batch_at(step, B)`
depends only on (seed, step, B) and a resumed run trains on the same batches."""

from __future__ import annotations

import dataclasses

import numpy as np

from roll_backend import keys
from roll_backend.config.schema import PAIR_PIPELINES, DataConfig, PipelineConfig
from roll_backend.pipelines.data.prompt_dataset import PromptDataset, encode_prompt
from roll_backend.pipelines.data.rows import DataError
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad, right_pad, sequence_columns


class OfflineDataset:
    """Examples (sft) or preference pairs (reward_model, dpo). A pair's batch rows are chosen at 2i, rejected 2i+1."""

    def __init__(self, data: DataConfig, pipeline: str, tokenizer, seed: int, response_length: int, what="data"):
        self.pairs = pipeline in PAIR_PIPELINES
        self.rows = PromptDataset(data, tokenizer, seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        infos = self.rows.extra_infos
        if self.pairs:
            missing = [i for i, info in enumerate(infos) if info.get(data.rejected_key) is None]
            if missing:
                raise DataError(
                    f"{what}: {len(missing)} rows have no {data.rejected_key!r} column (the rejected response); "
                    f"pair rows need {data.prompt_key!r}, {data.answer_key!r} (chosen) and {data.rejected_key!r}, or "
                    "set data.rejected_key"
                )
        prompts, answers = list(self.rows.prompts), [str(answer) for answer in self.rows.answers]
        if not self.pairs:  # a whole conversation (answer_key naming the prompt's column): its last reply is trained
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, list) and prompt and prompt[-1].get("role") == "assistant":
                    prompts[i], answers[i] = prompt[:-1], str(prompt[-1].get("content", ""))
        self.tokenizer, self.prompts = tokenizer, prompts  # (encoded per batch: PromptDataset measured them already)
        responses = [answers]
        if self.pairs:
            responses.append([str(info[data.rejected_key]) for info in infos])
        self.response_ids = [
            [tokenizer.encode(text, add_special_tokens=False) + eos for text in column] for column in responses
        ]
        longest = max(len(ids) for column in self.response_ids for ids in column)
        if longest > response_length:
            too_long = sum(len(ids) > response_length for column in self.response_ids for ids in column)
            raise DataError(
                f"{what}: {too_long} responses are longer than response_length={response_length} tokens with EOS "
                f"(longest: {longest}); raise response_length to {longest} or shorten them"
            )
        self.margins = np.array([float(info.get(data.margin_key, 0.0) or 0.0) for info in infos], dtype=np.float32)

    def __len__(self) -> int:
        return len(self.rows)

    def metrics(self) -> dict[str, float]:
        return self.rows.metrics()

    def step_metrics(self, step: int, batch_size: int) -> dict[str, float]:
        return {}

    def batch_at(self, step: int, batch_size: int) -> DataProto:
        return self.batch_of(self.rows.indices_at(step, batch_size))

    def all_rows(self) -> DataProto:
        return self.batch_of(np.arange(len(self)))

    def batch_of(self, indices: np.ndarray) -> DataProto:
        """The examples (or pairs: chosen then rejected, interleaved) at `indices` in the rollout layout."""
        examples = [
            (encode_prompt(self.tokenizer, self.prompts[i]), column[i])
            for i in indices
            for column in self.response_ids[: 2 if self.pairs else 1]
        ]
        prompts, prompt_mask = left_pad([prompt for prompt, _ in examples], self.pad_id)
        responses, response_mask = right_pad([response for _, response in examples], self.pad_id)
        tensors = sequence_columns(prompts, prompt_mask, responses, response_mask)
        tensors[keys.RESPONSE_MASK] = response_mask
        return DataProto.from_dict(tensors=tensors, meta_info={"margins": self.margins[indices].tolist()})


def offline_datasets(config: PipelineConfig, tokenizer) -> tuple[OfflineDataset, OfflineDataset | None]:
    """(training set, validation set or None): data.train_path / data.synthetic, and data.val_path / val_synthetic."""
    train = OfflineDataset(config.data, config.pipeline, tokenizer, config.seed, config.response_length)
    plain = dataclasses.replace(config.data, train_path=None, synthetic=None, reasoning_gym=None, shuffle=False)
    if config.data.val_path is not None:
        if len(config.data.val_paths()) != 1:
            raise DataError("data.val_path: the offline pipelines take one validation file")
        val_data = dataclasses.replace(plain, train_path=config.data.val_paths()[0])
    elif config.data.val_synthetic is not None:
        val_data = dataclasses.replace(plain, synthetic=config.data.val_synthetic)
    else:
        return train, None
    validation = OfflineDataset(
        val_data, config.pipeline, tokenizer, config.seed, config.response_length, what="validation data"
    )
    return train, validation
