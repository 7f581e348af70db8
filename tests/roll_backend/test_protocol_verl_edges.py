"""Where DataProto overlaps verl's: code written for verl (its metrics form, its `except AssertionError`, its
saved files) gets verl's behaviour or our own clear error."""

from __future__ import annotations

import pickle
import zipfile

import pytest
import torch

from roll_backend.keys import META_METRICS
from roll_backend.protocol import DataProto, DataProtoError, NotADataProtoFileError


def part(rows: int, meta_info: dict) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(rows)}, meta_info=meta_info)


def test_concat_merges_verl_per_worker_metrics_as_verl_does():
    # verl: each part's metrics (a list of per-worker dicts, or one dict) is flattened to one list of dicts,
    # then turned into metric name -> list of the workers' values in order.
    parts = [
        part(2, {"step": 3, META_METRICS: [{"loss": 0.5, "lr": 0.1}, {"loss": 0.7, "lr": 0.1}]}),
        part(1, {"step": 3, META_METRICS: [{"loss": 0.9, "lr": 0.1}]}),
        part(1, {"step": 3, META_METRICS: {"loss": 1.1, "lr": 0.1}}),
    ]
    joined = DataProto.concat(parts)
    assert joined.meta_info == {"step": 3, META_METRICS: {"loss": [0.5, 0.7, 0.9, 1.1], "lr": [0.1] * 4}}
    assert joined["x"].tolist() == [0, 1, 0, 0]
    assert parts[0].meta_info[META_METRICS] == [{"loss": 0.5, "lr": 0.1}, {"loss": 0.7, "lr": 0.1}]  # untouched
    # A worker's list value is one entry, as in verl (our dict form would extend by it instead).
    listed = DataProto.concat([part(1, {META_METRICS: [{"seq": [1, 2]}]}), part(1, {META_METRICS: [{"seq": [3]}]})])
    assert listed.meta_info[META_METRICS] == {"seq": [[1, 2], [3]]}


def test_concat_refuses_metrics_of_another_shape():
    with pytest.raises(DataProtoError, match=r"meta_info\['metrics'\] of part 1 must be a dict .* got \[1, 2\]"):
        DataProto.concat([part(1, {}), part(1, {META_METRICS: [1, 2]})])


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


def test_uneven_chunk_is_kept_and_differs_from_verl():
    sizes = [len(chunk) for chunk in part(10, {}).chunk(4)]
    assert sizes == [3, 3, 2, 2]  # verl would assert 10 % 4 == 0


def test_load_from_disk_refuses_foreign_files_with_our_error(tmp_path):
    data = part(2, {"k": 1})
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
