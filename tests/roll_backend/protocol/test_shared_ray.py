"""DataProto through real Ray actors: one put batch reaches every reader zero-copy; a reader's write stays its own."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import ray
import torch

from roll_backend.protocol import DataProto, SharedTensorWriteError

# Workers cannot import this test module; ship its actor class and helpers by value instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS, SEQ = 1024, 4096  # input_ids: 32 MiB of int64, far above Ray's inline-object limit


def _mapping_of(address: int) -> dict:
    """The /proc/self/maps entry holding `address`, with the address's offset inside the mapped file."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return {
                    "perms": fields[1],
                    "file": (fields[3], int(fields[4])),
                    "path": fields[5].strip() if len(fields) > 5 else "",
                    "file_offset": address - start + int(fields[2], 16),
                }
    raise AssertionError(f"address {address:#x} is in no mapping of pid {os.getpid()}")


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@ray.remote(num_cpus=0)
class BatchReader:
    def rss_anon(self) -> int:
        return _rss_anon_bytes()

    def read(self, batch: DataProto) -> dict:
        """Touch every byte of input_ids and report where its memory lives."""
        input_ids = batch["input_ids"]
        return {
            "sum": int(input_ids.sum()),
            "type": type(input_ids).__name__,
            "rss_anon": _rss_anon_bytes(),
            "mapping": _mapping_of(input_ids.data_ptr()),
            "labels": batch["labels"][:3].tolist(),
        }

    def write_in_place(self, batch: DataProto) -> dict:
        """Try the in-place writes a worker might do, then do them properly after make_writable."""
        blocked = []
        for name, write in (
            ("add_", lambda: batch["input_ids"].add_(1)),
            ("setitem", lambda: batch["input_ids"].__setitem__(0, 7)),
            ("view", lambda: batch["input_ids"][0:2].zero_()),
        ):
            try:
                write()
            except SharedTensorWriteError:
                blocked.append(name)
        try:
            batch["scores"][0] = 1.0  # a numeric non-tensor column arrives as a read-only numpy view
        except ValueError:
            blocked.append("numpy")
        batch.make_writable()
        batch["input_ids"].add_(1)
        batch["scores"][0] = 1.0
        return {
            "blocked": blocked,
            "sum_after_write": int(batch["input_ids"].sum()),
            "shared_after": batch.shared_keys(),
        }

    def first_rows(self, batch: DataProto, rows: int) -> DataProto:
        return batch[:rows]


def make_batch() -> DataProto:
    input_ids = torch.arange(ROWS * SEQ, dtype=torch.int64).reshape(ROWS, SEQ) % 50_000
    return DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "mask": torch.ones(ROWS, SEQ, dtype=torch.bool),
            "logp": torch.randn(ROWS, 8).to(torch.bfloat16),
        },
        non_tensors={"labels": [f"row-{i}" for i in range(ROWS)], "scores": np.zeros(ROWS, dtype=np.float32)},
        meta_info={"temperature": 1.0},
    )


@pytest.fixture(scope="module")
def readers(ray_session):
    actors = [BatchReader.remote() for _ in range(4)]
    warm = DataProto.from_dict(
        tensors={"input_ids": torch.zeros(2, 2, dtype=torch.int64)}, non_tensors={"labels": ["a", "b"]}
    )
    ray.get([actor.read.remote(warm) for actor in actors])  # imports and first-call allocations happen here
    yield actors
    for actor in actors:
        ray.kill(actor)


def test_fan_out_is_zero_copy(readers):
    batch = make_batch()
    expected = int(batch["input_ids"].sum())
    rss_before = ray.get([actor.rss_anon.remote() for actor in readers])
    ref = ray.put(batch)

    reports = ray.get([actor.read.remote(ref) for actor in readers])

    assert all(r["sum"] == expected and r["labels"] == ["row-0", "row-1", "row-2"] for r in reports)
    assert all(r["type"] == "SharedReadOnlyTensor" for r in reports)
    # Every reader maps the same bytes of the same shared file: one copy, however many readers.
    mappings = [r["mapping"] for r in reports]
    assert all(m["perms"].endswith("s") for m in mappings), mappings
    assert len({(m["file"], m["file_offset"]) for m in mappings}) == 1, mappings
    # Reading all 32 MiB grew no reader's private memory by anything near the batch size.
    growth = [r["rss_anon"] - before for r, before in zip(reports, rss_before, strict=True)]
    assert max(growth) < batch["input_ids"].nbytes // 2, growth


def test_in_place_write_by_one_reader_is_not_seen_by_others(readers):
    batch = make_batch()
    expected = int(batch["input_ids"].sum())
    ref = ray.put(batch)

    writer = ray.get(readers[0].write_in_place.remote(ref))
    others = ray.get([actor.read.remote(ref) for actor in readers[1:]])

    assert writer["blocked"] == ["add_", "setitem", "view", "numpy"]
    assert writer["sum_after_write"] == expected + ROWS * SEQ and writer["shared_after"] == []
    assert [r["sum"] for r in others] == [expected] * 3
    assert int(ray.get(ref)["input_ids"].sum()) == expected


def test_dataproto_returned_by_an_actor_round_trips(readers):
    batch = make_batch()
    head = ray.get(readers[0].first_rows.remote(ray.put(batch), 5))
    assert torch.equal(head["input_ids"], batch["input_ids"][:5])
    assert torch.equal(head["logp"].view(torch.int16), batch["logp"][:5].view(torch.int16))  # bf16 bit-exact
    assert head["labels"].tolist() == batch["labels"][:5].tolist() and head.meta_info == {"temperature": 1.0}
