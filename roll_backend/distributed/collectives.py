"""Collectives inside a parallel group: a DataProto sent in buckets of whole columns.

`broadcast_dataproto` sends a header, then the pickled schema (column names, dtypes, shapes, non-tensor columns,
meta_info) with the first columns' bytes, then the rest in buckets; a large column goes by its own `dist.broadcast`.
No pickled whole batch: pickling tensors copies them (~5x slower, shared STACK.md).
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from roll_backend.protocol import DataProto

# Columns travel together in buckets of up to this many bytes; a larger column travels alone, without a copy (above a
# MiB a collective's fixed cost is small beside its bytes). Offsets in a bucket are aligned for every dtype's view.
BROADCAST_BUCKET_BYTES = 1 << 20
_ALIGN = 64


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
    bucket_bytes: int = BROADCAST_BUCKET_BYTES,
) -> DataProto:
    """Broadcast `batch` from global rank `src` to every rank of `group`; returns the batch on every rank.

    Ranks other than `src` may pass None or a meta-only DataProto. The batch travels in as few collectives as its
    size allows: a header (two lengths), then buckets of whole columns (`_bucket_plan`), the first opening with the
    pickled schema (column names, dtypes, shapes, non-tensor columns, meta_info); a column larger than `bucket_bytes`
    travels alone and is not copied. A batch of small columns is two collectives however many columns it has: on
    gloo each collective is a round of messages between threads and processes, most of a small batch's time.
    `required` columns are checked on every rank against the same schema as soon as it arrived, so a missing column
    raises MissingColumnError everywhere (before the later buckets) instead of leaving some ranks waiting.
    """
    is_src = dist.get_rank() == src
    device = _comm_device(group)
    header = torch.zeros(2, dtype=torch.int64, device=device)
    if is_src:
        schema = _schema_of(batch)
        columns = {key: batch.batch[key].to(device).contiguous() for key in sorted(schema["tensors"])}
        schema_bytes = pickle.dumps(schema, protocol=pickle.HIGHEST_PROTOCOL)
        plan = _bucket_plan(len(schema_bytes), _column_bytes(schema), bucket_bytes)
        header[0], header[1] = len(schema_bytes), _bucket_length(plan[0], len(schema_bytes))
    dist.broadcast(header, src=src, group=group)
    schema_length, first_length = int(header[0]), int(header[1])
    first = torch.empty(first_length, dtype=torch.uint8, device=device)
    if is_src:
        first[:schema_length] = torch.frombuffer(bytearray(schema_bytes), dtype=torch.uint8).to(device)
        _pack(first, plan[0], columns)
    dist.broadcast(first, src=src, group=group)
    if not is_src:
        schema = pickle.loads(first[:schema_length].cpu().numpy().tobytes())
        plan = _bucket_plan(schema_length, _column_bytes(schema), bucket_bytes)
    check_columns(set(schema["tensors"]) | set(schema["non_tensor_batch"]), required, rank_tag)
    if is_src:
        _send_later_buckets(plan, columns, group, src, device)
    received = columns if is_src else _receive_buckets(plan, first, schema["tensors"], group, src, device)
    # Every rank (the source too) returns tensors on its own device, in the same layout.
    tensors = TensorDict(received, batch_size=[schema["batch_size"]], device=None) if received else None
    return DataProto(
        batch=tensors, non_tensor_batch=dict(schema["non_tensor_batch"]), meta_info=dict(schema["meta_info"])
    )


def _send_later_buckets(plan: list, columns: dict, group, src: int, device) -> None:
    for bucket in plan[1:]:
        if len(bucket) == 1:  # a column alone: sent as it is
            dist.broadcast(_as_bytes(columns[bucket[0][0]]), src=src, group=group)
        else:
            buffer = torch.empty(_bucket_length(bucket), dtype=torch.uint8, device=device)
            dist.broadcast(_pack(buffer, bucket, columns), src=src, group=group)


def _receive_buckets(plan: list, first: torch.Tensor, shapes: dict, group, src: int, device) -> dict:
    """The columns of every bucket, the first (already received) included; `shapes`: {column: (dtype, shape)}."""
    received = {}
    for index, bucket in enumerate(plan):
        if index and len(bucket) == 1:  # received straight into the column's own tensor
            dtype, shape = shapes[bucket[0][0]]
            column = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(_as_bytes(column), src=src, group=group)
            received[bucket[0][0]] = column
            continue
        buffer = first if index == 0 else torch.empty(_bucket_length(bucket), dtype=torch.uint8, device=device)
        if index:
            dist.broadcast(buffer, src=src, group=group)
        for key, offset, nbytes in bucket:  # copied out: a view would keep (and pickle) the whole bucket
            dtype, shape = shapes[key]
            received[key] = buffer[offset : offset + nbytes].view(dtype).reshape(shape).clone()
    return received


def _column_bytes(schema: dict) -> list[tuple[str, int]]:
    return [(key, dtype.itemsize * math.prod(shape)) for key, (dtype, shape) in sorted(schema["tensors"].items())]


def _bucket_plan(
    schema_bytes: int, sizes: list[tuple[str, int]], bucket_bytes: int
) -> list[list[tuple[str, int, int]]]:
    """The buckets a batch travels in, as (column, byte offset, bytes) lists: the first bucket opens with the pickled
    schema (`schema_bytes`), then columns join the open bucket in order until the next would pass `bucket_bytes`; a
    column larger than that travels alone. Sender and receivers derive the same plan from the schema."""
    buckets: list[list[tuple[str, int, int]]] = [[]]
    used = _aligned(schema_bytes)
    for key, nbytes in sizes:
        if used and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((key, used, nbytes))
        used = _aligned(used + nbytes)
    return buckets


def _bucket_length(bucket: list[tuple[str, int, int]], schema_bytes: int = 0) -> int:
    return max([schema_bytes] + [offset + nbytes for _, offset, nbytes in bucket])


def _aligned(nbytes: int) -> int:
    """The next offset at which any dtype's view of a byte buffer may start."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (any dtype; bool and int16, which gloo or NCCL cannot send as
    themselves, included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _pack(buffer: torch.Tensor, bucket: list[tuple[str, int, int]], columns: dict) -> torch.Tensor:
    for key, offset, nbytes in bucket:
        buffer[offset : offset + nbytes] = _as_bytes(columns[key])
    return buffer


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
