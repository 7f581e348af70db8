"""DP balancing: before a DP dispatch, order the rows so each DP rank gets a near-equal token total.

A DP dispatch hands rank d the d-th of dp_size equal row chunks. RL responses have long-tailed lengths, so
equal rows are unequal work and the step waits for the rank with the most tokens. The balanced modes here
permute the (padded) batch so the chunks are a balanced partition of the token totals (greedy largest-first
under equal row counts, the LPT rule), then undo the permutation on collect: results come back in the input
order. They report the imbalance (max rank tokens / mean rank tokens) before and after, in the collected
DataProto's meta_info metrics or in each metrics dict a method returns.

On by default for the train and log-prob calls of the Megatron roles; a batch opts out with
`batch.meta_info[META_BALANCE_DP] = False`.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
import torch

from roll_backend import keys
from roll_backend.distributed.dispatch import Dispatch, DispatchError, DispatchMode, SplitResult, register_dispatch_mode
from roll_backend.distributed.parallel import RankCoords
from roll_backend.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

META_BALANCE_DP = "balance_dp"  # bool, default True: balance DP ranks by tokens in the balanced modes
IMBALANCE_BEFORE = "dp_token_imbalance_before"  # max / mean tokens per DP rank with contiguous chunks
IMBALANCE_AFTER = "dp_token_imbalance_after"  # the same after balancing


def balanced_partition(weights: Sequence[float], parts: int) -> list[list[int]]:
    """`parts` lists of len(weights) / parts indices each, heaviest first onto the lightest part with room."""
    if len(weights) % parts:
        raise ValueError(f"{len(weights)} rows do not split into {parts} equal parts; pad the batch to a multiple of {parts}")
    capacity = len(weights) // parts
    heap = [(0.0, part) for part in range(parts)]  # (total, part): parts with room left
    members: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(weights)), key=lambda i: -weights[i]):
        total, part = heapq.heappop(heap)
        members[part].append(index)
        if len(members[part]) < capacity:
            heapq.heappush(heap, (total + weights[index], part))
    return [sorted(m) for m in members]


def imbalance(weights: Sequence[float], partition: list[list[int]]) -> float:
    """max over parts of the part's total divided by the mean part total (1.0 = perfectly even)."""
    totals = [sum(weights[i] for i in part) for part in partition]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean else 1.0


def row_tokens(batch: DataProto) -> list[float] | None:
    """Tokens per row (attention mask), or None when the batch has no attention mask."""
    if batch.batch is None or keys.ATTENTION_MASK not in batch.batch.keys():
        return None
    return batch.batch[keys.ATTENTION_MASK].sum(-1).tolist()


def _balanced_split(base: DispatchMode):
    def split(coords: Sequence[RankCoords], args, kwargs) -> SplitResult:
        dp_size = coords[0].dp_size
        batches = [(k, v) for k, v in [*enumerate(args), *kwargs.items()] if isinstance(v, DataProto)]
        if dp_size == 1 or len(batches) != 1 or not batches[0][1].meta_info.get(META_BALANCE_DP, True):
            return base.split(coords, args, kwargs)
        key, batch = batches[0]
        if row_tokens(batch) is None or len(batch) == 0:
            return base.split(coords, args, kwargs)
        # Pad here as the base split would (repeated rows, marked), so it receives an even batch in balanced order.
        padded, pad = pad_dataproto_to_divisor(batch, dp_size)
        if pad:
            padded[keys.DISPATCH_PADDING] = torch.arange(len(padded)) >= len(batch)
        weights = row_tokens(padded)
        partition = balanced_partition(weights, dp_size)
        chunk = len(weights) // dp_size
        contiguous = [list(range(d * chunk, (d + 1) * chunk)) for d in range(dp_size)]
        order = np.concatenate(partition)
        reordered = padded.select_idxs(order)
        new_args = [reordered if i == key else a for i, a in enumerate(args)]
        new_kwargs = {k: reordered if k == key else v for k, v in kwargs.items()}
        result = base.split(coords, tuple(new_args), new_kwargs)
        context = dict(result.context, balance_order=order, input_len=len(batch), pad_size=pad, balance_metrics={
            IMBALANCE_BEFORE: imbalance(weights, contiguous), IMBALANCE_AFTER: imbalance(weights, partition)})
        return SplitResult(result.per_rank, context)

    return split


def _balanced_collect(base: DispatchMode):
    def collect(coords: Sequence[RankCoords], outputs: list, context: dict):
        if "balance_order" not in context:
            return base.collect(coords, outputs, context)
        order, metrics = context["balance_order"], context["balance_metrics"]
        merged = base.collect(coords, outputs, dict(context, pad_size=0, input_len=len(order)))
        if not isinstance(merged, DataProto):  # e.g. one metrics dict per DP rank
            return [dict(out, **metrics) if isinstance(out, dict) else out for out in merged]
        if len(merged) != len(order):
            raise DispatchError(f"a DP-balanced method must return one row per input row; got {len(merged)} for {len(order)}")
        restored = unpad_dataproto(merged.select_idxs(np.argsort(order)), context["pad_size"])
        restored.meta_info.setdefault(keys.META_METRICS, {}).update(metrics)
        return restored

    return collect


def balanced(base: DispatchMode) -> DispatchMode:
    """`base` (a DP mode) with its rows balanced by tokens over DP ranks."""
    return register_dispatch_mode(DispatchMode(f"{base.name}_balanced", _balanced_split(base), _balanced_collect(base),
                                               broadcast_in_actor=base.broadcast_in_actor))


DP_MP_COMPUTE_BALANCED = balanced(Dispatch.DP_MP_COMPUTE)
DP_MP_DISPATCH_FIRST_BALANCED = balanced(Dispatch.DP_MP_DISPATCH_FIRST)
