"""The in-actor broadcast (TPxCP, then PP) on real gloo groups: every rank ends with the same batch."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from probe_workers import ProbeWorker, batch_checksums

from roll_backend import keys
from roll_backend.distributed.collectives import StageColumns
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
