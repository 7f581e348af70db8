"""The in-actor broadcast (TPxCP, then PP) on real gloo groups: every rank ends with the same batch."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from probe_workers import ProbeWorker, batch_checksums

from roll_backend import keys
from roll_backend.distributed.collectives import BROADCAST_BUCKET_BYTES, StageColumns
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.protocol import DataProto

LAYOUTS = {"tp2-pp2": (4, ParallelLayout(tp=2, pp=2)), "pp2": (2, ParallelLayout(pp=2))}
MTP_STAGES = StageColumns(
    first=(keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS),
    last=(keys.RESPONSES, keys.RESPONSE_MASK, keys.ADVANTAGES, keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS),
    mtp=(keys.INPUT_IDS, keys.RESPONSE_MASK),
)


def training_batch(n: int = 5, t_prompt: int = 7, t_resp: int = 9) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    t = t_prompt + t_resp
    return DataProto.from_dict(
        tensors={
            "ids": torch.arange(n),
            keys.INPUT_IDS: torch.randint(0, 300, (n, t), generator=generator),
            keys.ATTENTION_MASK: torch.ones(n, t, dtype=torch.int64),
            keys.POSITION_IDS: torch.arange(t).repeat(n, 1),
            keys.RESPONSES: torch.randint(0, 300, (n, t_resp), generator=generator),
            keys.RESPONSE_MASK: torch.rand(n, t_resp, generator=generator) > 0.3,
            keys.ADVANTAGES: torch.randn(n, t_resp, generator=generator),
            keys.OLD_LOG_PROBS: torch.randn(n, t_resp, generator=generator).to(torch.bfloat16),
            keys.REF_LOG_PROBS: torch.randn(n, t_resp, generator=generator),
        },
        non_tensors={keys.UID: np.array([f"u{i // 2}" for i in range(n)], dtype=object)},
        meta_info={keys.META_TEMPERATURE: 0.7},
    )


@pytest.fixture(params=list(LAYOUTS), scope="module")
def group(request, make_group):
    world_size, layout = LAYOUTS[request.param]
    return make_group(ProbeWorker, world_size, layout)


def test_every_rank_holds_the_same_batch_after_the_broadcast(group):
    batch = training_batch()
    group.call(ProbeWorker.require_columns, MTP_STAGES)
    out = group.call(ProbeWorker.received_checksums, batch)
    assert out.batch["ids"].tolist() == list(range(5))
    expected = batch_checksums(batch)
    recorded = group.call(ProbeWorker.recorded_checksums)
    for record in recorded:
        assert record["tensors"] == expected["tensors"], record["coords"]
        assert record["non_tensor"] == expected["non_tensor"]
        assert record["meta"] == expected["meta"]
    # The MTP columns reached the last stage, where the MTP heads sit.
    last_stage = [r for r in recorded if r["coords"].pp == r["coords"].pp_size - 1]
    assert last_stage and all(keys.RESPONSE_MASK in r["tensors"] for r in last_stage)


def test_missing_declared_column_fails_on_every_rank_and_the_group_stays_usable(group):
    batch = training_batch()
    batch.pop(batch_keys=[keys.ADVANTAGES])
    group.call(ProbeWorker.require_columns, MTP_STAGES)
    future = group.submit(ProbeWorker.received_checksums, batch)
    for rank, ref in enumerate(future.refs):
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref)
        message = str(info.value)
        assert "missing column(s) ['advantages']" in message
        assert f"rank {rank}/{group.world_size}" in message
    group.call(ProbeWorker.require_columns, None)
    assert group.call(ProbeWorker.received_checksums, training_batch(3)).batch["ids"].tolist() == [0, 1, 2]


def odd_columns(rows: int = 5) -> DataProto:
    """Columns of every dtype a batch carries (bool, int16 routes, bfloat16 and float64 among them) at widths whose byte
    sizes are not multiples of one another, an empty one, a non-contiguous one, and one of 600 bytes."""
    generator = torch.Generator().manual_seed(3)
    return DataProto.from_dict(
        tensors={
            "mask": torch.rand(rows, 3, generator=generator) > 0.5,
            "routes": torch.randint(-300, 300, (rows, 7, 2), generator=generator, dtype=torch.int16),
            "nothing": torch.empty(rows, 0),
            "halves": torch.randn(rows, 9, generator=generator).to(torch.bfloat16),
            "doubles": torch.randn(rows, 11, generator=generator, dtype=torch.float64),
            "ids": torch.arange(rows),
            "wide": torch.randn(rows, 30, generator=generator),
            "bytes": torch.randint(0, 255, (rows, 1), generator=generator, dtype=torch.uint8),
            "transposed": torch.randn(4, rows, generator=generator).t(),  # not contiguous on the sender
        },
        non_tensors={keys.UID: np.array([f"u{i}" for i in range(rows)], dtype=object)},
        meta_info={"step": 3},
    )


@pytest.mark.parametrize(
    "bucket_bytes", [BROADCAST_BUCKET_BYTES, 256, 1], ids=["default buckets", "some buckets", "a column each"]
)
def test_a_batch_arrives_bit_for_bit_in_two_collectives_when_its_columns_fit_one_bucket(group, bucket_bytes):
    """Whatever the buckets (the default's hold the whole batch; 256 bytes gives buckets of several columns and the
    600-byte one alone; 1 byte sends each column alone, the empty one joining the next), every rank gets every column
    with its dtype, shape and bits. The default's small batch takes two collectives (a header and one bucket) on every
    rank, not one per column."""
    batch = odd_columns()
    received = group.call(ProbeWorker.broadcast_counting, batch, bucket_bytes)
    for got in received:
        assert got["tensors"].keys() == batch.batch.keys()
        for key, want in batch.batch.items():
            column = got["tensors"][key]
            assert (column.dtype, column.shape) == (want.dtype, want.shape), key
            assert torch.equal(column.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
        assert got["non_tensor"] == {keys.UID: [f"u{i}" for i in range(5)]} and got["meta"] == {"step": 3}
    counts = {got["collectives"] for got in received}
    assert len(counts) == 1
    if bucket_bytes == BROADCAST_BUCKET_BYTES:
        assert counts == {2}
    if bucket_bytes == 1:  # the header, the schema's bucket, then seven (the empty column travels with the next)
        assert counts == {2 + len(batch.batch.keys()) - 1}
