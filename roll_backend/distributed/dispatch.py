"""Dispatch modes: how a group call splits its arguments across ranks and collects the results.

One table of (split, collect) pairs. A mode is a `DispatchMode` value; new modes are added with
`register_dispatch_mode` (no edit of this file needed). Worker methods are tagged with `@register(mode)`
and the Cluster turns each tagged method into a group method of the same name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from roll_backend import keys
from roll_backend.distributed.parallel import RankCoords
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


_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(mode: DispatchMode) -> DispatchMode:
    if mode.name in _MODES:
        raise ValueError(f"dispatch mode {mode.name!r} is already registered; pick another name")
    _MODES[mode.name] = mode
    return mode


def dispatch_modes() -> dict[str, DispatchMode]:
    return dict(_MODES)


# ---- split / collect building blocks ----------------------------------------------------------------

def _split_one_to_all(coords, args, kwargs) -> SplitResult:
    return SplitResult([(args, kwargs)] * len(coords))


def _collect_all(coords, outputs, context):
    return outputs


def _split_all_to_all(coords, args, kwargs) -> SplitResult:
    world = len(coords)
    for value in (*args, *kwargs.values()):
        if not isinstance(value, (list, tuple)) or len(value) != world:
            raise DispatchError(f"ALL_TO_ALL needs every argument as a list of {world} items (one per rank); got {type(value).__name__}")
    return SplitResult(
        [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)]
    )


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
                # Padding repeats real rows; mark them so a trainer can leave them out of the loss.
                padded[keys.DISPATCH_PADDING] = torch.arange(len(padded)) >= len(value)
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

        per_rank.append(
            (tuple(pick(i, a) for i, a in enumerate(args)), {k: pick(k, v) for k, v in kwargs.items()})
        )
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
    if merged.batch is not None and keys.DISPATCH_PADDING in merged.batch.keys():
        merged.pop(batch_keys=[keys.DISPATCH_PADDING])
    return merged


class Dispatch:
    """The built-in modes."""

    ONE_TO_ALL = register_dispatch_mode(DispatchMode("one_to_all", _split_one_to_all, _collect_all))
    ALL_TO_ALL = register_dispatch_mode(DispatchMode("all_to_all", _split_all_to_all, _collect_all))
    DP_MP_COMPUTE = register_dispatch_mode(
        DispatchMode("dp_mp_compute", functools.partial(_split_by_dp, tensors_to_first_only=False), _collect_dp)
    )
    DP_MP_DISPATCH_FIRST = register_dispatch_mode(
        DispatchMode(
            "dp_mp_dispatch_first",
            functools.partial(_split_by_dp, tensors_to_first_only=True),
            _collect_dp,
            broadcast_in_actor=True,
        )
    )


@dataclass(frozen=True)
class MethodDispatch:
    """What `@register` attaches to a worker method: its mode and whether the group call waits."""

    mode: DispatchMode
    blocking: bool = True


def register(dispatch_mode: DispatchMode = Dispatch.ONE_TO_ALL, blocking: bool = True):
    """Tag a Worker method so its Cluster exposes a group method of the same name."""
    if not isinstance(dispatch_mode, DispatchMode):
        raise TypeError(f"register() takes a DispatchMode (e.g. Dispatch.DP_MP_COMPUTE), got {dispatch_mode!r}")

    def tag(method):
        @functools.wraps(method)
        def run_on_rank(self, *args, **kwargs):
            return self.run_registered(method, dispatch_mode, args, kwargs)

        run_on_rank.dispatch = MethodDispatch(dispatch_mode, blocking)
        return run_on_rank

    return tag


def method_dispatch(method) -> MethodDispatch | None:
    return getattr(method, "dispatch", None) if callable(method) else None
