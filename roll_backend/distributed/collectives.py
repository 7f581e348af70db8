"""Collectives inside a parallel group: small objects, and a DataProto sent tensor by tensor.

`broadcast_dataproto` sends a small schema first (column names, dtypes, shapes, non-tensor columns,
meta_info), every rank allocates buffers on its device, then each tensor goes by `dist.broadcast`.
No pickled whole batch: pickling tensors copies them (~5x slower, shared STACK.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from roll_backend.protocol import DataProto

# gloo cannot broadcast bool tensors; they travel as uint8 and are viewed back.
# Dtypes gloo and NCCL cannot send travel as bytes (int16: MoE routes).
_WIRE_DTYPE = {torch.bool: torch.uint8, torch.int16: torch.uint8}


def _wire_shape(shape: tuple, dtype: torch.dtype, wire_dtype: torch.dtype) -> tuple:
    """A tensor viewed as `wire_dtype`: a wider dtype's last dimension grows by the itemsize ratio."""
    ratio = dtype.itemsize // wire_dtype.itemsize
    return (*shape[:-1], shape[-1] * ratio) if ratio > 1 and shape else shape


class MissingColumnError(KeyError):
    """A column a pipeline stage declared it needs is not in the batch (raised on every rank alike)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class StageColumns:
    """Columns each pipeline stage needs before forward and loss (declared by a strategy)."""

    first: tuple[str, ...] = ()  # e.g. input ids, attention mask, position ids
    last: tuple[str, ...] = ()  # e.g. responses, loss mask, advantages, old/ref log-probs
    mtp: tuple[str, ...] = ()  # multi-token-prediction heads (on the last stage): input ids, loss mask

    def all(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.first, *self.last, *self.mtp)))


def column_names(batch: DataProto) -> set[str]:
    return set(batch.batch.keys() if batch.batch is not None else ()) | set(batch.non_tensor_batch)


def check_columns(present: set[str], required: StageColumns | None, rank_tag: str = "") -> None:
    missing = [key for key in (required.all() if required else ()) if key not in present]
    if missing:
        raise MissingColumnError(
            f"{rank_tag} batch is missing column(s) {missing} that this call's pipeline stages need; "
            f"present: {sorted(present)}. Add them to the batch before this call."
        )


def broadcast_obj(obj, group: dist.ProcessGroup | None = None, src: int | None = None):
    """Broadcast a small picklable object from `src` (a global rank; default the group's first rank)."""
    src = dist.get_global_rank(group, 0) if src is None and group is not None else (src or 0)
    holder = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src, group=group, device=_comm_device(group))
    return holder[0]


def _comm_device(group) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )


def _schema_of(batch: DataProto) -> dict:
    tensors = {}
    if batch.batch is not None:
        for key, tensor in batch.batch.items():
            tensors[key] = (tensor.dtype, tuple(tensor.shape))
    return {
        "batch_size": len(batch),
        "tensors": tensors,
        "non_tensor_batch": batch.non_tensor_batch,
        "meta_info": batch.meta_info,
    }


def broadcast_dataproto(
    batch: DataProto | None,
    group: dist.ProcessGroup | None,
    src: int,
    required: StageColumns | None = None,
    rank_tag: str = "",
) -> DataProto:
    """Broadcast `batch` from global rank `src` to every rank of `group`; returns the batch on every rank.

    Ranks other than `src` may pass None or a meta-only DataProto. `required` columns are checked on
    every rank against the same schema, so a missing column raises MissingColumnError everywhere
    (before any tensor moves) instead of leaving some ranks waiting.
    """
    is_src = dist.get_rank() == src
    schema = broadcast_obj(_schema_of(batch) if is_src else None, group=group, src=src)
    check_columns(set(schema["tensors"]) | set(schema["non_tensor_batch"]), required, rank_tag)
    device = _comm_device(group)
    received = {}
    for key in sorted(schema["tensors"]):
        dtype, shape = schema["tensors"][key]
        wire_dtype = _WIRE_DTYPE.get(dtype, dtype)
        if is_src:
            buffer = batch.batch[key].to(device)
            buffer = buffer.view(wire_dtype) if wire_dtype != dtype else buffer
            buffer = buffer.contiguous()
        else:
            buffer = torch.empty(_wire_shape(shape, dtype, wire_dtype), dtype=wire_dtype, device=device)
        dist.broadcast(buffer, src=src, group=group)
        received[key] = buffer.view(dtype) if wire_dtype != dtype else buffer
    # Every rank (the source too) returns tensors on its own device, in the same layout.
    tensors = TensorDict(received, batch_size=[schema["batch_size"]], device=None) if received else None
    return DataProto(
        batch=tensors, non_tensor_batch=dict(schema["non_tensor_batch"]), meta_info=dict(schema["meta_info"])
    )


def broadcast_over_hops(
    batch: DataProto, hops: list[dist.ProcessGroup], required: StageColumns | None = None, rank_tag: str = ""
) -> DataProto:
    """Broadcast `batch` over each group of `hops` in turn, from each group's first rank (the in-actor broadcast;
    `parallel.batch_broadcast_hops` names the groups). `required` columns are checked at each rank's last hop:
    every rank takes part in one, so a missing column fails everywhere at once instead of leaving the other stages
    waiting; a rank with no hop checks its own batch."""
    if not hops:
        check_columns(column_names(batch), required, rank_tag)
    for i, group in enumerate(hops):
        last = i == len(hops) - 1
        batch = broadcast_dataproto(batch, group, dist.get_global_rank(group, 0), required if last else None, rank_tag)
    return batch
