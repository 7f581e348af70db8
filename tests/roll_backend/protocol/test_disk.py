"""roll_backend/protocol/disk.py: DataProto files, pickle-free, refusing files that are not ours."""

from __future__ import annotations

import pickle
import zipfile

import numpy as np
import pytest
import torch
from dataproto_batches import assert_same, make_batch

from roll_backend.keys import META_METRICS
from roll_backend.protocol import (
    DataProto,
    NotADataProtoFileError,
)


def test_save_and_load_round_trip_every_dtype_without_pickle(tmp_path):
    data = make_batch(
        5, meta_info={"temperature": 0.7, META_METRICS: {"loss": [1.5]}, "pair": (1, "a"), "arr": np.arange(3)}
    )
    data["fixed"] = np.array(["ab", "c", "d", "e", "f"])
    data["scalars"] = [np.float32(1.5), np.int64(2), True, 3, ("t", 1)]
    path = tmp_path / "batch.dp"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    meta_arr = loaded.meta_info.pop("arr")
    data.meta_info.pop("arr")
    assert_same(loaded, data)
    assert np.array_equal(meta_arr, np.arange(3)) and type(loaded["scalars"][0]) is np.float32
    with zipfile.ZipFile(path) as archive:
        assert sorted(archive.namelist()) == [
            "batch.safetensors",
            "dataproto.json",
            "non_tensor/2.npy",
            "non_tensor/3.npy",
        ]


def test_save_refuses_objects_json_cannot_hold(tmp_path):
    data = DataProto.from_dict(non_tensors={"obj": [object()]})
    with pytest.raises(ValueError, match=r"cannot save non_tensor_batch\['obj'\]: a value of type object"):
        data.save_to_disk(tmp_path / "x.dp")


def test_save_and_load_batchless(tmp_path):
    data = DataProto.from_dict(non_tensors={"t": ["a", "b"]}, meta_info={"k": None})
    data.save_to_disk(tmp_path / "x.dp")
    loaded = DataProto.load_from_disk(tmp_path / "x.dp")
    assert loaded.batch is None and loaded["t"].tolist() == ["a", "b"] and loaded.meta_info == {"k": None}


def test_load_from_disk_refuses_foreign_files_with_our_error(tmp_path):
    data = DataProto.from_dict(tensors={"x": torch.arange(2)}, meta_info={"k": 1})
    torch_file = tmp_path / "torch_save.pt"
    torch.save({"x": torch.arange(2)}, torch_file)
    verl_file = tmp_path / "verl.pkl"  # verl's save_to_disk pickles the whole object
    verl_file.write_bytes(pickle.dumps({"batch": None, "meta_info": {}}))
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("readme.txt", "hi")
    for path, looks_like in ((torch_file, "a torch.save file"), (verl_file, "a pickle"), (other_zip, "a zip without")):
        with pytest.raises(NotADataProtoFileError, match=f"is not a roll-backend DataProto file: it is {looks_like}"):
            DataProto.load_from_disk(path)
    ours = tmp_path / "ours.dp"
    data.save_to_disk(ours)
    assert DataProto.load_from_disk(ours)["x"].tolist() == [0, 1]
