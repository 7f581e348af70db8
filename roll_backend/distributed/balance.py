"""DP balancing math: an order of a batch's rows that gives each DP rank a near-equal token total.

A DP dispatch hands rank d the d-th of dp_size equal row chunks. RL responses have long-tailed lengths, so equal
rows are unequal work and the step waits for the rank with the most tokens. `balanced_order` permutes the (padded)
rows so the chunks are a balanced partition of the token totals (greedy largest-first under equal row counts, the
LPT rule) and measures the imbalance (max rank tokens / mean rank tokens) before and after. The balanced dispatch
modes (distributed/dispatch.py) apply it and undo it on collect.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from roll_backend import keys
from roll_backend.protocol import DataProto

IMBALANCE_BEFORE = "dp_token_imbalance_before"  # metric: max / mean tokens per DP rank with contiguous chunks
IMBALANCE_AFTER = "dp_token_imbalance_after"  # metric: the same after balancing


def balanced_partition(weights: Sequence[float], parts: int) -> list[list[int]]:
    """`parts` lists of len(weights) / parts indices each, heaviest first onto the lightest part with room."""
    if len(weights) % parts:
        raise ValueError(
            f"{len(weights)} rows do not split into {parts} equal parts; pad the batch to a multiple of {parts}"
        )
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


@dataclass(frozen=True)
class BalancedOrder:
    """Rows in this order, cut into `parts` equal contiguous chunks, give each part a near-equal token total."""

    order: np.ndarray  # [rows] int64, a permutation of the rows
    metrics: dict[str, float]  # IMBALANCE_BEFORE / IMBALANCE_AFTER


def balanced_order(weights: Sequence[float], parts: int) -> BalancedOrder:
    partition = balanced_partition(weights, parts)
    chunk = len(weights) // parts
    contiguous = [list(range(d * chunk, (d + 1) * chunk)) for d in range(parts)]
    metrics = {IMBALANCE_BEFORE: imbalance(weights, contiguous), IMBALANCE_AFTER: imbalance(weights, partition)}
    return BalancedOrder(np.concatenate(partition).astype(np.int64), metrics)
