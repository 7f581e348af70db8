"""Deadlines and broken groups on real Ray actors with gloo (issue 15): one deadline per call for all ranks,
a group that failed stays broken (its ranks stopped) and says so at once, and a rebuilt group works."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import ray
from probe_workers import ProbeWorker
from process_checks import describe, wait_until_gone

from roll_backend.distributed.deadlines import deadline_scope
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.worker import Worker
from roll_backend.distributed.worker_group import (
    GroupBrokenError,
    GroupTimeoutError,
    RankDiedError,
    RankRaisedError,
    WorkerGroup,
    wait_all,
)

TP2 = ParallelLayout(tp=2)


def assert_ranks_stopped(group_workers: list, pids: list[int]) -> None:
    """Every actor of a broken group was killed: its process ends, and a call to it then fails as a dead actor
    (not a hang). ray.kill is asynchronous, so a call made at once could still reach the live process."""
    assert describe(wait_until_gone(pids, within_s=30)) == []
    for worker in group_workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.call.remote("pid", (), {}), timeout=120)


def test_plain_call_deadline_breaks_the_group_and_a_rebuild_works(ray_session):
    group = WorkerGroup(ProbeWorker, "slow", 2, TP2)
    workers, pids = list(group.workers), group.call(Worker.pid)
    assert group.call(ProbeWorker.answer_after, 0.0, timeout_s=120) == [0, 1]  # timeout_s in the plain call form
    with pytest.raises(
        GroupTimeoutError,
        match=r"slow.answer_after: no answer from \[rank 0/2, dp=0 tp=0 pp=0 cp=0\] \[rank 1/2, dp=0 tp=1 pp=0 cp=0\] "
        r"within the deadline of the call \(2s\)",
    ):
        group.call(ProbeWorker.answer_after, 3600.0, timeout_s=2)
    # Broken, loudly: the next call fails at once and names the first failure; the ranks were stopped.
    with pytest.raises(
        GroupBrokenError,
        match=r"slow.whoami: the group is broken since an earlier call failed "
        r"\(slow.answer_after: no answer from \[rank 0/2",
    ):
        group.call(ProbeWorker.whoami, "again")
    assert_ranks_stopped(workers, pids)
    group.shutdown()
    rebuilt = WorkerGroup(ProbeWorker, "slow", 2, TP2)
    try:
        assert [r["rank"] for r in rebuilt.call(ProbeWorker.whoami, "rebuilt")] == [0, 1]
    finally:
        rebuilt.shutdown()


def test_rank_raising_before_a_collective_frees_the_ranks_waiting_for_it(ray_session):
    group = WorkerGroup(ProbeWorker, "raiser", 2, TP2, settle_s=2.0)
    workers, pids = list(group.workers), group.call(Worker.pid)
    future = group.call(ProbeWorker.raise_before_collective, victim_rank=0)
    with pytest.raises(RankRaisedError, match="deliberate failure before a collective on rank 0") as info:
        future.get(timeout_s=300)
    assert info.value.restartable
    assert group.broken is info.value
    assert_ranks_stopped(workers, pids)  # rank 1 was stuck in the barrier; without the kill gloo holds it 600 s
    with pytest.raises(GroupBrokenError, match="deliberate failure before a collective"):
        group.call(ProbeWorker.whoami, "again")
    group.shutdown()


def test_a_rank_killed_in_a_collective_is_named_not_the_peer_whose_collective_failed(ray_session):
    # Rank 1's barrier fails with a connection error as rank 0's process goes, usually before Ray reports the
    # death: the call's error is the death of rank 0 (the cause), whichever of the two the driver sees first.
    group = WorkerGroup(ProbeWorker, "victim", 2, TP2, settle_s=30.0)
    workers, pids = list(group.workers), group.call(Worker.pid)
    with pytest.raises(
        RankDiedError, match=r"victim.die_in_collective: the actor of \[rank 0/2, dp=0 tp=0 pp=0 cp=0\] died"
    ):
        group.call(ProbeWorker.die_in_collective, victim_rank=0).get(timeout_s=300)
    assert isinstance(group.broken, RankDiedError)
    assert_ranks_stopped(workers, pids)
    group.shutdown()


def test_get_timeout_is_one_deadline_for_all_ranks_and_scopes_name_the_phase(ray_session):
    group = WorkerGroup(ProbeWorker, "phased", 2, TP2)
    # Rank 0 answers after 4 s, rank 1 after 8 s: each within 5 s of the one before, so a per-rank clock never
    # fires; one deadline for the whole call must.
    with pytest.raises(
        GroupTimeoutError, match=r"no answer from \[rank 1/2, dp=0 tp=1 pp=0 cp=0\] within the deadline"
    ):
        group.submit(ProbeWorker.answer_after, 4.0).get(timeout_s=5)
    group.shutdown()
    group = WorkerGroup(ProbeWorker, "phased", 2, TP2)
    try:
        assert wait_all(
            [group.submit(ProbeWorker.answer_after, 0.0), group.submit(ProbeWorker.whoami, "x")], timeout_s=120
        )[0] == [0, 1]
        with deadline_scope(2, "phase 'train' (fault_tolerance.timeouts.train)"):
            future = group.submit(ProbeWorker.answer_after, 3600.0)
        with pytest.raises(
            GroupTimeoutError,
            match=r"phased.answer_after: no answer from \[rank 0/2.*\[rank 1/2.* "
            r"within the deadline of phase 'train' \(fault_tolerance.timeouts.train\) \(2s\)",
        ):
            future.get()  # the scope's deadline travels with the future
    finally:
        group.shutdown()


def test_killed_ranks_take_their_child_processes_with_them(ray_session):
    group = WorkerGroup(ProbeWorker, "parent", 2, TP2)
    pids = [pid for rank_pids in group.call(ProbeWorker.start_child_processes) for pid in rank_pids]
    ranks = group.call(Worker.pid)
    assert len(pids) >= 4 * len(ranks)  # per rank: itself, the watchdog, the spawn child, the resource tracker
    group.shutdown()
    assert describe(wait_until_gone(pids, within_s=30)) == []


def test_a_rank_signalled_twice_as_it_stops_exits_without_a_traceback(ray_session):
    """Ray turns SIGTERM into SystemExit; a second SIGTERM during the exit (Ray may signal a worker twice as it stops
    it) used to raise again inside whatever the exit ran and print "Exception ignored in ..." with a traceback (the
    end of a clean run, issue #47). The rank now exits once, however many arrive; its log says nothing of it."""
    group = WorkerGroup(ProbeWorker, "stopping", 1)
    [pid] = group.call(Worker.pid)
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    [err_log] = logs.glob(f"worker-*-{pid}.err")
    # SIGTERM every 10 ms until the process is gone, so later ones land while the first one's exit runs
    rank, until = psutil.Process(pid), time.monotonic() + 30
    with contextlib.suppress(psutil.NoSuchProcess):
        while rank.status() != psutil.STATUS_ZOMBIE and time.monotonic() < until:
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.01)
    assert describe(wait_until_gone([pid], within_s=30)) == []
    group.shutdown()
    assert "Exception ignored" not in err_log.read_text()
