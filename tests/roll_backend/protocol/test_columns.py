"""roll_backend/protocol/columns.py: what a column may be, checked when a DataProto is built or a column set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataproto_batches import make_batch

from roll_backend.keys import UID
from roll_backend.protocol import (
    DataProto,
)


def test_from_dict_infers_batch_size_and_makes_lists_1d_object_columns():
    data = DataProto.from_dict(tensors={"obs": torch.zeros(3, 4)}, non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]]})
    assert len(data) == 3 and data.batch.batch_size == torch.Size([3])
    assert data["pairs"].dtype == object and data["pairs"].shape == (3,) and data["pairs"][1] == [3, 4]


def test_from_single_dict_splits_tensors_from_other_columns():
    data = DataProto.from_single_dict(
        {"ids": torch.ones(2, 3), "text": ["a", "b"], "w": np.ones(2)}, meta_info={"k": 1}
    )
    assert (
        list(data.batch.keys()) == ["ids"]
        and list(data.non_tensor_batch) == ["text", "w"]
        and data.meta_info == {"k": 1}
    )


def test_len_of_batchless_and_empty_dataprotos():
    assert len(DataProto(batch=None, non_tensor_batch={"a": np.array(["x", "y"], dtype=object)})) == 2
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info={"k": 1})) == 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: DataProto.from_dict(tensors={"a": torch.zeros(3), "b": torch.zeros(4)}),
            r"tensors\['b'\] has 4 rows but tensors\['a'\] has 3",
        ),
        (
            lambda: DataProto.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"t": ["x"]}),
            r"non_tensor_batch\['t'\] has 1 rows but the tensor batch has 3",
        ),
        (
            lambda: DataProto.from_dict(non_tensors={"t": np.array(5)}),
            r"non_tensor_batch\['t'\] must be a numpy array with a batch dim",
        ),
        (lambda: DataProto.from_dict(tensors={"a": np.zeros(3)}), r"tensors\['a'\] must be a torch.Tensor"),
        (lambda: DataProto.from_dict(tensors={"a": torch.zeros(3)}, num_batch_dims=2), "num_batch_dims=2"),
        (
            lambda: DataProto.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"a": ["x", "y", "z"]}),
            r"\['a'\] are in both",
        ),
    ],
)
def test_inconsistent_columns_are_rejected_with_the_fix(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_setitem_adds_and_replaces_columns_of_the_right_length():
    data = make_batch(3)
    data["new"] = torch.arange(3)
    data[UID] = ["x", "y", "z"]
    assert data["new"].tolist() == [0, 1, 2] and data[UID].tolist() == ["x", "y", "z"]
    with pytest.raises(ValueError, match="column 'bad' has shape \\(2,\\) but the DataProto has 3 rows"):
        data["bad"] = torch.arange(2)
