"""DataProto: the batch every controller <-> worker call carries (tensor columns, non-tensor columns, meta_info).

Names and signatures follow verl's DataProto so code written against it ports unchanged (to_tensordict /
from_tensordict, sample_level_repeat and unfold_column_chunks included). Departures: chunk()
takes lengths that chunks does not divide (verl asserts len % chunks == 0; here the sizes differ by at most one),
concat() also accepts meta_info["metrics"] as a dict of per-metric lists besides verl's list of per-worker dicts,
errors say what to change and are `DataProtoError` (a ValueError that is also an AssertionError, so verl's
`except AssertionError` still catches them), and a pickled batch travels as numpy buffers, so Ray hands it to
every reader zero-copy and read-only (see `make_writable`). The class holds the API; which rows an op takes is
computed in rows.py, what a column may be is checked in columns.py.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from roll_backend import keys
from roll_backend.protocol import disk as protocol_disk
from roll_backend.protocol import row_index as row_math
from roll_backend.protocol import tensordict_format
from roll_backend.protocol.columns import (
    as_non_tensor_column,
    check_columns,
    describe,
    leading_len,
    rows_and_source,
    tensor_rows,
)
from roll_backend.protocol.errors import DataProtoError
from roll_backend.protocol.merge import (
    cat_column,
    check_same_columns,
    common_entries,
    merge_meta,
    short_repr,
    values_equal,
)
from roll_backend.protocol.shared import (
    SharedReadOnlyTensor,
    SharedTensorWriteError,
    tensor_from_numpy,
    tensor_to_numpy,
)

__all__ = [
    "DataProto",
    "DataProtoItem",
    "SharedReadOnlyTensor",
    "SharedTensorWriteError",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]

_STATE_VERSION = 1  # bump when __getstate__'s layout changes


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """(padded copy, pad_size): real rows repeated from the start until len % size_divisor == 0, as verl."""
    pad_size = row_math.pad_size(len(data), size_divisor)
    if pad_size == 0:
        return data, 0
    return data.select_idxs(row_math.padded_index(len(data), pad_size)), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """`data` without its last `pad_size` rows (a view), undoing `pad_dataproto_to_divisor`."""
    if not 0 <= pad_size <= len(data):
        raise DataProtoError(
            f"unpad: pad_size={pad_size} must lie in [0, {len(data)}] (the DataProto's length); pass the "
            "pad_size that pad_dataproto_to_divisor returned."
        )
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)


@dataclass
class DataProtoItem:
    """One row: `batch` is a TensorDict with batch_size [], non-tensor values are the row's entries."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """Columns sharing batch dim 0: tensors in `batch`, numpy columns (object arrays for text) in `non_tensor_batch`,
    plus per-batch `meta_info`. Derived DataProtos (slices, chunks, selections) get a shallow copy of meta_info."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self):
        self.non_tensor_batch = {} if self.non_tensor_batch is None else self.non_tensor_batch
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    # ----- construction and validation -----

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from column dicts; the batch size is the first tensor's dim 0. Lists become 1-D object columns.

        `num_batch_dims` (only 1 is supported) and `auto_padding` (ignored: chunk() always takes uneven sizes)
        exist so verl call sites port unchanged.
        """
        if num_batch_dims != 1:
            raise DataProtoError(
                f"num_batch_dims={num_batch_dims}: DataProto supports exactly one batch dim; reshape "
                "tensors to [B, ...] (fold extra batch dims into B) first."
            )
        tensors = tensors or {}
        rows = tensor_rows(tensors)
        batch = TensorDict(dict(tensors), batch_size=[rows]) if tensors else None
        meta_info = {} if meta_info is None else meta_info
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict, meta_info: dict | None = None, auto_padding: bool = False) -> DataProto:
        """Build from one dict, sending tensors to `batch` and numpy arrays / lists to `non_tensor_batch`."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    def check_consistency(self) -> None:
        """Raise ValueError unless every column is well-typed and shares batch dim 0; lists become object columns."""
        check_columns(self.batch, self.non_tensor_batch, self.meta_info)

    def _has_columns(self) -> bool:
        return self.batch is not None or bool(self.non_tensor_batch)

    def _batch_keys(self) -> list[str]:
        return [] if self.batch is None else list(self.batch.keys())

    def _new(self, batch: TensorDict | None, non_tensor: dict[str, np.ndarray]) -> DataProto:
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def _map_rows(self, rows: int, tensor_fn, array_fn) -> DataProto:
        """A new DataProto of `rows` rows with tensor_fn / array_fn applied to every column."""
        batch = None
        if self.batch is not None:
            columns = {key: tensor_fn(value) for key, value in self.batch.items()}
            batch = TensorDict(columns, batch_size=[rows], device=self.batch.device)
        return self._new(batch, {key: array_fn(value) for key, value in self.non_tensor_batch.items()})

    # ----- length, indexing, columns -----

    def __len__(self) -> int:
        return rows_and_source(self.batch, self.non_tensor_batch)[0]

    def __iter__(self) -> Iterator[DataProtoItem]:
        return (self[i] for i in range(len(self)))

    def __contains__(self, key: str) -> bool:
        return key in self.non_tensor_batch or key in self._batch_keys()

    def __getitem__(self, item):
        """int -> DataProtoItem; slice, index list/array/tensor or bool mask -> DataProto; str -> that column."""
        if isinstance(item, str):
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            if item in self._batch_keys():
                return self.batch[item]
            raise KeyError(
                f"no column {item!r}; batch keys: {self._batch_keys()}, non-tensor keys: {list(self.non_tensor_batch)}"
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (int, np.integer)):
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[int(item)],
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(
            f"DataProto indices are int, slice, list/ndarray/tensor of ints or bools, or a column name; "
            f"got {describe(item)}."
        )

    def __setitem__(self, key: str, value) -> None:
        """Add or replace a column: tensors go to `batch`, numpy arrays and lists to `non_tensor_batch`."""
        rows = len(self) if self._has_columns() else leading_len(value)
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != rows:
                raise DataProtoError(
                    f"column {key!r} has shape {tuple(value.shape)} but the DataProto has {rows} rows; "
                    "a column needs one entry per row along dim 0."
                )
            self.non_tensor_batch.pop(key, None)
            self.batch = TensorDict({}, batch_size=[rows]) if self.batch is None else self.batch
            self.batch[key] = value
            return
        column = as_non_tensor_column(key, value)
        if column.shape[0] != rows:
            raise DataProtoError(
                f"column {key!r} has {column.shape[0]} rows but the DataProto has {rows}; "
                "a column needs one entry per row."
            )
        if key in self._batch_keys():
            del self.batch[key]
        self.non_tensor_batch[key] = column

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows start:end:step as views (no copy), always a DataProto."""
        rows = slice(start, end, step)
        count = len(range(*rows.indices(len(self))))
        return self._map_rows(count, lambda t: t[rows], lambda a: a[rows])

    def select_idxs(self, idxs) -> DataProto:
        """Rows at `idxs` (ints, negatives allowed, or a bool mask of len(self)), copied in that order."""
        index = row_math.row_index(idxs, len(self))
        index_t = torch.from_numpy(index)
        return self._map_rows(len(index), lambda t: t.index_select(0, index_t.to(t.device)), lambda a: a[index])

    # ----- dispatch padding: rows the DP split repeated to divide the batch evenly (keys.DISPATCH_PADDING) -----

    def padding_mask(self) -> torch.Tensor:
        """[B] bool, True on the rows the dispatcher repeated (all False when the batch has no padding column)."""
        if self.batch is not None and keys.DISPATCH_PADDING in self.batch.keys():
            return self.batch[keys.DISPATCH_PADDING].bool().cpu()
        return torch.zeros(len(self), dtype=torch.bool)

    def without_padding(self, keep_rows: bool = False) -> DataProto:
        """The batch without the padding column and (unless `keep_rows`) without the rows it marks; the one way to
        drop dispatch padding. Shares tensors where no row is dropped."""
        if self.batch is None or keys.DISPATCH_PADDING not in self.batch.keys():
            return self
        padded = self.padding_mask()
        rows = self.select_idxs(~padded.numpy()) if bool(padded.any()) and not keep_rows else self.select()
        rows.pop(batch_keys=[keys.DISPATCH_PADDING])
        return rows

    # ----- column operations (verl names) -----

    def select(
        self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None, deepcopy: bool = False
    ) -> DataProto:
        """The listed columns / meta keys (None = all). Shares tensors unless deepcopy, which copies everything."""
        batch = self.batch
        if batch_keys is not None:
            batch_keys = _key_list(batch_keys)
            self._require("batch", batch_keys, self._batch_keys())
            batch = None if batch is None else batch.select(*batch_keys)
        elif batch is not None:
            batch = batch.copy()  # shallow: a new key set over the same tensors
        non_tensor = self._pick("non_tensor_batch", self.non_tensor_batch, non_tensor_batch_keys)
        meta_info = self._pick("meta_info", self.meta_info, meta_info_keys)
        if deepcopy:
            batch = None if batch is None else batch.clone()
            non_tensor, meta_info = copy.deepcopy(non_tensor), copy.deepcopy(meta_info)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)

    def _pick(self, where: str, source: dict, keys) -> dict:
        if keys is None:
            return dict(source)
        keys = _key_list(keys)
        self._require(where, keys, list(source))
        return {key: source[key] for key in keys}

    @staticmethod
    def _require(where: str, wanted: list[str], present: list[str]) -> None:
        missing = [key for key in wanted if key not in present]
        if missing:
            raise KeyError(f"{where} has no key(s) {missing}; it has {present}.")

    def pop(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> DataProto:
        """Remove the listed columns / meta keys from self and return them as a new DataProto."""
        batch_keys, non_tensor_keys, meta_keys = (
            _key_list(k or []) for k in (batch_keys, non_tensor_batch_keys, meta_info_keys)
        )
        self._require("batch", batch_keys, self._batch_keys())
        self._require("non_tensor_batch", non_tensor_keys, list(self.non_tensor_batch))
        self._require("meta_info", meta_keys, list(self.meta_info))
        tensors = {key: self.batch.pop(key) for key in batch_keys}
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in non_tensor_keys}
        meta_info = {key: self.meta_info.pop(key) for key in meta_keys}
        return type(self).from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    def rename(self, old_keys=None, new_keys=None) -> DataProto:
        """Rename columns (tensor or non-tensor) in place; returns self."""
        old_keys, new_keys = _key_list(old_keys or []), _key_list(new_keys or [])
        if len(old_keys) != len(new_keys):
            raise DataProtoError(
                f"rename got {len(old_keys)} old keys {old_keys} but {len(new_keys)} new keys {new_keys}; "
                "pass one new name per old name."
            )
        for old, new in zip(old_keys, new_keys, strict=True):
            if old not in self:
                raise KeyError(
                    f"rename: no column {old!r}; batch keys: {self._batch_keys()}, "
                    f"non-tensor keys: {list(self.non_tensor_batch)}"
                )
            if new in self and new != old:
                raise DataProtoError(f"rename: column {new!r} already exists; pop it first or choose another name.")
            if old in self.non_tensor_batch:
                self.non_tensor_batch = {new if k == old else k: v for k, v in self.non_tensor_batch.items()}
            else:
                self.batch.rename_key_(old, new)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add other's columns and meta_info to self, in place; returns self. A key both hold must hold equal values
        (NaN equals NaN); on a conflict self is left unchanged."""
        if self._has_columns() and other._has_columns() and len(self) != len(other):
            raise DataProtoError(
                f"union: self has {len(self)} rows but other has {len(other)}; union joins same-row columns."
            )
        for where, key, mine, theirs in common_entries(self, other):
            if not values_equal(mine, theirs):
                raise DataProtoError(
                    f"union: {where}[{key!r}] differs ({short_repr(mine)} vs {short_repr(theirs)}); rename or pop one."
                )
        for key, value in [*(other.batch.items() if other.batch is not None else ()), *other.non_tensor_batch.items()]:
            self[key] = value
        self.meta_info.update(other.meta_info)
        return self

    # ----- splitting and joining -----

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into exactly `chunks` views with sizes differing by at most 1, larger ones first (np.array_split).

        Unlike verl, which asserts len % chunks == 0, any length works: 10 rows in 4 chunks give 3, 3, 2, 2, and
        chunks past the rows are empty. Code that relied on verl's assert to catch a bad split must check
        `len(data) % chunks` itself (or pad first with `pad_dataproto_to_divisor`, as the dispatcher does).
        """
        bounds = row_math.chunk_bounds(len(self), chunks)
        return [self.slice(start, end) for start, end in itertools.pairwise(bounds)]

    def split(self, split_size: int) -> list[DataProto]:
        """Views of `split_size` rows each, the last one shorter when the length doesn't divide (torch.split);
        an empty DataProto gives one empty part."""
        if not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise DataProtoError(f"split needs a positive int split_size, got {split_size!r}.")
        return [self.slice(start, start + int(split_size)) for start in range(0, max(len(self), 1), int(split_size))]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Join along the rows. Parts need the same columns; every meta key but "metrics" must agree (a key
        missing from some parts is taken from those that have it). meta_info["metrics"] merges into one dict of
        metric name -> list: a part's dict of values or lists extends those lists, and verl's per-worker form (a
        list of dicts, or one dict of scalars) appends each worker's value, as verl's concat does."""
        if not data:
            raise DataProtoError(
                "DataProto.concat got an empty list; pass at least one DataProto (an empty batch is data[:0])."
            )
        first = data[0]
        for i, part in enumerate(data[1:], start=1):
            check_same_columns(first, part, i)
        batch = None
        if any(part.batch is not None for part in data):
            rows = sum(len(part) for part in data)
            device = next(part.batch.device for part in data if part.batch is not None)
            columns = {key: cat_column(key, [part.batch[key] for part in data]) for key in first._batch_keys()}
            batch = TensorDict(columns, batch_size=[rows], device=device)
        non_tensor = {
            key: np.concatenate([part.non_tensor_batch[key] for part in data]) for key in first.non_tensor_batch
        }
        return type(first)(
            batch=batch, non_tensor_batch=non_tensor, meta_info=merge_meta([part.meta_info for part in data])
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: [a, a, b, b] when interleave, else the whole batch tiled [a, b, a, b]."""
        if not isinstance(repeat_times, (int, np.integer)) or repeat_times < 0:
            raise DataProtoError(f"repeat needs a non-negative int repeat_times, got {repeat_times!r}.")
        n = int(repeat_times)
        if interleave:
            return self._map_rows(
                len(self) * n, lambda t: t.repeat_interleave(n, dim=0), lambda a: np.repeat(a, n, axis=0)
            )
        return self._map_rows(
            len(self) * n, lambda t: t.repeat(n, *[1] * (t.dim() - 1)), lambda a: np.tile(a, (n,) + (1,) * (a.ndim - 1))
        )

    def sample_level_repeat(self, repeat_times) -> DataProto:
        """Row i `repeat_times[i]` times, in row order (a count of 0 drops the row), as copies. `repeat_times`: a
        list, tuple, 1-D tensor or array of non-negative ints, one per row."""
        counts = row_math.repeat_counts(repeat_times, len(self))
        return self.select_idxs(np.repeat(np.arange(len(self)), counts))

    def unfold_column_chunks(self, n_split: int, split_keys=None) -> DataProto:
        """Each row becomes `n_split` rows: the `split_keys` columns' dim 1 is cut into n_split consecutive chunks
        ([B, n_split * k, ...] -> [B * n_split, k, ...]; a 1-D object column cuts each row's list), every other
        column repeats its row n_split times. split_keys None splits nothing: every column repeats (verl repeats the
        tensors and fails on non-tensor columns); a split key that is no column raises KeyError (verl ignores it)."""
        if not isinstance(n_split, (int, np.integer)) or n_split < 1:
            raise DataProtoError(f"unfold_column_chunks needs a positive int n_split, got {n_split!r}.")
        split = _key_list(split_keys or [])
        self._require("unfold_column_chunks: the DataProto", split, [*self._batch_keys(), *self.non_tensor_batch])
        n, unfold = int(n_split), row_math.unfold_column
        batch = None
        if self.batch is not None:
            unfolded = {key: unfold(key, value, n, key in split) for key, value in self.batch.items()}
            batch = TensorDict(unfolded, batch_size=[len(self) * n], device=self.batch.device)
        non_tensor = {key: unfold(key, value, n, key in split) for key, value in self.non_tensor_batch.items()}
        return self._new(batch, non_tensor)

    def reorder(self, indices) -> None:
        """Permute the rows in place: row i becomes old row indices[i]."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def group_by(self, key: str) -> dict[Any, DataProto]:
        """{value: the rows whose column `key` holds it}, groups in order of first appearance, rows in original order.

        One stable argsort and at most one gather, then slices: no Python loop over rows. When equal keys already
        sit next to each other (as after an interleaved repeat), the groups are views of self, else copies.
        """
        values = self[key]
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu()
            values = values.numpy() if values.dtype != torch.bfloat16 else values.float().numpy()
        order, keys, bounds = row_math.group_order(key, values)
        grouped = self if np.array_equal(order, np.arange(len(order))) else self.select_idxs(order)
        return {group: grouped.slice(bounds[i], bounds[i + 1]) for i, group in enumerate(keys)}

    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches for `epochs` passes. dataloader_kwargs: {"shuffle": bool, "drop_last": bool}; a seed makes
        the shuffles reproducible. A last mini-batch that doesn't fill up is shorter unless drop_last."""
        options = dict(dataloader_kwargs or {})
        shuffle, drop_last = bool(options.pop("shuffle", False)), bool(options.pop("drop_last", False))
        if options:
            raise DataProtoError(
                f"make_iterator supports dataloader_kwargs 'shuffle' and 'drop_last', got also {sorted(options)}."
            )
        orders = row_math.minibatch_orders(len(self), mini_batch_size, epochs, shuffle, drop_last, seed)
        return (self.select_idxs(order) for order in orders)

    def pad_to_divisor(self, size_divisor: int) -> int:
        """Pad in place by repeating real rows from the start until len % size_divisor == 0; returns the pad count."""
        padded, pad_size = pad_dataproto_to_divisor(self, size_divisor)
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch
        return pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last `pad_size` rows in place (undoes pad_to_divisor); returns self."""
        unpadded = unpad_dataproto(self, pad_size)
        self.batch, self.non_tensor_batch = unpadded.batch, unpadded.non_tensor_batch
        return self

    # ----- devices, memory, files, TensorDicts -----

    def to(self, device) -> DataProto:
        """Move the tensor batch to `device` in place; returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def shared_keys(self) -> list[str]:
        """Columns whose memory is shared read-only with other readers (arrived zero-copy through Ray)."""
        tensors = [
            k for k, v in (self.batch.items() if self.batch is not None else ()) if isinstance(v, SharedReadOnlyTensor)
        ]
        return tensors + [k for k, v in self.non_tensor_batch.items() if not v.flags.writeable]

    def make_writable(self, keys: list[str] | None = None) -> DataProto:
        """Copy the shared read-only columns among `keys` (None = all) into private memory; returns self.

        A batch received through Ray views the object store that every reader of the same object shares, so
        in-place writes to it raise `SharedTensorWriteError` (numpy: ValueError) until its column is copied here.
        """
        for key in self.shared_keys() if keys is None else _key_list(keys):
            if key in self.non_tensor_batch:
                if not self.non_tensor_batch[key].flags.writeable:
                    self.non_tensor_batch[key] = self.non_tensor_batch[key].copy()
            elif isinstance(self[key], SharedReadOnlyTensor):
                self.batch[key] = self.batch[key].clone()
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held by the columns (object columns count their 8-byte references, not the objects)."""
        tensors = sum(v.numel() * v.element_size() for v in self.batch.values()) if self.batch is not None else 0
        return tensors + sum(v.nbytes for v in self.non_tensor_batch.values())

    def size_summary(self) -> str:
        tensor_bytes = sum(v.numel() * v.element_size() for v in self.batch.values()) if self.batch is not None else 0
        return (
            f"DataProto: {len(self)} rows, {_mib(self.nbytes)} MiB; batch {len(self._batch_keys())} tensors "
            f"{_mib(tensor_bytes)} MiB; non_tensor {len(self.non_tensor_batch)} columns "
            f"{_mib(self.nbytes - tensor_bytes)} MiB (object columns: references only); "
            f"meta_info keys {list(self.meta_info)}"
        )

    def __repr__(self) -> str:
        tensors = {
            k: f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            for k, v in (self.batch.items() if self.batch is not None else ())
        }
        arrays = {k: f"{v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items()}
        name, meta_keys = type(self).__name__, list(self.meta_info)
        return f"{name}(len={len(self)}, batch={tensors}, non_tensor_batch={arrays}, meta_info keys={meta_keys})"

    def save_to_disk(self, filepath) -> None:
        """Write one file (see roll_backend/protocol/disk.py): tensors as safetensors, no pickle anywhere."""
        batch = None if self.batch is None else dict(self.batch.items())
        protocol_disk.save_parts(
            filepath, batch, None if self.batch is None else len(self), self.non_tensor_batch, self.meta_info
        )

    @classmethod
    def load_from_disk(cls, filepath) -> DataProto:
        batch, batch_size, non_tensor, meta_info = protocol_disk.load_parts(filepath)
        tensors = None if batch is None else TensorDict(batch, batch_size=[batch_size])
        return cls(batch=tensors, non_tensor_batch=non_tensor, meta_info=meta_info)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict (verl's form, roll_backend/protocol/tensordict_format.py): tensors as entries, non-tensor
        columns as NonTensorStacks, meta_info keys as NonTensorData; shares the tensors, no copy."""
        tensors = {} if self.batch is None else dict(self.batch.items())
        device = None if self.batch is None else self.batch.device
        return tensordict_format.to_tensordict(tensors, device, len(self), self.non_tensor_batch, self.meta_info)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """Rebuild from `to_tensordict` exactly, or read verl's TensorDicts: tensors -> batch, NonTensorStacks ->
        non-tensor columns, NonTensorData -> meta_info (over a copy of the `meta_info` passed; verl writes into it)."""
        if num_batch_dims != 1:
            raise DataProtoError(
                f"num_batch_dims={num_batch_dims}: DataProto supports exactly one batch dim; reshape the "
                "TensorDict to batch size [B] (fold extra batch dims into B) first."
            )
        tensors, rows, non_tensor, meta = tensordict_format.from_tensordict(tensor_dict, meta_info)
        if rows is None:  # no batch dim: the columns' dim 0 is the batch
            return cls.from_dict(tensors=tensors, non_tensors=non_tensor, meta_info=meta)
        keep_batch = bool(tensors) or (not non_tensor and rows > 0)  # an empty batch of `rows` rows stays one
        batch = TensorDict(tensors, batch_size=[rows], device=tensor_dict.device) if keep_batch else None
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    # ----- pickling: tensors travel as numpy buffers (pickle protocol 5 out-of-band under Ray) -----

    def __getstate__(self) -> dict:
        tensors = None if self.batch is None else {key: tensor_to_numpy(value) for key, value in self.batch.items()}
        return {
            "version": _STATE_VERSION,
            "rows": len(self),
            "tensors": tensors,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise DataProtoError(
                f"pickled DataProto has state version {state.get('version')!r}, this code reads "
                f"{_STATE_VERSION}; sender and receiver must run the same roll_backend."
            )
        self.batch = None
        if state["tensors"] is not None:
            tensors = {key: tensor_from_numpy(dtype, array) for key, (dtype, array) in state["tensors"].items()}
            self.batch = TensorDict(tensors, batch_size=[state["rows"]])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


# ----- helpers -----


def _key_list(keys) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"
