"""DataProto <-> one TensorDict, verl's exchange format: tensors as entries, each non-tensor column as a
`NonTensorStack` of its rows, each meta_info key as `NonTensorData` (tensordict >= 0.10).

A 1-D object column comes back as a 1-D object column (verl's rule). A column numpy could not rebuild from its rows
alone (a numeric or fixed-width string dtype, or more than one dim) also records its dtype and shape under
LAYOUT_KEY, one `NonTensorData` that is present only then, so the round trip is exact for every column; a reader
that does not know the key (verl's `from_tensordict`) sees it as one more meta_info entry.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from roll_backend.protocol.errors import DataProtoError

LAYOUT_KEY = "_dataproto_non_tensor_layout"  # {column: (numpy dtype str, per-row shape)} for non-object columns


def to_tensordict(
    tensors: dict[str, torch.Tensor], device, rows: int, non_tensor: dict[str, np.ndarray], meta_info: dict
) -> TensorDict:
    """One TensorDict of batch size [rows] holding every column and meta_info entry of a DataProto."""
    clashes = sorted((set(tensors) | set(non_tensor) | {LAYOUT_KEY}) & set(meta_info))
    if clashes:
        raise DataProtoError(
            f"to_tensordict: meta_info key(s) {clashes} are also column names (or the reserved {LAYOUT_KEY!r}); "
            "a TensorDict holds one entry per name: rename the meta key or the column first."
        )
    entries: dict = dict(tensors)
    layout = {}
    for key, column in non_tensor.items():
        entries[key] = NonTensorStack.from_list([NonTensorData(value) for value in column])
        if column.dtype != object or column.ndim != 1:
            layout[key] = (column.dtype.str, list(column.shape[1:]))
    result = TensorDict(entries, batch_size=[rows], device=device)
    for key, value in meta_info.items():
        result[key] = NonTensorData(value)
    if layout:
        result[LAYOUT_KEY] = NonTensorData(layout)
    return result


def from_tensordict(
    tensor_dict: TensorDictBase, meta_info: dict | None
) -> tuple[dict[str, torch.Tensor], int | None, dict[str, np.ndarray], dict]:
    """(tensors, rows or None when the TensorDict has no batch dim, non-tensor columns, meta_info), read as verl
    does: tensors are columns, `NonTensorStack`s are non-tensor columns, `NonTensorData` are meta_info entries
    (overriding same-named keys of the `meta_info` argument)."""
    if not isinstance(tensor_dict, TensorDictBase):
        raise DataProtoError(f"from_tensordict needs a TensorDict, got {type(tensor_dict).__name__}.")
    if len(tensor_dict.batch_size) > 1:
        raise DataProtoError(
            f"from_tensordict: the TensorDict has batch size {list(tensor_dict.batch_size)}; DataProto has exactly "
            "one batch dim: reshape it to [B] first (fold extra batch dims into B)."
        )
    tensors, stacks, meta = {}, {}, dict(meta_info or {})
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, NonTensorStack):
            stacks[key] = value.tolist()
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        else:
            raise DataProtoError(
                f"from_tensordict: entry {key!r} is a {type(value).__name__}; DataProto columns are tensors or "
                "NonTensorStacks and meta_info entries NonTensorData: flatten nested TensorDicts "
                "(`td.flatten_keys()`) first."
            )
    layout = meta.pop(LAYOUT_KEY, {})
    non_tensor = {key: _column(values, layout.get(key)) for key, values in stacks.items()}
    rows = int(tensor_dict.batch_size[0]) if len(tensor_dict.batch_size) else None
    return tensors, rows, non_tensor, meta


def _column(values: list, layout) -> np.ndarray:
    """A 1-D object column (one entry per row, even when the rows are lists or arrays), or the recorded layout."""
    dtype, row_shape = (np.dtype(object), ()) if layout is None else (np.dtype(layout[0]), tuple(layout[1]))
    column = np.empty((len(values), *row_shape), dtype=dtype)
    for row, value in enumerate(values):
        column[row] = value
    return column
