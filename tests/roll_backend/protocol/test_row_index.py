"""roll_backend/protocol/row_index.py through DataProto: chunk/split, repeats, reorder, grouping, mini-batches, padding,
and unfolding columns into rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataproto_batches import PROPERTY, assert_same, make_batch
from hypothesis import given
from hypothesis import strategies as st

from roll_backend.keys import INPUT_IDS, UID
from roll_backend.protocol import (
    DataProto,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)


def test_chunk_sizes_follow_array_split_and_split_keeps_a_short_tail():
    data = make_batch(10)
    assert [len(c) for c in data.chunk(3)] == [4, 3, 3]
    assert [len(c) for c in make_batch(2).chunk(4)] == [1, 1, 0, 0]
    assert [len(s) for s in data.split(4)] == [4, 4, 2]
    assert [len(s) for s in make_batch(0).split(4)] == [0]
    assert data.chunk(3)[1][UID].tolist() == ["uid-4", "uid-5", "uid-6"]
    with pytest.raises(ValueError, match="positive int number of chunks, got 0"):
        data.chunk(0)


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


def test_uneven_chunk_is_kept_and_differs_from_verl():
    sizes = [len(chunk) for chunk in DataProto.from_dict(tensors={"x": torch.arange(10)}).chunk(4)]
    assert sizes == [3, 3, 2, 2]  # verl would assert 10 % 4 == 0


# ----- sample_level_repeat and unfold_column_chunks: verl's semantics, values from verl's own protocol tests -----


def test_sample_level_repeat_repeats_each_row_its_own_count_as_verl():
    obs = torch.tensor([[1, 2], [3, 4], [5, 6]])
    data = DataProto.from_dict(tensors={"obs": obs}, non_tensors={"labels": ["a", "b", "c"]}, meta_info={"info": "i"})
    by_list = data.sample_level_repeat(repeat_times=[3, 1, 2])
    assert by_list["obs"].tolist() == [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]]
    assert by_list["labels"].tolist() == ["a", "a", "a", "b", "c", "c"] and by_list.meta_info == {"info": "i"}
    by_tensor = data.sample_level_repeat(repeat_times=torch.tensor([1, 2, 3]))
    assert by_tensor["obs"].tolist() == [[1, 2], [3, 4], [3, 4], [5, 6], [5, 6], [5, 6]]
    assert by_tensor["labels"].tolist() == ["a", "b", "b", "c", "c", "c"] and len(by_tensor.batch) == 6
    for counts in ((0, 2, 0), np.array([0, 2, 0], dtype=np.int32)):
        assert data.sample_level_repeat(counts)["labels"].tolist() == ["b", "b"]  # a count of 0 drops the row
    assert by_list["obs"].data_ptr() != obs.data_ptr()


@pytest.mark.parametrize(
    ("repeat_times", "message"),
    [
        ([1, 2], "repeat_times has 2 counts but the DataProto has 3 rows"),
        ([1, -1, 2], "counts must be >= 0, got -1 at row 1"),
        ([1.0, 2.0, 1.0], "must be a 1-D sequence of ints, got shape \\(3,\\) dtype float64"),
        (np.ones((3, 1), dtype=np.int64), "must be a 1-D sequence of ints, got shape \\(3, 1\\)"),
        (2, "for one count for every row use repeat\\(\\)"),
    ],
)
def test_sample_level_repeat_refuses_counts_that_do_not_fit(repeat_times, message):
    data = DataProto.from_dict(tensors={"obs": torch.arange(3)})
    with pytest.raises(ValueError, match=message):
        data.sample_level_repeat(repeat_times)


@PROPERTY
@given(counts=st.lists(st.integers(0, 4), max_size=12))
def test_sample_level_repeat_matches_repeat_interleave_by_counts(counts):
    data = make_batch(len(counts), seed=len(counts))
    repeated = data.sample_level_repeat(counts)
    counts_t = torch.tensor(counts, dtype=torch.int64)
    assert len(repeated) == sum(counts) and repeated.meta_info == data.meta_info
    for key, value in data.batch.items():
        assert torch.equal(repeated[key], value.repeat_interleave(counts_t, dim=0)), key
    for key, value in data.non_tensor_batch.items():
        assert repeated[key].tolist() == np.repeat(value, counts, axis=0).tolist(), key
    if counts and len(set(counts)) == 1:
        assert_same(repeated, data.repeat(counts[0]))


def test_unfold_column_chunks_cuts_split_columns_and_repeats_the_rest_as_verl():
    obs1 = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    obs2 = torch.tensor([[1, 2], [5, 6], [9, 10]])
    data = DataProto.from_dict(
        tensors={"obs1": obs1, "obs2": obs2}, non_tensors={"labels": ["a", "b", "c"]}, meta_info={"name": "abc"}
    )
    unfolded = data.unfold_column_chunks(2, split_keys=["obs1"])
    assert unfolded["obs1"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert unfolded["obs2"].tolist() == [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]]
    assert unfolded["labels"].tolist() == ["a", "a", "b", "b", "c", "c"] and unfolded.meta_info == {"name": "abc"}
    assert unfolded.batch.batch_size == torch.Size([6])
    obs3d = torch.tensor([[[1, 1], [2, 2], [3, 3], [4, 4]], [[5, 5], [6, 6], [7, 7], [8, 8]]])
    unfolded = DataProto.from_dict(tensors={"obs": obs3d}).unfold_column_chunks(2, split_keys=["obs"])
    assert unfolded["obs"].tolist() == [[[1, 1], [2, 2]], [[3, 3], [4, 4]], [[5, 5], [6, 6]], [[7, 7], [8, 8]]]


def test_unfold_column_chunks_splits_non_tensor_columns_as_verl():
    pairs = [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]
    expected = [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]
    # verl's from_dict turns equal-length lists into a [B, 2] object array; ours keeps one list per row: both cut
    for column in (np.array(pairs, dtype=object), pairs):
        data = DataProto.from_dict(tensors={"obs": torch.arange(3)}, non_tensors={"labels": column})
        unfolded = data.unfold_column_chunks(2, split_keys=["labels"])
        assert unfolded["labels"].tolist() == expected and unfolded["obs"].tolist() == [0, 0, 1, 1, 2, 2]
        assert unfolded["labels"].shape == ((6, 1) if isinstance(column, np.ndarray) else (6,))
    ragged = DataProto.from_dict(non_tensors={"turns": [[1, 2, 3, 4], ["x", "y"]]}).unfold_column_chunks(2, ["turns"])
    assert ragged["turns"].tolist() == [[1, 2], [3, 4], ["x"], ["y"]]


def test_unfold_column_chunks_without_split_keys_repeats_every_column():
    data = make_batch(3)
    assert_same(data.unfold_column_chunks(3), data.repeat(3))  # verl repeats tensors and fails on non-tensors
    assert_same(data.unfold_column_chunks(1, split_keys=[INPUT_IDS]), data)


@PROPERTY
@given(rows=st.integers(0, 8), n_split=st.integers(1, 4), chunk=st.integers(1, 3))
def test_unfold_column_chunks_is_a_reshape_of_the_split_column(rows, n_split, chunk):
    gen = torch.Generator().manual_seed(rows)
    data = make_batch(rows)
    data["seq"] = torch.randn(rows, n_split * chunk, 2, generator=gen)
    unfolded = data.unfold_column_chunks(n_split, split_keys=["seq"])
    assert unfolded["seq"].shape == (rows * n_split, chunk, 2)
    assert torch.equal(unfolded["seq"].reshape(rows, n_split * chunk, 2), data["seq"])
    for i in range(rows * n_split):  # new row i is chunk i % n_split of old row i // n_split
        old, part = divmod(i, n_split)
        assert torch.equal(unfolded["seq"][i], data["seq"][old, part * chunk : (part + 1) * chunk])
    assert_same(unfolded.select(batch_keys=[INPUT_IDS]), data.select(batch_keys=[INPUT_IDS]).repeat(n_split))


@pytest.mark.parametrize(
    ("n_split", "split_keys", "error", "message"),
    [
        (3, ["seq"], ValueError, "column 'seq' has 4 entries in dim 1, which n_split=3 does not divide"),
        (2, ["flat"], ValueError, r"column 'flat' has shape \(2,\), no second dim to split"),
        (2, ["text"], ValueError, "column 'text' row 0 is str; a split object column holds a list"),
        (2, ["turns"], ValueError, "row 1 is list of length 3, which n_split=2 does not divide"),
        (0, ["seq"], ValueError, "positive int n_split, got 0"),
        (2, ["missing"], KeyError, r"has no key\(s\) \['missing'\]"),
    ],
)
def test_unfold_column_chunks_refuses_columns_it_cannot_cut(n_split, split_keys, error, message):
    data = DataProto.from_dict(
        tensors={"seq": torch.zeros(2, 4), "flat": torch.zeros(2)},
        non_tensors={"text": ["ab", "cd"], "turns": [[1, 2], [1, 2, 3]]},
    )
    with pytest.raises(error, match=message):
        data.unfold_column_chunks(n_split, split_keys=split_keys)
