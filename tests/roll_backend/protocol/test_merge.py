"""roll_backend/protocol/merge.py: union and concat, including verl's per-worker metrics form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataproto_batches import make_batch

from roll_backend.keys import ATTENTION_MASK, INPUT_IDS, META_METRICS, OLD_LOG_PROBS, UID
from roll_backend.protocol import (
    DataProto,
    DataProtoError,
)


def part(rows: int, meta_info: dict) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(rows)}, meta_info=meta_info)


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
