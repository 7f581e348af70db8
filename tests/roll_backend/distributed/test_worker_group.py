"""WorkerGroup and dispatch on real Ray actors with gloo and Megatron parallel state (issue 4 and the smoke test of
issue 2).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest
import ray
import torch
from probe_workers import EngineProbeWorker, ProbeWorker

from roll_backend import keys
from roll_backend.distributed.dispatch import Dispatch, DispatchError
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.worker import Worker
from roll_backend.distributed.worker_group import RankResources, WorkerGroup, create_placement_group, wait_all
from roll_backend.protocol import DataProto

TP2_PP2 = ParallelLayout(tp=2, pp=2)
TP2_DP2 = ParallelLayout(tp=2)
DP2 = ParallelLayout()


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n)}, non_tensors={"text": np.array([f"row{i}" for i in range(n)], dtype=object)}
    )


def test_megatron_groups_at_tp2_pp2(make_group):
    group = make_group(ProbeWorker, 4, TP2_PP2)
    ranks = group.call(Worker.group_ranks)
    assert ranks[0]["tp"] == [0, 1] and ranks[0]["pp"] == [0, 2] and ranks[0]["dp"] == [0]
    assert ranks[3]["tp"] == [2, 3] and ranks[3]["pp"] == [1, 3] and ranks[3]["dp"] == [3]
    assert [(c.tp, c.pp, c.dp) for c in group.coords] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    # Collectives on several groups of one rank all go through its one shared gloo device
    # (patches/gloo_shared_device.py):
    # one event-loop thread per rank, not one per Megatron group.
    reports = group.call(ProbeWorker.sums_over_megatron_groups)
    assert [r["sums"] for r in reports] == [
        {"tp": 3.0, "pp": 4.0, "dp": 1.0},
        {"tp": 3.0, "pp": 6.0, "dp": 2.0},
        {"tp": 7.0, "pp": 4.0, "dp": 3.0},
        {"tp": 7.0, "pp": 6.0, "dp": 4.0},
    ]
    assert [r["gloo_loop_threads"] for r in reports] == [1, 1, 1, 1]


def test_one_to_all_and_all_to_all_reach_every_rank(make_group):
    group = make_group(ProbeWorker, 4, TP2_PP2)
    replies = group.call(ProbeWorker.whoami, "hello")
    assert [r["rank"] for r in replies] == [0, 1, 2, 3]
    assert {r["note"] for r in replies} == {"hello"}
    assert len({r["pid"] for r in replies}) == 4  # one process per rank
    # megatron-core was imported without the trackers it reaches for (ranks never log: ~0.5 s of a core each)
    assert [(r["megatron_imported"], r["trackers_imported"]) for r in replies] == [(True, [])] * 4
    # CPU ranks start with the allocator settings (ray_env.CPU_RANK_ENV_DEFAULTS), on top of the job's env.
    assert {r["env"]["MALLOC_MMAP_MAX_"] for r in replies} == {"0"}
    assert {r["env"]["RAY_DEDUP_LOGS"] for r in replies} == {"0"}  # the job-level env_vars still apply
    # vLLM's IPC sockets go to the node's own folder, not the top of /tmp (where killed engines left hundreds)
    (ipc,) = {r["env"]["VLLM_RPC_BASE_PATH"] for r in replies}
    assert ipc.endswith("/vllm_ipc") and os.path.isdir(ipc) and os.path.dirname(ipc) != tempfile.gettempdir()
    assert group.call(ProbeWorker.echo, ["a", "b", "c", "d"]) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    with pytest.raises(DispatchError, match="list of 4"):
        group.call(ProbeWorker.echo, ["only one"])


def sent_rows(group, batch: DataProto) -> list[tuple[int, int]]:
    """(rank, tensor rows) each rank receives from the controller for a DP_MP_DISPATCH_FIRST call."""
    split = Dispatch.DP_MP_DISPATCH_FIRST.split(group.coords, (batch,), {})
    return [(rank, len(args[0]) if args[0].batch is not None else 0) for rank, (args, _) in enumerate(split.per_rank)]


def test_dispatch_first_sends_tensors_to_the_first_model_parallel_rank_only(make_group):
    group = make_group(ProbeWorker, 4, TP2_PP2)
    batch = DataProto.from_dict(tensors={"ids": torch.arange(6)}, meta_info={"k": 1})
    assert sent_rows(group, batch) == [(0, 6), (1, 0), (2, 0), (3, 0)]
    # The in-actor broadcast hands the rest the batch: the collect rank (tp0 of the last stage, rank 2) was sent
    # nothing by the controller and holds all 6 rows when the method runs.
    arrived = group.call(ProbeWorker.what_arrived, batch)
    assert [(a["rank"], a["rows"], a["meta"]) for a in arrived] == [(2, 6, {"k": 1})]


def test_exception_on_pp1_reports_that_rank(make_group):
    group = make_group(ProbeWorker, 4, TP2_PP2)
    with pytest.raises(DispatchError) as info:
        group.call(ProbeWorker.fail_on_pp, 1)
    message = str(info.value)
    # One readable line: role, method, the failing rank's coordinates, the rank's own exception type and message.
    assert message in (
        "test.fail_on_pp failed on rank 2/4, dp=0 tp=0 pp=1 cp=0: ValueError: deliberate failure on pp=1",
        "test.fail_on_pp failed on rank 3/4, dp=0 tp=1 pp=1 cp=0: ValueError: deliberate failure on pp=1",
    )
    assert "\x1b[" not in message and "ray::" not in message  # no colour codes, no Ray banner
    assert 'probe_workers.py", line' in str(info.value.__cause__)  # the remote traceback stays as the cause
    assert group.call(ProbeWorker.fail_on_pp, 7) == [0, 1, 2, 3]  # the group is still usable
    # A coloured, multi-line message from the rank still gives one plain line.
    with pytest.raises(DispatchError) as info:
        group.call(ProbeWorker.fail_on_rank, 0, "\x1b[31mout of memory\x1b[0m\n  while building stage 0")
    assert str(info.value) == (
        "test.fail_on_rank failed on rank 0/4, dp=0 tp=0 pp=0 cp=0: RuntimeError: out of memory while building stage 0"
    )


def test_dp_compute_at_tp2_dp2_splits_by_dp_and_collects_in_order(make_group):
    group = make_group(ProbeWorker, 4, TP2_DP2)
    assert [(c.dp, c.tp) for c in group.coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    out = group.call(ProbeWorker.tag_rows, rows(7))
    assert out.batch["ids"].tolist() == list(range(7))
    assert out.batch["dp"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out.non_tensor_batch["served_by_rank"].tolist() == [0, 0, 0, 0, 2, 2, 2]  # tp0 of each dp group
    assert sent_rows(group, rows(6)) == [(0, 3), (1, 0), (2, 3), (3, 0)]
    arrived = group.call(ProbeWorker.what_arrived, rows(6))  # collected from tp0 of each DP group
    assert [(a["rank"], a["rows"]) for a in arrived] == [(0, 3), (2, 3)]


def test_a_role_without_megatron_gets_megatrons_tp_grid_without_importing_it(make_group):
    """Rollout and reward ranks lay out TP blocks themselves: the same groups, coordinates and in-actor broadcast as
    Megatron's grid for that layout, and megatron-core never imported (seconds of a core per rank)."""
    megatron, engine = make_group(ProbeWorker, 4, TP2_DP2), make_group(EngineProbeWorker, 4, TP2_DP2)
    assert engine.coords == megatron.coords
    assert engine.call(Worker.group_ranks) == megatron.call(Worker.group_ranks)
    assert [r["megatron_imported"] for r in engine.call(EngineProbeWorker.whoami, "x")] == [False] * 4
    # The batch reaches tp1 of each DP group over the TP block (sent to tp0 only); the output comes from tp0.
    assert sent_rows(engine, rows(6)) == [(0, 3), (1, 0), (2, 3), (3, 0)]
    arrived = engine.call(EngineProbeWorker.what_arrived, rows(6))
    assert [(a["rank"], a["rows"]) for a in arrived] == [(0, 3), (2, 3)]
    for group in (engine, megatron):
        group.call(ProbeWorker.received_checksums, rows(6))
    held = engine.call(EngineProbeWorker.recorded_checksums)
    assert held == megatron.call(ProbeWorker.recorded_checksums)
    tensors = [h["tensors"] for h in held]
    assert tensors[1] == tensors[0] != tensors[2] == tensors[3]
    with pytest.raises(Exception, match="TP blocks only.*set pp=1"):
        WorkerGroup(EngineProbeWorker, "engine_pp2", 2, ParallelLayout(pp=2))


def test_dp2_uneven_batch_and_non_blocking_calls(make_group):
    group = make_group(ProbeWorker, 2, DP2)
    out = group.call(ProbeWorker.tag_rows, rows(7))
    assert out.batch["ids"].tolist() == list(range(7))
    assert out.batch["dp"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    # The padding row went to dp 1, marked so a trainer can leave it out; the marker is gone on collect.
    assert out.batch["padding_rows_in_chunk"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert keys.DISPATCH_PADDING not in out.batch.keys()
    first, second = wait_all([group.submit(ProbeWorker.tag_rows, rows(3)), group.submit(ProbeWorker.whoami, "x")])
    assert first.batch["ids"].tolist() == [0, 1, 2]
    assert [r["note"] for r in second] == ["x", "x"]
    future = group.call(ProbeWorker.block_in_collective, victim_rank=-1)  # registered non-blocking: returns a future
    assert future.get(timeout_s=60) == [None, None]


def test_dead_actor_fails_the_call_and_the_group_rebuilds(ray_session):
    group = WorkerGroup(ProbeWorker, "victim", 2, DP2)
    future = group.call(ProbeWorker.block_in_collective, victim_rank=1)
    ray.kill(group.workers[1], no_restart=True)
    started = time.monotonic()
    with pytest.raises(DispatchError):
        future.get(timeout_s=60)
    assert time.monotonic() - started < 30
    group.shutdown()
    rebuilt = WorkerGroup(ProbeWorker, "victim", 2, DP2)
    assert [r["rank"] for r in rebuilt.call(ProbeWorker.whoami, "again")] == [0, 1]
    rebuilt.shutdown()


def test_two_roles_colocated_on_one_placement_group(ray_session):
    shared = create_placement_group(2, cpus_per_bundle=1.0)
    half = RankResources(num_cpus=0.5)
    actor = WorkerGroup(ProbeWorker, "actor", 2, DP2, half, placement_group=shared)
    critic = WorkerGroup(ProbeWorker, "critic", 2, DP2, half, placement_group=shared)
    try:
        assert actor.call(ProbeWorker.tag_rows, rows(5)).batch["ids"].tolist() == list(range(5))
        assert critic.call(ProbeWorker.tag_rows, rows(3)).batch["ids"].tolist() == list(range(3))
        placements = actor.call(ProbeWorker.placement) + critic.call(ProbeWorker.placement)
        assert {p["group"] for p in placements} == {shared.id.hex()}
        assert all(p["resources"]["CPU"] == 0.5 for p in placements)
    finally:
        actor.shutdown()
        critic.shutdown()
        ray.util.remove_placement_group(shared)


def test_impossible_layout_fails_before_any_actor_starts(ray_session):
    with pytest.raises(ValueError, match="does not divide world_size=3"):
        WorkerGroup(ProbeWorker, "bad", 3, ParallelLayout(tp=2))


def test_resources_the_cluster_cannot_hold_fail_at_the_placement_deadline(ray_session):
    from ray.util import placement_group_table

    from roll_backend.distributed.placement import PlacementError

    before = {pg for pg, info in placement_group_table().items() if info["state"] != "REMOVED"}
    start = time.monotonic()
    with pytest.raises(
        PlacementError, match=r"could not reserve 2 bundles of \{'CPU': 1000\} \(STRICT_PACK\) within 1s"
    ) as error:
        WorkerGroup(ProbeWorker, "too_big", 2, TP2_DP2, RankResources(num_cpus=1000), placement_timeout_s=1)
    assert time.monotonic() - start < 10  # the placement deadline, not the 300 s start-up default
    assert "Lower the role's world size or resources" in str(error.value)
    # The pending reservation was withdrawn: nothing is left waiting for resources that will never come.
    assert {pg for pg, info in placement_group_table().items() if info["state"] != "REMOVED"} == before
