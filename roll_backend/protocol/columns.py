"""What a DataProto column may be, checked in one place: tensors with a batch dim in a TensorDict of one batch
dim, numpy arrays with a batch dim in non_tensor_batch (lists become 1-D object arrays), all sharing dim 0."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from roll_backend.protocol.errors import DataProtoError
from roll_backend.protocol.merge import short_repr


def tensor_rows(tensors: dict) -> int | None:
    """The shared dim 0 of tensor columns (None for no columns); raises unless each is a tensor with that dim 0."""
    first_key = next(iter(tensors), None)
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise DataProtoError(
                f"tensors[{key!r}] must be a torch.Tensor with a batch dim, got {describe(value)}; "
                "put numpy arrays and lists in non_tensors, scalars in meta_info."
            )
        if value.shape[0] != tensors[first_key].shape[0]:
            raise DataProtoError(
                f"tensors[{key!r}] has {value.shape[0]} rows but tensors[{first_key!r}] has "
                f"{tensors[first_key].shape[0]}; all columns must share batch dim 0."
            )
    return None if first_key is None else tensors[first_key].shape[0]


def check_columns(batch, non_tensor_batch, meta_info) -> None:
    """Raise DataProtoError unless every column is well-typed and shares batch dim 0; turns list columns of
    `non_tensor_batch` into object arrays in place."""
    if batch is not None:
        if not isinstance(batch, TensorDict) or len(batch.batch_size) != 1:
            raise DataProtoError(
                f"DataProto.batch must be a TensorDict with one batch dim or None, got "
                f"{describe(batch)}; build it with DataProto.from_dict(tensors=...)."
            )
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                raise DataProtoError(
                    f"batch[{key!r}] is {describe(value)}; batch holds tensors only (put other "
                    "columns in non_tensor_batch)."
                )
    if not isinstance(non_tensor_batch, dict) or not isinstance(meta_info, dict):
        raise DataProtoError(
            f"non_tensor_batch and meta_info must be dicts, got {describe(non_tensor_batch)} and {describe(meta_info)}."
        )
    for key, value in list(non_tensor_batch.items()):
        non_tensor_batch[key] = as_non_tensor_column(key, value)
    rows, source = rows_and_source(batch, non_tensor_batch)
    for key, value in non_tensor_batch.items():
        if value.shape[0] != rows:
            raise DataProtoError(
                f"non_tensor_batch[{key!r}] has {value.shape[0]} rows but {source} has {rows}; all "
                "columns must share batch dim 0 (slice, repeat or pad the column to match)."
            )
    both = sorted(set(non_tensor_batch) & set([] if batch is None else batch.keys()))
    if both:
        raise DataProtoError(f"columns {both} are in both batch and non_tensor_batch; keep each name in one of them.")


def rows_and_source(batch, non_tensor_batch: dict) -> tuple[int, str]:
    """(rows, which column says so): the tensor batch's size, else the first non-tensor column's length, else 0."""
    if batch is not None:
        return batch.batch_size[0], "the tensor batch"
    for key, value in non_tensor_batch.items():
        return value.shape[0], f"non_tensor_batch[{key!r}]"
    return 0, "the (empty) DataProto"


def as_non_tensor_column(key: str, value) -> np.ndarray:
    """A numpy column as is; a list or tuple as a 1-D object array (one entry per row, even when rows are lists)."""
    if isinstance(value, (list, tuple)):
        return np.fromiter(value, dtype=object, count=len(value))
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return value
    raise DataProtoError(
        f"non_tensor_batch[{key!r}] must be a numpy array with a batch dim or a list (one entry per "
        f"row), got {describe(value)}; tensors go in batch, per-batch scalars in meta_info."
    )


def leading_len(value) -> int:
    """Length of dim 0 of a would-be column, -1 when it has none."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return shape[0] if len(shape) else -1
    return len(value) if isinstance(value, (list, tuple)) else -1


def describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else f" {short_repr(value)}")
