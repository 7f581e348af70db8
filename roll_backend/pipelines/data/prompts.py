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
from roll_backend.pipelines.data.rows import DataError
from roll_backend.protocol import DataProto


def training_prompts(config: DataConfig, tokenizer, seed: int, answer_needed: bool = True):
    """The run's prompt set: a PromptDataset for one file or the synthetic task, a PromptMixture for a list of files
    or for data.source_weights (both serve `batch_at(step, batch_size)`, `metrics()` and
    `step_metrics(step, batch_size)`). `answer_needed`: rows must have a reference answer
    (PipelineConfig.needs_answers)."""
    if config.train_path is None or (isinstance(config.train_path, str) and config.source_weights is None):
        return PromptDataset(config, tokenizer, seed, answer_needed=answer_needed)
    return PromptMixture(config, tokenizer, seed, answer_needed)


def run_prompts(config: PipelineConfig, tokenizer):
    """The training prompts of an online run, with every row's source routed by reward.by_source (DataError naming
    the sources nothing scores, before any actor starts)."""
    data = training_prompts(config.data, tokenizer, config.seed, config.needs_answers())
    check_sources(config, {str(s) for part in getattr(data, "sources", [data]) for s in part.data_sources})
    return data


def check_sources(config: PipelineConfig, sources: set[str]) -> None:
    """DataError when reward.by_source routes some of `sources` to no reward."""
    from roll_backend.rewards.source_routing import SourceRouting

    if config.reward.by_source is None:
        return
    weights = config.reward.builtin_weights(config.other_rewards())
    routing = SourceRouting.build(config.reward.by_source, weights)
    problems = routing.problems(sources)
    if problems:
        raise DataError("\n".join(problems))


def check_data(config: PipelineConfig):
    """Load and check the run's prompts on the driver, before Ray or any actor starts (raises DataError); None
    when there is no tokenizer yet (the config check reports that)."""
    tokenizer = driver_tokenizer(config)
    if tokenizer is None:
        return None
    if config.offline:  # examples or pairs, with their validation set
        from roll_backend.pipelines.data.offline_datasets import offline_datasets

        return offline_datasets(config, tokenizer)[0]
    return run_prompts(config, tokenizer)


def load_validation_prompts(config: PipelineConfig, tokenizer) -> DataProto | None:
    """Every prompt of data.val_path in file order (checked like the training prompts), a `data_source` from the row
    or the file's name, then those of data.val_reasoning_gym and data.val_synthetic; a stable UID per prompt; None
    without any, and for the offline pipelines (their held-out examples are pipelines.offline_data's)."""
    if config.offline:
        return None
    parts = []
    plain = dataclasses.replace(config.data, train_path=None, synthetic=None, reasoning_gym=None, shuffle=False)
    for path in config.data.val_paths():
        data = dataclasses.replace(plain, train_path=path)
        dataset = PromptDataset(data, tokenizer, config.seed, answer_needed=config.needs_answers())
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
    check_sources(config, {str(source) for source in prompts.non_tensor_batch[keys.DATA_SOURCE]})
    prompts.non_tensor_batch[keys.UID] = np.array([f"val-{i}" for i in range(len(prompts))], dtype=object)
    prompts.meta_info = {}
    return prompts
