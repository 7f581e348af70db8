"""Batches and comparisons the DataProto tests share (imported by name: tests have no packages)."""

from __future__ import annotations

import pickle

import numpy as np
import torch
from hypothesis import settings

from roll_backend.keys import ATTENTION_MASK, INPUT_IDS, OLD_LOG_PROBS, PROMPT_TEXT, UID
from roll_backend.protocol import DataProto

PROPERTY = settings(max_examples=60, deadline=None)


def make_batch(rows: int, seed: int = 0, meta_info: dict | None = None) -> DataProto:
    """Every dtype a batch carries: int64, bool, float32, bf16 tensors, object and numeric non-tensor columns."""
    gen = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        tensors={
            INPUT_IDS: torch.randint(0, 1000, (rows, 5), generator=gen),
            ATTENTION_MASK: torch.randint(0, 2, (rows, 5), generator=gen).bool(),
            OLD_LOG_PROBS: torch.randn(rows, 3, generator=gen),
            "ref_bf16": torch.randn(rows, 3, generator=gen).to(torch.bfloat16),
        },
        non_tensors={
            UID: [f"uid-{i}" for i in range(rows)],
            PROMPT_TEXT: [None if i % 3 == 0 else {"turns": [f"q{i}", i], "score": i / 7} for i in range(rows)],
            "weights": np.arange(rows, dtype=np.float64) / 3,
        },
        meta_info={"temperature": 0.7} if meta_info is None else meta_info,
    )


def assert_same(actual: DataProto, expected: DataProto) -> None:
    """Same columns in the same order, bit-identical values (bf16 compared as bits), same meta_info."""
    assert len(actual) == len(expected)
    assert list(actual.batch.keys()) == list(expected.batch.keys())
    for key, value in expected.batch.items():
        got = actual.batch[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()]
        assert torch.equal(got.view(width), value.view(width)), key
    assert list(actual.non_tensor_batch) == list(expected.non_tensor_batch)
    for key, value in expected.non_tensor_batch.items():
        got = actual.non_tensor_batch[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert got.tolist() == value.tolist(), key
    assert actual.meta_info == expected.meta_info


def oob_round_trip(data: DataProto) -> DataProto:
    """Pickle as Ray does (protocol 5, buffers out of band) and unpickle over read-only copies of the buffers."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(payload, buffers=[memoryview(bytes(b.raw())) for b in buffers])
