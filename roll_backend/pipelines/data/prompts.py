"""The run's prompt sets, loaded the same way on the driver before Ray starts (`check_data`) and in the run: the
training prompts (one file or the synthetic task: PromptDataset; several weighted files: PromptMixture) and the
validation prompts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from roll_backend import keys
from roll_backend.config.schema import DataConfig, PipelineConfig
from roll_backend.pipelines.data.mixture import PromptMixture
from roll_backend.pipelines.data.prompt_dataset import PromptDataset, driver_tokenizer
from roll_backend.protocol import DataProto


def training_prompts(config: DataConfig, tokenizer, seed: int):
    """The run's prompt set: a PromptDataset for one file or the synthetic task, a PromptMixture for a list of files
    (both serve `batch_at(step, batch_size)`, `metrics()` and `step_metrics(step, batch_size)`)."""
    if config.train_path is None or isinstance(config.train_path, str):
        return PromptDataset(config, tokenizer, seed)
    return PromptMixture(config, tokenizer, seed)


def check_data(config: PipelineConfig):
    """Load and check the run's prompts on the driver, before Ray or any actor starts (raises DataError); None
    when there is no tokenizer yet (the config check reports that)."""
    tokenizer = driver_tokenizer(config)
    if tokenizer is None:
        return None
    if config.offline:  # examples or pairs, with their validation set
        from roll_backend.pipelines.data.offline_datasets import offline_datasets

        return offline_datasets(config, tokenizer)[0]
    return training_prompts(config.data, tokenizer, config.seed)


def load_validation_prompts(config: PipelineConfig, tokenizer) -> DataProto | None:
    """Every prompt of data.val_path in file order (checked like the training prompts), a `data_source` from the row
    or the file's name, then those of data.val_reasoning_gym and data.val_synthetic; a stable UID per prompt; None
    without any, and for the offline pipelines (their held-out examples are pipelines.offline_data's)."""
    if config.offline:
        return None
    parts = []
    plain = dataclasses.replace(config.data, train_path=None, synthetic=None, reasoning_gym=None, shuffle=False)
    for path in config.data.val_paths():
        dataset = PromptDataset(dataclasses.replace(plain, train_path=path), tokenizer, config.seed)
        dataset.data_sources[dataset.data_sources == ""] = Path(path).stem
        parts.append(dataset.batch_at(0, len(dataset)))
    if config.data.val_reasoning_gym is not None:
        data = dataclasses.replace(plain, reasoning_gym=config.data.val_reasoning_gym)
        parts.append(PromptDataset(data, tokenizer, config.seed).batch_at(0, config.data.val_reasoning_gym.size))
    if config.data.val_synthetic is not None:
        data = dataclasses.replace(plain, synthetic=config.data.val_synthetic)
        parts.append(PromptDataset(data, tokenizer, config.seed).batch_at(0, config.data.val_synthetic.num_prompts))
    if not parts:
        return None
    prompts = DataProto.concat(parts)
    prompts.non_tensor_batch[keys.UID] = np.array([f"val-{i}" for i in range(len(prompts))], dtype=object)
    prompts.meta_info = {}
    return prompts
