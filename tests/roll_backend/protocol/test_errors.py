"""roll_backend/protocol/errors.py: DataProto's errors are ValueErrors that verl's `except AssertionError` still
catches."""

from __future__ import annotations

import pytest
import torch

from roll_backend.protocol import (
    DataProto,
    DataProtoError,
)


def part(rows: int, meta_info: dict) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(rows)}, meta_info=meta_info)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: DataProto.from_dict(tensors={"x": torch.zeros(2, 3)}, num_batch_dims=2), "num_batch_dims=2"),
        (lambda: DataProto.concat([part(1, {"t": 1.0}), part(1, {"t": 0.5})]), r"meta_info\['t'\] differs"),
        (lambda: part(4, {}).chunk(0), "positive int number of chunks, got 0"),
        (lambda: part(2, {}).union(part(3, {})), "self has 2 rows but other has 3"),
    ],
    ids=["num_batch_dims", "concat_meta_conflict", "chunk_zero", "union_rows"],
)
def test_errors_are_catchable_as_verl_and_as_ours(call, message):
    with pytest.raises(AssertionError, match=message) as caught:  # how verl's callers catch them
        call()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, DataProtoError)
