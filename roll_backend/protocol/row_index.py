"""Row arithmetic behind DataProto's reshaping ops: which rows an op takes, in which order, and how many times.

Index normalisation, padding, chunk bounds, grouping order, mini-batch order and per-row repeat counts are
integer arrays computed here; `DataProto` then gathers or slices every column with them. `unfold_column` turns a
column's second dim into more rows (verl's `unfold_column_chunks`). Nothing here knows the DataProto class.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from roll_backend.protocol.errors import DataProtoError


def row_index(idxs, rows: int) -> np.ndarray:
    """int64 positions for `idxs`: ints (negatives count from the end) or a bool mask of `rows` entries."""
    index = np.asarray(idxs.detach().cpu().numpy() if isinstance(idxs, torch.Tensor) else idxs)
    if index.ndim != 1:
        raise DataProtoError(
            f"row index must be 1-D, got shape {index.shape}; pass a flat list/array of rows or a mask."
        )
    if index.dtype == bool:
        if index.shape[0] != rows:
            raise DataProtoError(
                f"bool mask has {index.shape[0]} entries but the DataProto has {rows} rows; "
                "a mask needs one entry per row."
            )
        return np.flatnonzero(index)
    if index.size == 0:
        return np.zeros(0, dtype=np.int64)
    if index.dtype.kind not in "iu":
        raise DataProtoError(f"row index must hold ints or bools, got dtype {index.dtype}.")
    index = index.astype(np.int64)
    if index.min() < -rows or index.max() >= rows:
        raise IndexError(f"row index out of range for {rows} rows (min {index.min()}, max {index.max()}).")
    return np.where(index < 0, index + rows, index)


def pad_size(rows: int, size_divisor: int) -> int:
    """Rows to add so that `rows` becomes a multiple of `size_divisor` (0 for an empty batch)."""
    if not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise DataProtoError(f"pad: size_divisor must be a positive int, got {size_divisor!r}.")
    if rows == 0:
        return 0
    return -rows % int(size_divisor)


def padded_index(rows: int, pad: int) -> np.ndarray:
    """All rows, then `pad` real rows again from the start (wrapping), as verl pads."""
    return np.concatenate([np.arange(rows), np.arange(pad) % rows])


def chunk_bounds(rows: int, chunks: int) -> list[int]:
    """chunks + 1 boundaries of sizes differing by at most one, larger first (np.array_split)."""
    if not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise DataProtoError(f"chunk needs a positive int number of chunks, got {chunks!r}.")
    base, extra = divmod(rows, int(chunks))
    return [int(b) for b in np.cumsum([0] + [base + 1] * extra + [base] * (int(chunks) - extra))]


def group_order(key: str, values: np.ndarray) -> tuple[np.ndarray, list, list[int]]:
    """(row order, group keys, bounds) for column `key`: rows of group i are order[bounds[i]:bounds[i + 1]], groups
    in order of first appearance, rows in original order. One stable argsort, no Python loop over rows."""
    if values.ndim != 1:
        raise DataProtoError(f"group_by needs a 1-D column (one key per row); {key!r} has shape {values.shape}.")
    try:
        uniques, first_row, group_of_row = np.unique(values, return_index=True, return_inverse=True)
    except TypeError as err:
        raise DataProtoError(
            f"group_by: the values of {key!r} cannot be sorted ({err}); convert them to str first."
        ) from err
    appearance = np.argsort(first_row, kind="stable")  # group ids in order of first appearance
    rank = np.empty_like(appearance)
    rank[appearance] = np.arange(len(appearance))
    row_rank = rank[group_of_row.reshape(-1)]
    order = np.argsort(row_rank, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(row_rank, minlength=len(uniques)))])
    keys = [_python_key(uniques[g]) for g in appearance]
    return order, keys, [int(b) for b in bounds]


def minibatch_orders(
    rows: int, mini_batch_size: int, epochs: int, shuffle: bool, drop_last: bool, seed: int | None
) -> Iterator[np.ndarray]:
    """Row positions of each mini-batch, `epochs` passes; a seed makes the shuffles reproducible."""
    if not isinstance(mini_batch_size, (int, np.integer)) or mini_batch_size < 1:
        raise DataProtoError(f"make_iterator needs a positive int mini_batch_size, got {mini_batch_size!r}.")
    generator = None if seed is None else torch.Generator().manual_seed(seed)

    def orders():
        stop = rows - rows % mini_batch_size if drop_last else rows
        for _ in range(epochs):
            order = torch.randperm(rows, generator=generator).numpy() if shuffle else np.arange(rows)
            for start in range(0, stop, mini_batch_size):
                yield order[start : start + mini_batch_size]

    return orders()


def repeat_counts(repeat_times, rows: int) -> np.ndarray:
    """int64 counts, one per row, from a list / tuple / 1-D tensor / 1-D array of non-negative ints."""
    if isinstance(repeat_times, torch.Tensor):
        repeat_times = repeat_times.detach().cpu().numpy()
    if not isinstance(repeat_times, (list, tuple, np.ndarray)):
        raise DataProtoError(
            f"sample_level_repeat needs one count per row (list, tuple, 1-D tensor or array), got "
            f"{type(repeat_times).__name__} {repeat_times!r}; for one count for every row use repeat()."
        )
    counts = np.asarray(repeat_times)
    if counts.size == 0:  # np.asarray([]) is float64
        counts = counts.astype(np.int64)
    if counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise DataProtoError(
            f"sample_level_repeat: repeat_times must be a 1-D sequence of ints, got shape {counts.shape} "
            f"dtype {counts.dtype}."
        )
    if counts.shape[0] != rows:
        raise DataProtoError(
            f"sample_level_repeat: repeat_times has {counts.shape[0]} counts but the DataProto has {rows} rows; "
            "pass one count per row."
        )
    if counts.size and counts.min() < 0:
        raise DataProtoError(f"sample_level_repeat: counts must be >= 0, got {counts.min()} at row {counts.argmin()}.")
    return counts.astype(np.int64)


def unfold_column(key: str, column, n_split: int, split: bool):
    """[B, ...] -> [B * n_split, ...]: a split column's dim 1 cut into n_split consecutive chunks, one per new row
    (a 1-D object column cuts each row's list / tuple / array the same way); any other column repeats each row."""
    if not split:
        if isinstance(column, torch.Tensor):
            return column.repeat_interleave(n_split, dim=0)
        return np.repeat(column, n_split, axis=0)
    if isinstance(column, np.ndarray) and column.ndim == 1 and column.dtype == object:
        return _unfold_object_rows(key, column, n_split)
    if column.ndim < 2:
        raise DataProtoError(
            f"unfold_column_chunks: column {key!r} has shape {tuple(column.shape)}, no second dim to split; "
            "leave it out of split_keys (it is then repeated)."
        )
    width = column.shape[1]
    if width % n_split:
        raise DataProtoError(
            f"unfold_column_chunks: column {key!r} has {width} entries in dim 1, which n_split={n_split} does not "
            "divide; pad that dim to a multiple of n_split first."
        )
    return column.reshape(column.shape[0] * n_split, width // n_split, *column.shape[2:])


def _unfold_object_rows(key: str, column: np.ndarray, n_split: int) -> np.ndarray:
    out = np.empty(len(column) * n_split, dtype=object)
    for row, value in enumerate(column):
        if not isinstance(value, (list, tuple, np.ndarray)) or len(value) % n_split:
            length = len(value) if isinstance(value, (list, tuple, np.ndarray)) else None
            raise DataProtoError(
                f"unfold_column_chunks: column {key!r} row {row} is {type(value).__name__}"
                + (f" of length {length}, which n_split={n_split} does not divide" if length is not None else "")
                + "; a split object column holds a list, tuple or array per row whose length n_split divides."
            )
        width = len(value) // n_split
        for j in range(n_split):
            out[row * n_split + j] = value[j * width : (j + 1) * width]
    return out


def _python_key(value):
    return value.item() if isinstance(value, np.generic) else value
