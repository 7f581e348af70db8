"""How DataProto parts join: same column names, compatible tensors, meta_info merging, and value equality for union."""

from __future__ import annotations

import math

import numpy as np
import torch

from roll_backend.keys import META_METRICS
from roll_backend.protocol.errors import DataProtoError


def _batch_keys(data) -> list[str]:
    return [] if data.batch is None else list(data.batch.keys())


def check_same_columns(first, part, index: int) -> None:
    """Raise unless DataProto `part` (number `index`) has the same column names as `first`."""
    for where, mine, theirs in (
        ("batch", _batch_keys(first), _batch_keys(part)),
        ("non_tensor_batch", list(first.non_tensor_batch), list(part.non_tensor_batch)),
    ):
        if set(mine) != set(theirs):
            raise DataProtoError(
                f"concat: part {index} has {where} keys {sorted(theirs)} but part 0 has {sorted(mine)} "
                f"(missing {sorted(set(mine) - set(theirs))}, extra {sorted(set(theirs) - set(mine))}); "
                "select the common columns before concatenating."
            )


def common_entries(first, other):
    """(where, key, first's value, other's value) for each column name and meta_info key both DataProtos hold."""
    other_columns = {**other.non_tensor_batch, **dict(other.batch.items() if other.batch is not None else ())}
    for key, value in [*(first.batch.items() if first.batch is not None else ()), *first.non_tensor_batch.items()]:
        if key in other_columns:
            yield ("non_tensor_batch" if key in first.non_tensor_batch else "batch"), key, value, other_columns[key]
    for key, value in first.meta_info.items():
        if key in other.meta_info:
            yield "meta_info", key, value, other.meta_info[key]


def cat_column(key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along the rows, refusing parts whose dtype or per-row shape differ (torch would promote or fail)."""
    first = tensors[0]
    for i, tensor in enumerate(tensors[1:], start=1):
        if tensor.dtype != first.dtype or tensor.shape[1:] != first.shape[1:]:
            raise DataProtoError(
                f"concat: batch[{key!r}] is {first.dtype} {tuple(first.shape[1:])} per row in part 0 but "
                f"{tensor.dtype} {tuple(tensor.shape[1:])} in part {i}; pad or cast the parts to match."
            )
    return torch.cat(tensors, dim=0)


def merge_meta(metas: list[dict]) -> dict:
    """One meta_info from the parts': metrics merged per metric name (see `merge_metrics`), every other key
    equal in all parts."""
    merged: dict = {}
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key == META_METRICS and value is not None:
                merge_metrics(merged.setdefault(META_METRICS, {}), value, i)
            elif key not in merged:
                merged[key] = value
            elif not values_equal(merged[key], value):
                raise DataProtoError(
                    f"concat: meta_info[{key!r}] differs between parts ({short_repr(merged[key])} in an earlier part, "
                    f"{short_repr(value)} in part {i}); make it equal or carry per-part values in meta_info['metrics']."
                )
    return merged


def merge_metrics(into: dict[str, list], metrics, part: int) -> None:
    """Add part `part`'s meta_info["metrics"] to `into` (metric name -> list).

    A dict extends each metric's list by the part's list (or value). A list of dicts is verl's per-worker form:
    like verl's concat, each worker's value is appended as one entry, so {"loss": [a, b]} from worker 0 and
    worker 1 of `[{"loss": a}, {"loss": b}]` come out the same.
    """
    if isinstance(metrics, dict):
        for name, values in metrics.items():
            into.setdefault(name, []).extend(values if isinstance(values, list) else [values])
        return
    if isinstance(metrics, list) and all(isinstance(worker, dict) for worker in metrics):
        for worker in metrics:
            for name, value in worker.items():
                into.setdefault(name, []).append(value)
        return
    raise DataProtoError(
        f"concat: meta_info[{META_METRICS!r}] of part {part} must be a dict of metric name -> value or list, or "
        f"a list of such dicts (one per worker, as verl), got {short_repr(metrics)}."
    )


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and values (NaN equals NaN); the same view is equal without reading it."""
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    if torch.equal(a, b):
        return True
    return (
        a.is_floating_point()
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


def values_equal(a, b) -> bool:
    """Equality that treats NaN == NaN, compares arrays/tensors elementwise and never raises."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        equal = a == b
        return equal if isinstance(equal, bool) else bool(np.all(equal))
    except (TypeError, ValueError):  # incomparable values (e.g. dicts holding arrays) count as different
        return False


def short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
