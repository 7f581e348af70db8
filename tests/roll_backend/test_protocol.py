"""DataProto without Ray: construction, indexing, column ops, split/join, grouping, padding, files and pickling."""

from __future__ import annotations

import copy
import pickle
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from roll_backend.keys import ATTENTION_MASK, INPUT_IDS, META_METRICS, OLD_LOG_PROBS, PROMPT_TEXT, UID
from roll_backend.protocol import (
    DataProto,
    DataProtoItem,
    SharedReadOnlyTensor,
    SharedTensorWriteError,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)

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


# ----- construction and validation -----


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


# ----- indexing and columns -----


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


def test_setitem_adds_and_replaces_columns_of_the_right_length():
    data = make_batch(3)
    data["new"] = torch.arange(3)
    data[UID] = ["x", "y", "z"]
    assert data["new"].tolist() == [0, 1, 2] and data[UID].tolist() == ["x", "y", "z"]
    with pytest.raises(ValueError, match="column 'bad' has shape \\(2,\\) but the DataProto has 3 rows"):
        data["bad"] = torch.arange(2)


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


def test_union_returns_self_and_names_conflicting_keys():
    data = make_batch(4, meta_info={"t": 1.0})
    other = DataProto.from_dict(
        tensors={INPUT_IDS: data[INPUT_IDS].clone(), "values": torch.ones(4)},
        non_tensors={UID: data[UID].copy(), "nan": np.array([np.nan] * 4)},
        meta_info={"t": 1.0, "u": 2},
    )
    assert data.union(other) is data
    assert "values" in data and "nan" in data and data.meta_info == {"t": 1.0, "u": 2}
    assert data.union(DataProto.from_dict(non_tensors={"nan": np.array([np.nan] * 4)})) is data  # NaN equals NaN
    with pytest.raises(ValueError, match=r"batch\['values'\] differs"):
        data.union(DataProto.from_dict(tensors={"extra": torch.zeros(4), "values": torch.zeros(4)}))
    assert "extra" not in data  # a failed union changes nothing
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] differs"):
        data.union(DataProto.from_dict(non_tensors={UID: ["a", "b", "c", "d"]}))
    with pytest.raises(ValueError, match=r"meta_info\['t'\] differs"):
        data.union(DataProto(meta_info={"t": 2.0}))
    with pytest.raises(ValueError, match="self has 4 rows but other has 2"):
        data.union(DataProto.from_dict(tensors={"x": torch.zeros(2)}))


# ----- splitting and joining -----


def test_chunk_sizes_follow_array_split_and_split_keeps_a_short_tail():
    data = make_batch(10)
    assert [len(c) for c in data.chunk(3)] == [4, 3, 3]
    assert [len(c) for c in make_batch(2).chunk(4)] == [1, 1, 0, 0]
    assert [len(s) for s in data.split(4)] == [4, 4, 2]
    assert [len(s) for s in make_batch(0).split(4)] == [0]
    assert data.chunk(3)[1][UID].tolist() == ["uid-4", "uid-5", "uid-6"]
    with pytest.raises(ValueError, match="positive int number of chunks, got 0"):
        data.chunk(0)


def test_concat_extends_metrics_and_rejects_disagreeing_meta():
    parts = [
        make_batch(2, seed=i, meta_info={"temperature": 0.7, META_METRICS: {"loss": [float(i)], "lr": 0.1}})
        for i in range(3)
    ]
    joined = DataProto.concat(parts)
    assert len(joined) == 6 and joined.meta_info == {
        "temperature": 0.7,
        META_METRICS: {"loss": [0.0, 1.0, 2.0], "lr": [0.1] * 3},
    }
    assert parts[0].meta_info[META_METRICS]["loss"] == [0.0]  # inputs untouched
    parts[2].meta_info["temperature"] = 1.0
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs between parts"):
        DataProto.concat(parts)


def test_concat_errors():
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])
    with pytest.raises(ValueError, match=r"part 1 has batch keys .* \(missing \['old_log_probs'\], extra \[\]\)"):
        DataProto.concat([make_batch(2), make_batch(2).select(batch_keys=[INPUT_IDS, ATTENTION_MASK, "ref_bf16"])])
    other = make_batch(2)
    other[OLD_LOG_PROBS] = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"batch\['old_log_probs'\] is torch.float32 \(3,\) per row in part 0 but torch.float64"
    ):
        DataProto.concat([make_batch(2), other])


def test_repeat_interleaves_or_tiles():
    data = DataProto.from_dict(tensors={"obs": torch.tensor([[1, 2], [3, 4]])}, non_tensors={"l": ["a", "b"]})
    assert data.repeat(2)["obs"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4]] and data.repeat(2)["l"].tolist() == [
        "a",
        "a",
        "b",
        "b",
    ]
    tiled = data.repeat(repeat_times=2, interleave=False)
    assert tiled["obs"].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]] and tiled["l"].tolist() == ["a", "b", "a", "b"]


def test_reorder_is_in_place():
    data = make_batch(4, meta_info={"k": 1})
    data.reorder(torch.tensor([3, 0, 2, 1]))
    assert data[UID].tolist() == ["uid-3", "uid-0", "uid-2", "uid-1"] and data.meta_info == {"k": 1}


def test_group_by_keeps_first_appearance_order_and_row_order():
    data = DataProto.from_dict(tensors={"x": torch.arange(6)}, non_tensors={"g": ["b", "a", "b", "c", "a", "b"]})
    groups = data.group_by("g")
    assert list(groups) == ["b", "a", "c"]
    assert {k: v["x"].tolist() for k, v in groups.items()} == {"b": [0, 2, 5], "a": [1, 4], "c": [3]}
    contiguous = data[[0, 2, 5, 1, 4, 3]]
    views = contiguous.group_by("g")
    assert views["a"]["x"].data_ptr() == contiguous["x"][3:].data_ptr()  # already grouped: slices, no copy
    assert groups["a"]["x"].data_ptr() != data["x"][1:].data_ptr()  # interleaved keys: one gather
    by_tensor = DataProto.from_dict(tensors={"group": torch.tensor([7, 3, 7]), "x": torch.arange(3)}).group_by("group")
    assert list(by_tensor) == [7, 3] and isinstance(next(iter(by_tensor)), int)
    with pytest.raises(ValueError, match="group_by needs a 1-D column"):
        DataProto.from_dict(tensors={"m": torch.zeros(2, 2)}).group_by("m")


def test_make_iterator_shuffles_reproducibly_and_covers_every_row():
    data = make_batch(10)

    def run(seed):
        iterator = data.make_iterator(4, epochs=2, seed=seed, dataloader_kwargs={"shuffle": True})
        return [mb[UID].tolist() for mb in iterator]

    first = run(1)
    assert first == run(1) and [len(mb) for mb in first] == [4, 4, 2] * 2
    assert sorted(sum(first[:3], [])) == sorted(data[UID].tolist()) and first[:3] != first[3:]
    assert [mb[UID].tolist() for mb in data.make_iterator(5, epochs=1)] == [
        data[UID][:5].tolist(),
        data[UID][5:].tolist(),
    ]
    assert [len(mb) for mb in data.make_iterator(4, 1, dataloader_kwargs={"drop_last": True})] == [4, 4]
    with pytest.raises(ValueError, match="got also \\['num_workers'\\]"):
        data.make_iterator(4, 1, dataloader_kwargs={"num_workers": 2})


def test_pad_repeats_real_rows_and_unpad_removes_them():
    data = make_batch(3)
    padded, pad_size = pad_dataproto_to_divisor(data, 7)
    assert pad_size == 4 and padded[UID].tolist() == ["uid-0", "uid-1", "uid-2", "uid-0", "uid-1", "uid-2", "uid-0"]
    assert_same(unpad_dataproto(padded, pad_size), data)
    assert pad_dataproto_to_divisor(data, 3) == (data, 0)
    assert data.pad_to_divisor(2) == 1 and len(data) == 4
    assert len(data.unpad(1)) == 3
    with pytest.raises(ValueError, match="size_divisor must be a positive int, got 0"):
        data.pad_to_divisor(0)


def test_to_device_and_size_summary():
    data = make_batch(4)
    assert data.to("cpu") is data and data[INPUT_IDS].device.type == "cpu"
    tensor_bytes = sum(v.numel() * v.element_size() for v in data.batch.values())
    assert data.nbytes == tensor_bytes + sum(v.nbytes for v in data.non_tensor_batch.values())
    assert data.size_summary().startswith("DataProto: 4 rows")


# ----- files -----


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


# ----- pickling and read-only shared columns -----


def test_out_of_band_pickle_is_zero_copy_and_read_only():
    data = make_batch(4)
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 2000 and len(buffers) == 5  # 4 tensors + the float64 column travel out of band
    shared = [memoryview(bytes(b.raw())) for b in buffers]
    received = pickle.loads(payload, buffers=shared)
    buffer_start = np.frombuffer(shared[0], dtype=np.uint8).ctypes.data
    assert received[INPUT_IDS].data_ptr() == buffer_start  # the tensor views the buffer, no copy
    assert sorted(received.shared_keys()) == sorted([INPUT_IDS, ATTENTION_MASK, OLD_LOG_PROBS, "ref_bf16", "weights"])
    assert isinstance(received["ref_bf16"], SharedReadOnlyTensor) and received["ref_bf16"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.add_(1),
        lambda t: t.__setitem__(0, 1),
        lambda t: t[1:3].zero_(),
        lambda t: t.view(-1).fill_(0),
        lambda t: t.T.mul_(2),
        lambda t: torch.add(t, 1, out=t),
        lambda t: torch.nn.functional.relu(t, inplace=True),
        lambda t: t.unbind()[0].copy_(torch.zeros(3)),
    ],
)
def test_every_in_place_write_to_a_shared_tensor_raises(write):
    received = oob_round_trip(make_batch(4))
    with pytest.raises(SharedTensorWriteError, match="make_writable"):
        write(received[OLD_LOG_PROBS])
    with pytest.raises(ValueError, match="read-only"):
        received[OLD_LOG_PROBS].numpy()[0, 0] = 1.0


def test_shared_tensors_read_and_train_like_plain_ones():
    received = oob_round_trip(make_batch(4))
    logp = received[OLD_LOG_PROBS]
    assert (
        type(logp * 2) is torch.Tensor and type(logp.clone()) is torch.Tensor and type(logp[1:]) is SharedReadOnlyTensor
    )
    embedding = torch.nn.Embedding(1000, 4)
    (embedding(received[INPUT_IDS]).sum() + (logp * embedding.weight[0, 0]).sum()).backward()
    assert embedding.weight.grad is not None
    joined = DataProto.concat(received.chunk(2))
    assert joined.shared_keys() == [] and type(joined[INPUT_IDS]) is torch.Tensor  # concat copies every column


def test_make_writable_copies_only_the_requested_columns():
    received = oob_round_trip(make_batch(4))
    received.make_writable([INPUT_IDS, "weights"])
    received[INPUT_IDS].add_(1)
    received["weights"][0] = 5.0
    assert sorted(received.shared_keys()) == sorted([ATTENTION_MASK, OLD_LOG_PROBS, "ref_bf16"])
    assert copy.deepcopy(received).shared_keys() == [] and received.select(deepcopy=True).shared_keys() == []


def test_in_band_pickle_gives_private_writable_tensors():
    received = pickle.loads(pickle.dumps(make_batch(3)))
    assert received.shared_keys() == [] and type(received[INPUT_IDS]) is torch.Tensor


# ----- properties -----


@PROPERTY
@given(rows=st.integers(0, 40), chunks=st.integers(1, 12))
def test_chunk_then_concat_is_identity(rows, chunks):
    data = make_batch(rows, seed=rows)
    parts = data.chunk(chunks)
    sizes = [len(p) for p in parts]
    assert (
        len(parts) == chunks
        and sum(sizes) == rows
        and max(sizes) - min(sizes) <= 1
        and sizes == sorted(sizes, reverse=True)
    )
    assert_same(DataProto.concat(parts), data)


@PROPERTY
@given(rows=st.integers(0, 40), split_size=st.integers(1, 12))
def test_split_then_concat_is_identity(rows, split_size):
    data = make_batch(rows, seed=rows)
    parts = data.split(split_size)
    assert all(len(p) == split_size for p in parts[:-1]) and 0 <= len(parts[-1]) <= split_size
    assert_same(DataProto.concat(parts), data)


@PROPERTY
@given(rows=st.integers(0, 30), divisor=st.integers(1, 16))
def test_pad_then_unpad_is_identity(rows, divisor):
    data = make_batch(rows, seed=divisor)
    padded, pad_size = pad_dataproto_to_divisor(data, divisor)
    assert len(padded) % divisor == 0 and 0 <= pad_size < divisor
    assert set(padded[UID].tolist()) == set(data[UID].tolist())  # padding repeats real rows
    assert_same(unpad_dataproto(padded, pad_size), data)
    in_place = data.select()
    assert in_place.pad_to_divisor(divisor) == pad_size
    assert_same(in_place.unpad(pad_size), data)


@PROPERTY
@given(rows=st.integers(0, 20), times=st.integers(1, 5), interleave=st.booleans())
def test_repeat_then_group_by_recovers_the_groups(rows, times, interleave):
    data = make_batch(rows, seed=times)
    groups = data.repeat(times, interleave=interleave).group_by(UID)
    assert list(groups) == data[UID].tolist()
    for i, group in enumerate(groups.values()):
        assert_same(group, data[[i] * times])


@PROPERTY
@given(rows=st.integers(0, 20), seed=st.integers(0, 2**16), out_of_band=st.booleans())
def test_pickle_round_trip_is_exact_for_every_dtype(rows, seed, out_of_band):
    data = make_batch(rows, seed=seed, meta_info={"temperature": 0.5, META_METRICS: {"x": [1.0]}})
    received = oob_round_trip(data) if out_of_band else pickle.loads(pickle.dumps(data))
    assert_same(received, data)
    assert isinstance(received.batch, TensorDict)
