"""Tests for roll_backend/session_host.py: sessions in worker processes, concurrency across workers, and calls that
raise, miss their deadline or kill their worker."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
from process_checks import alive

from roll_backend.errors import UserCodeError
from roll_backend.session_host import SessionError, SessionHost

LABEL = "test env"
_BARRIERS: dict[int, threading.Barrier] = {}  # in a worker process: one barrier per party count


class Counter:
    """A session: built in the worker by the host's factory (this class, pickled by reference)."""

    def __init__(self):
        self.count = 0

    def add(self, amount: int = 1) -> int:
        self.count += amount
        return self.count

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> tuple[float, float]:
        started = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on one machine
        time.sleep(seconds)
        return started, time.monotonic()

    def fail(self):
        raise ValueError("the environment broke")

    def meet(self, parties: int, timeout_s: float) -> int:
        """Wait for `parties` sessions of this worker to call meet at once: only concurrent calls get through."""
        return _BARRIERS.setdefault(parties, threading.Barrier(parties)).wait(timeout_s)

    def append(self, item: int, pause_s: float = 0.0) -> list[int]:
        time.sleep(pause_s)
        self.items = [*getattr(self, "items", []), item]
        return self.items

    def unpicklable(self):
        return lambda: None

    def exit(self):
        os._exit(3)


class BrokenFactory:
    def __init__(self):
        raise RuntimeError("cannot build")


@pytest.fixture
def host():
    with SessionHost(Counter, num_workers=2, label=LABEL) as host:
        yield host


def _open(host: SessionHost, *session_ids: str) -> None:
    for future in [host.open(session_id) for session_id in session_ids]:
        assert future.result(timeout=30) is None


def _call(host: SessionHost, session_id: str, method: str, *args, timeout_s: float = 10.0):
    return host.call(session_id, method, *args, timeout_s=timeout_s).result(timeout=30)


def _error(host: SessionHost, session_id: str, method: str, *args, timeout_s: float = 10.0) -> SessionError:
    with pytest.raises(SessionError) as caught:
        _call(host, session_id, method, *args, timeout_s=timeout_s)
    return caught.value


def test_sessions_keep_their_own_state(host):
    _open(host, "a", "b", "c")
    assert [_call(host, "a", "add"), _call(host, "a", "add", 5), _call(host, "b", "add")] == [1, 6, 1]
    assert _call(host, "c", "add", 10) == 10  # shares a worker with a or b, not its state
    assert host.close("a").result(timeout=30) is None
    with pytest.raises(ValueError, match="session 'a' is not open"):
        host.call("a", "add", timeout_s=1)


def test_sessions_on_different_workers_run_concurrently(host):
    _open(host, "a", "b")
    assert _call(host, "a", "pid") != _call(host, "b", "pid")  # least-loaded placement
    futures = [host.call(session_id, "sleep", 0.5, timeout_s=10) for session_id in ("a", "b")]
    (start_a, end_a), (start_b, end_b) = [future.result(timeout=30) for future in futures]
    assert max(start_a, start_b) < min(end_a, end_b)  # the two sleeps overlapped


def test_one_worker_runs_calls_of_different_sessions_at_once_and_each_session_in_order():
    with SessionHost(Counter, num_workers=1, label=LABEL, concurrency=3) as host:
        _open(host, "a", "b", "c")
        # three calls that return only when all three are inside the worker together (a barrier, no timing)
        futures = [host.call(session_id, "meet", 3, 20.0, timeout_s=30) for session_id in ("a", "b", "c")]
        assert sorted(future.result(timeout=60) for future in futures) == [0, 1, 2]
        # one session's calls never overlap and keep their order, even when the first one is slower
        ordered = [host.call("a", "append", item, 0.2 if item == 0 else 0.0, timeout_s=30) for item in range(4)]
        assert [future.result(timeout=60) for future in ordered][-1] == [0, 1, 2, 3]


def test_a_late_call_fails_every_call_in_flight_on_its_worker():
    with SessionHost(Counter, num_workers=1, label=LABEL, concurrency=2) as host:
        _open(host, "slow", "waiting")
        pid = _call(host, "slow", "pid")
        waiting = host.call("waiting", "sleep", 30, timeout_s=60)
        error = _error(host, "slow", "sleep", 30, timeout_s=0.5)
        assert error.kind == "timeout" and "ending the other sessions on it too ('waiting')" in str(error)
        with pytest.raises(SessionError, match="was killed because session 'slow' sleep"):
            waiting.result(timeout=30)
        assert not alive(pid)
    with pytest.raises(ValueError, match="concurrency=0"):
        SessionHost(Counter, num_workers=1, label=LABEL, concurrency=0)


def test_a_raising_method_is_reported_and_the_session_goes_on(host):
    _open(host, "a")
    _call(host, "a", "add")
    error = _error(host, "a", "fail")
    assert isinstance(error, UserCodeError) and error.kind == "raised"
    message = str(error)
    assert message.startswith("[test env] session 'a': fail() raised ValueError: the environment broke")
    assert 'raise ValueError("the environment broke")' in message  # the traceback tail
    unpicklable = _error(host, "a", "unpicklable")
    assert unpicklable.kind == "raised" and "cannot be sent back" in str(unpicklable)
    assert _call(host, "a", "add") == 2  # same worker, state kept


def test_a_call_past_its_deadline_kills_only_its_worker(host):
    _open(host, "slow", "other")
    slow_pid, other_pid = _call(host, "slow", "pid"), _call(host, "other", "pid")
    _call(host, "other", "add")
    started = time.monotonic()
    error = _error(host, "slow", "sleep", 30, timeout_s=0.5)
    assert time.monotonic() - started < 0.5 + 1.5
    assert error.kind == "timeout"
    assert "session 'slow': sleep() did not return within its 0.5s deadline" in str(error)
    assert not alive(slow_pid)
    assert _call(host, "other", "add") == 2  # the other worker and its session are untouched
    assert _call(host, "other", "pid") == other_pid
    lost = _error(host, "slow", "add")
    assert lost.kind == "worker_died" and "ran past its 0.5s deadline" in str(lost)
    _open(host, "new")
    assert _call(host, "new", "add") == 1


def test_a_dying_worker_ends_every_session_on_it():
    with SessionHost(Counter, num_workers=1, label=LABEL) as host:
        _open(host, "a", "b")
        _call(host, "b", "add")
        error = _error(host, "a", "exit")
        assert error.kind == "worker_died" and "exited with code 3" in str(error)
        lost = _error(host, "b", "add")
        assert lost.kind == "worker_died" and "session 'b'" in str(lost)
        assert host.close("b").result(timeout=30) is None
        _open(host, "b")
        assert _call(host, "b", "add") == 1


def test_a_failing_factory_fails_open():
    with SessionHost(BrokenFactory, num_workers=1, label=LABEL) as host:
        with pytest.raises(SessionError, match=r"open\(\) raised RuntimeError: cannot build"):
            host.open("a").result(timeout=30)
        with pytest.raises(ValueError, match="is not open"):
            host.call("a", "add", timeout_s=1)


def test_shutdown_leaves_no_worker_processes():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    host = SessionHost(Counter, num_workers=2, label=LABEL)
    _open(host, "a", "b")
    pids = [_call(host, session_id, "pid") for session_id in ("a", "b")]
    pending = host.call("a", "sleep", 30, timeout_s=60)
    host.shutdown()
    with pytest.raises(SessionError, match="the host was shut down"):
        pending.result(timeout=30)
    assert [pid for pid in pids if alive(pid)] == []
    new = [p for p in me.children(recursive=True) if p.pid not in before]
    assert [p.pid for p in new if p.ppid() != me.pid] == []  # left: only multiprocessing's forkserver
    with pytest.raises(RuntimeError, match="shut down"):
        host.open("c")
