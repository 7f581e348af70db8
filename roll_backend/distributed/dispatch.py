"""Dispatch modes: how a group call splits its arguments across ranks and collects the results.

One table, `Dispatch`, of (split, collect) pairs; a new mode is one entry there. Worker methods are tagged with
`@register(mode)`, and `WorkerGroup.call(Worker.method, ...)` splits, sends and collects by the tag. The balanced
DP modes order rows with the token-balancing math of `balance.py` and undo the order on collect.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from roll_backend import keys
from roll_backend.distributed.balance import balanced_order, row_tokens
from roll_backend.distributed.layout import RankCoords
from roll_backend.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto


class DispatchError(RuntimeError):
    """A group call failed: bad arguments for the mode, or an error on a rank. For a rank's error the message is
    one line, "ROLE.METHOD failed on rank R/W, dp= tp= pp= cp=: TYPE: MESSAGE", and the remote traceback is
    the exception's __cause__ (and in the driver's log)."""


@dataclass(frozen=True)
class SplitResult:
    """Per-rank (args, kwargs) plus whatever the matching collect needs to undo the split."""

    per_rank: list[tuple[tuple, dict]]
    context: dict = field(default_factory=dict)


SplitFn = Callable[[Sequence[RankCoords], tuple, dict], SplitResult]
CollectFn = Callable[[Sequence[RankCoords], list, dict], Any]


@dataclass(frozen=True)
class DispatchMode:
    """A named (split, collect) pair. `broadcast_in_actor`: ranks that got meta only receive the batch
    inside the actor (over TPxCP, then PP) before the method body runs."""

    name: str
    split: SplitFn = field(repr=False)
    collect: CollectFn = field(repr=False)
    broadcast_in_actor: bool = False


# ---- split / collect building blocks ----------------------------------------------------------------


def _split_one_to_all(coords, args, kwargs) -> SplitResult:
    return SplitResult([(args, kwargs)] * len(coords))


def _collect_all(coords, outputs, context):
    return outputs


def _split_all_to_all(coords, args, kwargs) -> SplitResult:
    world = len(coords)
    for value in (*args, *kwargs.values()):
        if not isinstance(value, (list, tuple)) or len(value) != world:
            raise DispatchError(
                f"ALL_TO_ALL needs every argument as a list of {world} items (one per rank); got {type(value).__name__}"
            )
    return SplitResult([(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)])


def _meta_only(batch: DataProto) -> DataProto:
    return DataProto(batch=None, non_tensor_batch={}, meta_info=dict(batch.meta_info))


def _split_by_dp(coords: Sequence[RankCoords], args, kwargs, tensors_to_first_only: bool) -> SplitResult:
    """Pad every DataProto argument to a multiple of dp_size, chunk it, and hand chunk `dp` to each rank."""
    dp_size = coords[0].dp_size
    chunks_of: dict[int | str, list[DataProto]] = {}
    pad_sizes = []
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, DataProto):
            padded, pad_size = pad_dataproto_to_divisor(value, dp_size)
            if pad_size:
                _mark_padding(padded, len(value))
            pad_sizes.append((len(value), pad_size))
            chunks_of[key] = padded.chunk(dp_size)
    if not chunks_of:
        raise DispatchError("a DP dispatch mode needs at least one DataProto argument to split")
    per_rank = []
    for c in coords:
        gets_tensors = c.is_first_of_model_parallel or not tensors_to_first_only

        def pick(key, value, c=c, gets_tensors=gets_tensors):
            if key not in chunks_of:
                return value
            chunk = chunks_of[key][c.dp]
            return chunk if gets_tensors else _meta_only(chunk)

        per_rank.append((tuple(pick(i, a) for i, a in enumerate(args)), {k: pick(k, v) for k, v in kwargs.items()}))
    return SplitResult(per_rank, {"input_len": pad_sizes[0][0], "pad_size": pad_sizes[0][1], "dp_size": dp_size})


def _collect_dp(coords: Sequence[RankCoords], outputs: list, context: dict):
    """Concatenate the outputs of tp0/cp0/last-pp ranks in DP order and drop the padding rows."""
    by_dp = sorted((c.dp, out) for c, out in zip(coords, outputs) if c.is_collect_rank)
    parts = [out for _, out in by_dp]
    if not all(isinstance(p, DataProto) for p in parts):
        return parts
    merged = DataProto.concat(parts)
    pad_size = context["pad_size"]
    if pad_size:
        # A method may return k rows per input row (e.g. n samples per prompt): the padding scales with it.
        rows_per_input = len(merged) // (context["input_len"] + pad_size)
        merged = unpad_dataproto(merged, pad_size * rows_per_input)
    return merged.without_padding(keep_rows=True)  # (unpadded above; the balanced collect reorders first)


def _mark_padding(padded: DataProto, real_rows: int) -> DataProto:
    """Padding repeats real rows; mark them so a trainer can leave them out of the loss."""
    padded[keys.DISPATCH_PADDING] = torch.arange(len(padded)) >= real_rows
    return padded


def _balanced_split(base_split: SplitFn) -> SplitFn:
    """`base_split` (a DP split) of the one DataProto argument reordered so each DP rank gets near-equal tokens."""

    def split(coords: Sequence[RankCoords], args, kwargs) -> SplitResult:
        dp_size = coords[0].dp_size
        batches = [(k, v) for k, v in [*enumerate(args), *kwargs.items()] if isinstance(v, DataProto)]
        if dp_size == 1 or len(batches) != 1 or not batches[0][1].meta_info.get(keys.META_BALANCE_DP, True):
            return base_split(coords, args, kwargs)
        key, batch = batches[0]
        if row_tokens(batch) is None or len(batch) == 0:
            return base_split(coords, args, kwargs)
        # Pad here as the base split would (repeated rows, marked), so it receives an even batch in balanced order.
        padded, pad = pad_dataproto_to_divisor(batch, dp_size)
        if pad:
            _mark_padding(padded, len(batch))
        balanced = balanced_order(row_tokens(padded), dp_size)
        reordered = padded.select_idxs(balanced.order)
        new_args = tuple(reordered if i == key else a for i, a in enumerate(args))
        new_kwargs = {k: reordered if k == key else v for k, v in kwargs.items()}
        result = base_split(coords, new_args, new_kwargs)
        context = dict(
            result.context,
            balance_order=balanced.order,
            input_len=len(batch),
            pad_size=pad,
            balance_metrics=balanced.metrics,
        )
        return SplitResult(result.per_rank, context)

    return split


def _balanced_collect(base_collect: CollectFn) -> CollectFn:
    def collect(coords: Sequence[RankCoords], outputs: list, context: dict):
        if "balance_order" not in context:
            return base_collect(coords, outputs, context)
        order, metrics = context["balance_order"], context["balance_metrics"]
        merged = base_collect(coords, outputs, dict(context, pad_size=0, input_len=len(order)))
        if not isinstance(merged, DataProto):  # e.g. one metrics dict per DP rank
            return [dict(out, **metrics) if isinstance(out, dict) else out for out in merged]
        if len(merged) != len(order):
            raise DispatchError(
                f"a DP-balanced method must return one row per input row; got {len(merged)} for {len(order)}"
            )
        restored = unpad_dataproto(merged.select_idxs(np.argsort(order)), context["pad_size"])
        restored.meta_info.setdefault(keys.META_METRICS, {}).update(metrics)
        return restored

    return collect


_split_dp_compute = functools.partial(_split_by_dp, tensors_to_first_only=False)
_split_dp_first = functools.partial(_split_by_dp, tensors_to_first_only=True)


class Dispatch:
    """Every dispatch mode: how a call's arguments reach the ranks and how their results come back."""

    # Same arguments to every rank; a list of every rank's result.
    ONE_TO_ALL = DispatchMode("one_to_all", _split_one_to_all, _collect_all)
    # Argument i of rank r is the r-th item of a list of world_size items; a list of every rank's result.
    ALL_TO_ALL = DispatchMode("all_to_all", _split_all_to_all, _collect_all)
    # DataProto arguments split by DP rank; every rank of a DP group gets its chunk. Collect: DP order, unpadded.
    DP_MP_COMPUTE = DispatchMode("dp_mp_compute", _split_dp_compute, _collect_dp)
    # As DP_MP_COMPUTE, but only tp0/cp0/pp0 of each model-parallel group get tensors (the others the meta); the
    # in-actor broadcast (TP x CP, then PP) hands the batch to the rest before the method body runs.
    DP_MP_DISPATCH_FIRST = DispatchMode("dp_mp_dispatch_first", _split_dp_first, _collect_dp, broadcast_in_actor=True)
    # The two DP modes with rows balanced by tokens over DP ranks (balance.py); `keys.META_BALANCE_DP = False` in
    # the batch's meta opts out. Used by the train and log-prob calls of the Megatron roles.
    DP_MP_COMPUTE_BALANCED = DispatchMode(
        "dp_mp_compute_balanced", _balanced_split(_split_dp_compute), _balanced_collect(_collect_dp)
    )
    DP_MP_DISPATCH_FIRST_BALANCED = DispatchMode(
        "dp_mp_dispatch_first_balanced",
        _balanced_split(_split_dp_first),
        _balanced_collect(_collect_dp),
        broadcast_in_actor=True,
    )


@dataclass(frozen=True)
class MethodDispatch:
    """What `@register` attaches to a worker method: its mode and whether the group call waits."""

    mode: DispatchMode
    blocking: bool = True
    deadline: str | None = None  # the fault_tolerance.timeouts setting its calls run under (roles.DEADLINES)


def register(dispatch_mode: DispatchMode = Dispatch.ONE_TO_ALL, blocking: bool = True, deadline: str | None = None):
    """Tag a Worker method so `WorkerGroup.call(Worker.method, ...)` runs it on every rank by `dispatch_mode`;
    `deadline` names the timeouts setting its calls run under (a fault injected in that phase fires in them)."""
    if not isinstance(dispatch_mode, DispatchMode):
        raise TypeError(f"register() takes a DispatchMode (e.g. Dispatch.DP_MP_COMPUTE), got {dispatch_mode!r}")
    how = MethodDispatch(dispatch_mode, blocking, deadline)

    def tag(method):
        @functools.wraps(method)
        def run_on_rank(self, *args, **kwargs):
            return self.run_registered(method, how, args, kwargs)

        run_on_rank.dispatch = how
        return run_on_rank

    return tag


def method_dispatch(method) -> MethodDispatch | None:
    return getattr(method, "dispatch", None) if callable(method) else None
