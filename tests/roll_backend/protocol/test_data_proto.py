"""roll_backend/protocol/data_proto.py: indexing, column operations, devices and sizes (without Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataproto_batches import make_batch

from roll_backend import keys
from roll_backend.keys import INPUT_IDS, OLD_LOG_PROBS, UID
from roll_backend.protocol import (
    DataProto,
    DataProtoItem,
)


def test_indexing_by_int_slice_indices_mask_and_name():
    data = make_batch(6)
    item = data[-1]
    assert (
        isinstance(item, DataProtoItem)
        and torch.equal(item.batch[INPUT_IDS], data[INPUT_IDS][5])
        and item.non_tensor_batch[UID] == "uid-5"
    )
    view = data[1:5:2]
    assert view[UID].tolist() == ["uid-1", "uid-3"] and view[INPUT_IDS].data_ptr() == data[INPUT_IDS][1].data_ptr()
    for index in ([4, -6], np.array([4, 0]), torch.tensor([4, 0])):
        assert data[index][UID].tolist() == ["uid-4", "uid-0"]
    mask = np.array([True, False, False, True, False, False])
    assert data[mask][UID].tolist() == data[torch.from_numpy(mask)][UID].tolist() == ["uid-0", "uid-3"]
    assert isinstance(data[INPUT_IDS], torch.Tensor) and isinstance(data[UID], np.ndarray)


def test_bad_indices_say_what_is_wrong():
    data = make_batch(4)
    with pytest.raises(IndexError, match="out of range for 4 rows"):
        data[[0, 4]]
    with pytest.raises(ValueError, match="bool mask has 3 entries but the DataProto has 4 rows"):
        data[[True, False, True]]
    with pytest.raises(KeyError, match="no column 'nope'"):
        data["nope"]


def test_select_pop_rename():
    data = make_batch(4, meta_info={"a": 1, "b": 2})
    picked = data.select(batch_keys=[INPUT_IDS], non_tensor_batch_keys=[UID], meta_info_keys=["a"])
    assert (
        list(picked.batch.keys()) == [INPUT_IDS]
        and list(picked.non_tensor_batch) == [UID]
        and picked.meta_info == {"a": 1}
    )
    assert picked[INPUT_IDS].data_ptr() == data[INPUT_IDS].data_ptr()
    copied = data.select(deepcopy=True)
    assert copied[INPUT_IDS].data_ptr() != data[INPUT_IDS].data_ptr()
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['missing'\]"):
        data.select(batch_keys=["missing"])

    popped = data.pop(batch_keys=[OLD_LOG_PROBS], non_tensor_batch_keys=["weights"], meta_info_keys=["b"])
    assert (
        list(popped.batch.keys()) == [OLD_LOG_PROBS]
        and list(popped.non_tensor_batch) == ["weights"]
        and popped.meta_info == {"b": 2}
    )
    assert OLD_LOG_PROBS not in data and "weights" not in data and data.meta_info == {"a": 1}

    assert data.rename([INPUT_IDS, UID], ["ids", "group"]) is data
    assert "ids" in data and "group" in data and INPUT_IDS not in data
    with pytest.raises(ValueError, match="column 'ids' already exists"):
        data.rename("group", "ids")


def test_to_device_and_size_summary():
    data = make_batch(4)
    assert data.to("cpu") is data and data[INPUT_IDS].device.type == "cpu"
    tensor_bytes = sum(v.numel() * v.element_size() for v in data.batch.values())
    assert data.nbytes == tensor_bytes + sum(v.nbytes for v in data.non_tensor_batch.values())
    assert data.size_summary().startswith("DataProto: 4 rows")


def test_dispatch_padding_is_dropped_one_way():
    """`without_padding` drops the rows the DP split repeated and their marker column (or the column alone with
    keep_rows); a batch without padding is returned as it is."""
    batch = DataProto.from_dict(
        tensors={"x": torch.arange(4), keys.DISPATCH_PADDING: torch.tensor([False, False, True, True])},
        non_tensors={"text": np.array(list("abcd"), dtype=object)},
    )
    assert batch.padding_mask().tolist() == [False, False, True, True]
    real = batch.without_padding()
    assert real.batch["x"].tolist() == [0, 1] and list(real.non_tensor_batch["text"]) == ["a", "b"]
    assert keys.DISPATCH_PADDING not in real.batch.keys() and keys.DISPATCH_PADDING in batch.batch.keys()
    kept = batch.without_padding(keep_rows=True)
    assert kept.batch["x"].tolist() == [0, 1, 2, 3] and keys.DISPATCH_PADDING not in kept.batch.keys()
    plain = DataProto.from_dict(tensors={"x": torch.arange(3)})
    assert plain.without_padding() is plain and plain.padding_mask().tolist() == [False] * 3
