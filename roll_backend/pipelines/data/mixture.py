"""Several training prompt files drawn by weight (data.train_path as a list), and the per-source step metrics.

Like PromptDataset, `batch_at(step, batch_size)` is a pure function of (seed, step, batch_size), so a resumed run
gets exactly the batches the uninterrupted run had and no sampler state goes into the checkpoint. Think of one
endless mixed stream of prompts, step s reading its positions [s*B, (s+1)*B): `StreamSplit` says in closed form how
many of the first n positions each file owns (its share of the weights, rounded down with a seeded offset), so step
s takes from file j the next `owned(n_end) - owned(n_start)` prompts of file j's own epoch-by-epoch stream.

Why this split and not a multinomial draw per step: a file's start at step s is then O(1) to compute, where a sum
of per-step draws is O(s), and the dynamic-sampling refill reads stream steps beyond 1e9 (pipelines.dynamic_sampling);
and the shares hold at every step, not only on average (each file within J prompts of its weighted share of all
prompts so far, J the number of files), with no file starved at small batch sizes (3:1 at batch size 1 reads
A, A, A, B, ... in a seeded phase).
Each batch is shuffled by a per-(seed, step) generator so one file's prompts do not sit together.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from roll_backend import keys
from roll_backend.config.schema import DataConfig, TrainSource
from roll_backend.pipelines.data.prompt_dataset import PromptDataset, epoch_order, epoch_stream
from roll_backend.pipelines.data.rows import DataError
from roll_backend.protocol import DataProto

# Mixed into the seeds of the mixture's own randomness (split offsets, batch order, each file's epoch order), so it
# is independent of the other randomness seeded from the run's seed.
MIXTURE_SALT = 0x6D6978  # "mix"


class StreamSplit:
    """How many of the first n positions of the mixed stream each of J files owns, exactly and in O(J).

    Stick-breaking: file j takes floor(rest * w_j / (w_j + ... + w_last) + offset_j) of the `rest` the files before
    it left, and the last file the remainder. Each count is non-decreasing in n (a floor of a slope <= 1), so the
    windows of consecutive steps tile every file's stream: no prompt of a file is skipped or read twice. Exact
    integer arithmetic (weights and offsets as fractions): the counts stay right at n ~ 1e15.
    """

    def __init__(self, weights: list[float], offsets: list[float]):
        self.shares = []  # per file but the last: (numerator, constant, denominator) of floor((rest*num + c) / den)
        for index in range(len(weights) - 1):
            share = Fraction(weights[index]) / sum(Fraction(weight) for weight in weights[index:])
            offset = Fraction(offsets[index])  # in [0, 1)
            numerator = share.numerator * offset.denominator
            constant = offset.numerator * share.denominator
            self.shares.append((numerator, constant, share.denominator * offset.denominator))

    def owned(self, total: int) -> np.ndarray:
        """Positions each file owns among the first `total`: [J] int64, summing to `total`."""
        counts, rest = [], int(total)
        for numerator, constant, denominator in self.shares:
            taken = (rest * numerator + constant) // denominator
            counts.append(taken)
            rest -= taken
        return np.array([*counts, rest], dtype=np.int64)


class PromptMixture:
    """Prompt files mixed by weight: each file is its own PromptDataset (same loading and filters), walked epoch by
    epoch in its own order, so every prompt of a file is seen once per epoch of that file. With data.source_weights
    the components are data sources instead (SourceRows: a source's rows pooled over the files), drawn the same way.
    One file (data.train_path a string) with source_weights is a mixture of its sources."""

    def __init__(self, config: DataConfig, tokenizer, seed: int, answer_needed: bool = True):
        path = config.train_path
        entries: tuple[TrainSource, ...] = (TrainSource(path),) if isinstance(path, str) else tuple(path or ())
        if not entries or not all(entry.weight > 0 for entry in entries):
            raise ValueError("PromptMixture needs data.train_path as a non-empty list of entries with weight > 0.")
        self.seed = seed
        self.entries = entries
        self.files = [
            _load_source(config, entry, index, tokenizer, seed, answer_needed) for index, entry in enumerate(entries)
        ]
        if config.source_weights is None:
            self.sources, weights = self.files, [entry.weight for entry in entries]
        else:
            self.sources, weights = sources_by_weight(self.files, config.source_weights, seed, config.shuffle)
        offsets = np.random.default_rng([seed, MIXTURE_SALT]).random(len(self.sources))  # the split's seeded phase
        self.split = StreamSplit(weights, offsets.tolist())
        self.source_names = sorted({str(name) for source in self.sources for name in source.data_sources})

    def __len__(self) -> int:
        return sum(len(source) for source in self.sources)

    def metrics(self) -> dict[str, float]:
        """The bad rows skipped under data.skip_invalid_rows, all files together (as for one file)."""
        skipped = sum(source.skipped_rows for source in self.files)
        return {"data/skipped_rows": skipped} if skipped else {}

    def step_metrics(self, step: int, batch_size: int) -> dict[str, float]:
        """`data/<source>/prompts`: how many of step `step`'s prompts each source gave (0 included)."""
        return per_source_prompt_metrics(self.batch_at(step, batch_size), self.source_names)

    def drawn_before(self, step: int, batch_size: int) -> np.ndarray:
        """Prompts each file gave in steps 0..step-1: [J] int64, where its share of step `step` starts in its stream."""
        return self.split.owned(step * batch_size)

    def counts_at(self, step: int, batch_size: int) -> np.ndarray:
        """How many of step `step`'s prompts each file gives: [J] int64, summing to batch_size."""
        return self.drawn_before(step + 1, batch_size) - self.drawn_before(step, batch_size)

    def batch_at(self, step: int, batch_size: int) -> DataProto:
        """The prompts of step `step` (the columns of PromptDataset.batch_at), the files' shares in a seeded order."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"batch_at needs step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}.")
        starts, counts = self.drawn_before(step, batch_size), self.counts_at(step, batch_size)
        parts = [
            source.columns_at(source.indices_from(int(start), int(count)))
            for source, start, count in zip(self.sources, starts, counts)
        ]
        # Shuffled so that one file's prompts do not sit together (data-parallel ranks take contiguous slices).
        order = np.random.default_rng([self.seed, step, MIXTURE_SALT]).permutation(batch_size)
        columns = {key: np.concatenate([part[key] for part in parts])[order] for key in parts[0]}
        return DataProto.from_dict(non_tensors=columns, meta_info={"step": step})


class SourceRows:
    """One data source's rows, pooled over the mixture's files in file order: a component of data.source_weights'
    split, served like a file (`indices_from` positions of its own epoch-by-epoch stream, `columns_at` them)."""

    def __init__(self, name: str, files: list[PromptDataset], key: tuple[int, ...], shuffle: bool):
        self.name, self.key, self.shuffle = name, key, shuffle
        self.parts = [(file, np.flatnonzero(file.data_sources == name)) for file in files]
        self.parts = [(file, rows) for file, rows in self.parts if len(rows)]
        self.data_sources = np.full(len(self), name, dtype=object)

    def __len__(self) -> int:
        return sum(len(rows) for _, rows in self.parts)

    def indices_from(self, start: int, count: int) -> np.ndarray:
        return epoch_stream(
            start, count, len(self), lambda epoch: epoch_order(len(self), self.shuffle, self.key, epoch)
        )

    def columns_at(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The columns of the pooled rows at `positions`, in that order."""
        bounds = np.cumsum([0, *(len(rows) for _, rows in self.parts)])
        part_of = np.searchsorted(bounds, positions, side="right") - 1  # [count]
        columns = None
        for index, (file, rows) in enumerate(self.parts):
            chosen = part_of == index
            if not chosen.any():
                continue
            found = file.columns_at(rows[positions[chosen] - bounds[index]])
            if columns is None:
                columns = {key: np.empty(len(positions), dtype=column.dtype) for key, column in found.items()}
            for key, column in found.items():
                columns[key][chosen] = column
        return columns if columns is not None else self.parts[0][0].columns_at(np.empty(0, dtype=np.int64))


def sources_by_weight(
    files: list[PromptDataset], weights: dict[str, float], seed: int, shuffle: bool
) -> tuple[list[SourceRows], list[float]]:
    """The mixture's components under data.source_weights: one SourceRows per source of positive weight, with its
    weight. DataError when a source of the rows has no weight, or a weighted source has no rows."""
    counts = Counter(str(name) for file in files for name in file.data_sources)
    unweighted = sorted(set(counts) - set(weights))
    if unweighted:
        listed = ", ".join(f"{name!r} ({counts[name]} rows)" for name in unweighted)
        raise DataError(
            f"data.source_weights gives no weight to the sources {listed}; give each a weight (0 leaves its rows "
            "out), or set data.source_key to the column that names the sources"
        )
    missing = sorted(name for name, weight in weights.items() if weight > 0 and name not in counts)
    if missing:
        raise DataError(
            f"data.source_weights names {', '.join(map(repr, missing))}, which no training row has (the rows' "
            f"sources: {', '.join(map(repr, sorted(counts)))}); fix the name or drop it"
        )
    named = sorted(name for name in counts if weights[name] > 0)
    components = [SourceRows(name, files, (seed, MIXTURE_SALT, index), shuffle) for index, name in enumerate(named)]
    return components, [weights[name] for name in named]


def _load_source(
    config: DataConfig, entry: TrainSource, index: int, tokenizer, seed: int, answer_needed: bool
) -> PromptDataset:
    """One file of the mixture as a PromptDataset, its rows named by the entry, their column, or the file's name."""
    single = dataclasses.replace(config, train_path=entry.path, synthetic=None)
    try:
        # Its own order key: files of equal length do not shuffle in step with each other.
        source = PromptDataset(single, tokenizer, seed, order_key=(MIXTURE_SALT, index), answer_needed=answer_needed)
    except DataError as exc:
        raise DataError(f"data.train_path[{index}] ({entry.path}): {exc}") from None
    if entry.data_source is not None:
        source.data_sources[:] = entry.data_source
    else:
        source.data_sources[source.data_sources == ""] = Path(entry.path).stem
    return source


def per_source_prompt_metrics(prompts: DataProto, source_names=()) -> dict[str, float]:
    """`data/<source>/prompts`: the batch's rows per DATA_SOURCE, with 0 for each of `source_names` not in it."""
    counts = Counter({name: 0 for name in source_names})
    counts.update(str(name) for name in prompts.non_tensor_batch[keys.DATA_SOURCE])
    return {f"data/{name}/prompts": float(count) for name, count in sorted(counts.items())}


def per_source_reward_metrics(batch: DataProto) -> dict[str, float]:
    """`reward/<source>/mean`: the mean sequence score (TOKEN_LEVEL_SCORES [B, T_resp] summed over tokens) of the
    batch's responses from each DATA_SOURCE; rows without a source ("": one file without the column) are left out."""
    scores = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(-1).double()  # [B]
    sources = np.asarray([str(name) for name in batch.non_tensor_batch[keys.DATA_SOURCE]])  # [B]
    return {
        f"reward/{name}/mean": float(scores[torch.from_numpy(sources == name)].mean())
        for name in np.unique(sources)
        if name
    }
