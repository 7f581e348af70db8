"""Buckets of HF weights (strategies/megatron/weights.bucketed, what a weight sync sends) without ranks: the sizes
they group by, and what stays alive while the next tensor is gathered."""

from __future__ import annotations

import gc
import weakref

import torch

from roll_backend.strategies.megatron.weights import bucketed


def _gathered(sizes: list[int], made: list, alive_at_gather: list):
    """Float32 tensors of `sizes` elements, produced one at a time as a gather would; before each, how many of the
    tensors made so far are still alive goes to `alive_at_gather`."""
    for index, size in enumerate(sizes):
        gc.collect()
        alive_at_gather.append(sum(ref() is not None for ref in made))
        tensor = torch.zeros(size)
        made.append(weakref.ref(tensor))
        yield f"t{index}", tensor
        del tensor


def test_buckets_group_up_to_the_size_and_the_previous_bucket_is_gone_while_the_next_is_gathered():
    sizes = [3, 3, 5, 1, 2, 9, 2]  # elements; float32: 4 bytes each
    made, alive_at_gather, seen = [], [], []
    for bucket in bucketed(_gathered(sizes, made, alive_at_gather), bucket_bytes=8 * 4):
        seen.append([name for name, _ in bucket])  # (the usual consumer: its loop variable keeps the list)
    assert seen == [["t0", "t1"], ["t2", "t3", "t4"], ["t5"], ["t6"]]  # a tensor over the size goes alone
    # Alive at each gather: the bucket being filled and, at a bucket's first tensor, the tensor that ended the
    # bucket before (gathered to learn that it would overflow); never a bucket the consumer already had, nor a full
    # one (t2-t4 fill theirs exactly, t5 is over the size alone: both go before the next gather).
    assert alive_at_gather == [0, 1, 2, 1, 2, 0, 0]
    gc.collect()
    assert all(ref() is None for ref in made)  # nothing kept once the consumer is done
