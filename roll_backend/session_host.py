"""Runs user code (environments, tools, agents, reward functions) in worker processes, each call under a deadline,
so that its caller (the rollout loop, a reward rank) never blocks on it and never hangs: every call returns a Future
that resolves with the value or a `SessionError`.

Trade-offs:
- Sessions share workers; `num_workers` trades isolation for memory. A call past its deadline kills its whole worker
  (SIGKILL to the worker's process group, so what the environment started dies too), as does a worker's own death
  (segfault, os._exit): every session on that worker ends, its calls fail with kind "worker_died", and a fresh worker
  takes the slot at once, so new sessions work.
- Each worker runs up to `concurrency` calls at once, each in a thread of its own and for a different session (one
  session's calls run one after another, in order); calls to sessions on different workers run concurrently. Threads
  let environments that wait (a tool, a web request, a sandbox) overlap inside one process, as ROLL runs each
  environment in a thread; `concurrency=1` is for environments that are not thread-safe. A call's deadline starts
  when it is sent to its worker, not while it waits behind other calls.
- Arguments and return values cross a pipe, so they must pickle. Errors come back as text (type, message, traceback
  tail) inside a SessionError, never as the user's exception object, which may not pickle.
- Workers fork from multiprocessing's forkserver: a small clean process (it preloads only the driver's `__main__`, as
  multiprocessing does by default), not the trainer with its CUDA context and threads. The factory must pickle: a
  module-level function or class, or a functools.partial of one.
- Workers are not daemons, so an environment may start processes of its own (GEM's math env keeps a Pool). They exit
  when their pipe closes, when their parent process is gone, or when the host shuts down (also at interpreter exit).
- Shutdown kills; close sessions first where an environment's close() must run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from roll_backend.errors import UserCodeError

logger = logging.getLogger(__name__)

ERROR_KINDS = ("raised", "timeout", "worker_died")
_TRACEBACK_FRAMES = 3  # frames of the user's traceback a "raised" message shows
_ORPHAN_POLL_S = 0.5  # how often a worker checks that its parent is still there
_JOIN_S = 5.0  # wait for a SIGKILLed worker to be reaped


class SessionError(UserCodeError):
    """A session's call failed: `kind` is "raised" (the method raised), "timeout" (it missed its deadline and its
    worker was killed) or "worker_died" (its worker died or was killed, so the session's state is gone); `cause`:
    what happened, without the host's framing (the exception's text, "was killed by SIGSEGV", ...)."""

    def __init__(self, message: str, kind: str, cause: str = ""):
        super().__init__(message)
        self.kind, self.cause = kind, cause

    def __reduce__(self):
        return type(self), (str(self), self.kind, self.cause)


# ---- the worker process ---------------------------------------------------------------------------------------


def _serve(conn, factory: Callable, concurrency: int = 1) -> None:
    """A worker's loop: receive (request_id, session_id, op, args), run it (in a thread of `concurrency`; the host
    sends one call per session at a time), send (request_id, ok, value or error)."""
    os.setpgrp()  # its own process group: killing the worker kills what its sessions started too
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    sessions: dict[str, object] = {}
    send_lock = threading.Lock()
    pool = concurrent.futures.ThreadPoolExecutor(concurrency) if concurrency > 1 else None
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the host closed the pipe, or is gone (the process then exits without joining threads)
        if pool is None:
            _answer(conn, send_lock, sessions, factory, *request)
        else:
            pool.submit(_answer, conn, send_lock, sessions, factory, *request)


def _answer(conn, send_lock: threading.Lock, sessions: dict, factory: Callable, request_id, session_id, op, args):
    try:
        reply = (request_id, True, _run(sessions, factory, session_id, op, args))
    except BaseException as exc:  # user code: any failure, SystemExit included, goes back to the caller as text
        reply = (request_id, False, _describe(exc))
    with send_lock:
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return  # the host is gone: the main loop's recv ends the worker
        except Exception as exc:  # the return value does not pickle
            conn.send((request_id, False, f"returned {type(reply[2]).__name__}, which cannot be sent back: {exc}"))


def _run(sessions: dict, factory: Callable, session_id: str, op: str, args: tuple):
    if op == "open":
        sessions[session_id] = factory()
        return None
    if op == "close":
        close = getattr(sessions.pop(session_id, None), "close", None)
        return close() if callable(close) else None
    method, call_args, call_kwargs = args
    if session_id not in sessions:
        raise LookupError(f"no session {session_id!r} in this worker: its open() failed")
    return getattr(sessions[session_id], method)(*call_args, **call_kwargs)


def _describe(exc: BaseException) -> str:
    frames = traceback.format_list(traceback.extract_tb(exc.__traceback__)[-_TRACEBACK_FRAMES:])
    return f"{type(exc).__name__}: {exc}\n{''.join(frames).rstrip()}"


def _exit_when_orphaned(parent_pid: int) -> None:
    # Polling: Linux's parent-death signal fires on the death of the forking thread, and a worker's parent is the
    # forkserver, which exits when the driver does; the worker is then re-parented.
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_POLL_S)
    os._exit(1)


# ---- the host ---------------------------------------------------------------------------------------------------


@dataclass
class _Request:
    request_id: int
    session_id: str
    op: str  # "open" | "call" | "close"
    args: tuple  # (method, args, kwargs) for "call"
    timeout_s: float
    future: Future = field(default_factory=Future)
    deadline: float = float("inf")  # time.monotonic() by which it must answer, once sent

    @property
    def what(self) -> str:
        return f"{self.args[0]}()" if self.op == "call" else f"{self.op}()"


@dataclass
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    sessions: set[str] = field(default_factory=set)
    queue: deque[_Request] = field(default_factory=deque)
    inflight: dict[int, _Request] = field(default_factory=dict)  # sent, not answered: request id -> request
    unsent: list[_Request] = field(default_factory=list)  # taken from the queue, to be sent by the monitor

    def pending(self) -> list[_Request]:
        return [*self.inflight.values(), *self.queue]


class SessionHost:
    """Sessions (objects that `factory()` builds inside a worker process) spread over `num_workers` processes; calls
    to their methods return Futures and run under a per-call deadline that a monitor thread enforces."""

    def __init__(
        self, factory: Callable, num_workers: int, label: str, start_method: str = "forkserver", concurrency: int = 1
    ):
        if num_workers < 1:
            raise ValueError(f"{label}: num_workers={num_workers}; a session host needs at least 1 worker")
        if concurrency < 1:
            raise ValueError(f"{label}: concurrency={concurrency}; a worker runs at least 1 call at a time")
        self.label = label
        self.concurrency = concurrency
        self._factory = factory
        self._context = multiprocessing.get_context(start_method)
        self._lock = threading.Lock()
        self._request_ids = itertools.count()
        self._sessions: dict[str, _Worker] = {}
        self._lost: dict[str, str] = {}  # session id -> what happened to its worker
        self._stopped = threading.Event()  # set under self._lock, by shutdown() or the exit-time finalizer
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = []
        # Runs at shutdown(), or at interpreter exit before multiprocessing joins its non-daemon children.
        self._kill_workers = multiprocessing.util.Finalize(
            self, _kill_all, args=(self._workers, self._lock, self._stopped), exitpriority=10
        )
        self._workers.extend(self._start_worker(index) for index in range(num_workers))
        self._monitor = threading.Thread(target=self._watch, name=f"{label} session monitor", daemon=True)
        self._monitor.start()

    def __enter__(self) -> SessionHost:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def open(self, session_id: str, timeout_s: float = 60.0) -> Future:
        """Build `factory()` for `session_id` on the least-loaded worker; resolves with None or fails (SessionError)."""
        with self._lock:
            self._check_running()
            if session_id in self._sessions:
                raise ValueError(f"[{self.label}] session {session_id!r} is open already; close it first")
            self._lost.pop(session_id, None)
            worker = min(self._workers, key=lambda w: (len(w.sessions), len(w.queue) + len(w.inflight), w.index))
            worker.sessions.add(session_id)
            self._sessions[session_id] = worker
            return self._enqueue(worker, session_id, "open", (), timeout_s)

    def call(self, session_id: str, method: str, *args, timeout_s: float, **kwargs) -> Future:
        """`session.method(*args, **kwargs)` in its worker; resolves with the return value or fails (SessionError)."""
        with self._lock:
            self._check_running()
            if session_id in self._lost:
                return _failed(self._lost_error(session_id, f"{method}()"))
            worker = self._worker_of(session_id)
            return self._enqueue(worker, session_id, "call", (method, args, kwargs), timeout_s)

    def close(self, session_id: str, timeout_s: float = 10.0) -> Future:
        """Forget the session and call its close() (if it has one) in its worker."""
        with self._lock:
            if self._stopped.is_set() or self._lost.pop(session_id, None) is not None:
                return _done(None)
            worker = self._worker_of(session_id)
            del self._sessions[session_id]
            worker.sessions.discard(session_id)
            return self._enqueue(worker, session_id, "close", (), timeout_s)

    def shutdown(self) -> None:
        """Kill every worker (and what it started); pending calls fail with kind "worker_died". Idempotent."""
        with self._lock:
            self._stopped.set()
            pending = [r for w in self._workers for r in w.pending()]
            self._wake()
        if threading.current_thread() is not self._monitor:  # shutdown() may run in a future's callback
            self._monitor.join()
        self._kill_workers()  # a Finalize: runs once
        with self._lock:
            if self._wake_w is not None:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = None
        _resolve([(r.future, self._error(r, "worker_died", "failed: the host was shut down")) for r in pending])

    # ---- bookkeeping, under self._lock ----

    def _check_running(self) -> None:
        if self._stopped.is_set():
            raise RuntimeError(f"[{self.label}] the session host is shut down")

    def _worker_of(self, session_id: str) -> _Worker:
        worker = self._sessions.get(session_id)
        if worker is None:
            raise ValueError(f"[{self.label}] session {session_id!r} is not open; open it first with open()")
        return worker

    def _enqueue(self, worker: _Worker, session_id: str, op: str, args: tuple, timeout_s: float) -> Future:
        request = _Request(next(self._request_ids), session_id, op, args, timeout_s)
        worker.queue.append(request)
        self._wake()
        return request.future

    def _start_worker(self, index: int) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_serve,
            args=(child_conn, self._factory, self.concurrency),
            name=f"{self.label} worker {index}",
            daemon=False,
        )
        process.start()
        child_conn.close()
        return _Worker(index, process, parent_conn)

    def _error(self, request: _Request, kind: str, problem: str, cause: str = "") -> SessionError:
        return SessionError(f"[{self.label}] session {request.session_id!r}: {request.what} {problem}", kind, cause)

    def _lost_error(self, session_id: str, what: str) -> SessionError:
        return SessionError(
            f"[{self.label}] session {session_id!r}: {what} failed: its worker {self._lost[session_id]}, so the "
            "session's state is gone; close it and open a new one",
            "worker_died",
        )

    # ---- the monitor thread: the only one that touches the workers' pipes and processes ----

    def _wake(self) -> None:
        """Make the monitor look at the queues again. Under self._lock (so the pipe is not closed meanwhile)."""
        if self._wake_w is not None:
            with contextlib.suppress(BlockingIOError):  # the pipe is full: a wake-up is pending anyway
                os.write(self._wake_w, b"x")

    def _watch(self) -> None:
        try:
            while self._watch_once():
                pass
        except BaseException as exc:
            logger.exception("[%s] session monitor failed", self.label)
            with self._lock:
                self._stopped.set()
                pending = [r for w in self._workers for r in w.pending()]
            problem = f"failed: the host's monitor thread died ({type(exc).__name__}: {exc})"
            _resolve([(r.future, self._error(r, "worker_died", problem)) for r in pending])

    def _watch_once(self) -> bool:
        """Send queued calls to idle workers, wait for replies, deaths or the next deadline, and act on them."""
        with self._lock:
            if self._stopped.is_set():
                return False
            workers = list(self._workers)
            to_send = [w for w in workers if self._next_requests(w)]
        done = [failure for worker in to_send for failure in self._send(worker)]
        try:  # whatever happens below, the futures already settled get their outcome
            deadline = min((r.deadline for w in workers for r in w.inflight.values()), default=None)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            waitables = [self._wake_r, *(w.conn for w in workers), *(w.process.sentinel for w in workers)]
            ready = set(multiprocessing.connection.wait(waitables, timeout)) if not done else set()
            replies = {w.index: _receive(w.conn) for w in workers if w.conn in ready}
            with self._lock:
                if self._stopped.is_set():  # no worker is replaced once the host is stopping
                    return False
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                now = time.monotonic()
                for worker in workers:
                    if worker.index in replies:
                        self._on_reply(worker, replies[worker.index], done)
                    elif worker.process.sentinel in ready:
                        self._replace(worker, None, done)
                    elif late := [r for r in worker.inflight.values() if now >= r.deadline]:
                        self._replace(worker, min(late, key=lambda r: r.deadline), done)
            return True
        finally:
            _resolve(done)

    def _next_requests(self, worker: _Worker) -> bool:
        """Move the queued calls that may start now (up to `concurrency` in flight, one per session, each session's
        in order) to `worker.unsent`, in flight from now; whether there are any."""
        busy = {request.session_id for request in worker.inflight.values()}
        waiting = deque()
        while worker.queue and len(worker.inflight) < self.concurrency:
            request = worker.queue.popleft()
            if request.session_id in busy:
                waiting.append(request)
                continue
            if request.future.set_running_or_notify_cancel():  # False: the caller cancelled it while queued
                busy.add(request.session_id)  # later calls of its session wait for it
                request.deadline = time.monotonic() + request.timeout_s
                worker.inflight[request.request_id] = request
                worker.unsent.append(request)
        worker.queue.extendleft(reversed(waiting))
        return bool(worker.unsent)

    def _send(self, worker: _Worker) -> list[tuple[Future, BaseException]]:
        with self._lock:
            requests, worker.unsent = worker.unsent, []
        failures = []
        for request in requests:
            try:
                worker.conn.send((request.request_id, request.session_id, request.op, request.args))
            except OSError:
                return failures  # the worker is dead; its sentinel reports it
            except Exception as exc:  # the arguments do not pickle: the caller's bug, reported as is
                with self._lock:
                    worker.inflight.pop(request.request_id, None)
                failures.append((request.future, exc))
        return failures

    def _on_reply(self, worker: _Worker, reply, done: list) -> None:
        if reply is None:  # EOF: the worker died
            self._replace(worker, None, done)
            return
        request_id, ok, value = reply
        request = worker.inflight.pop(request_id, None)
        assert request is not None, "a worker answered a request it was not sent"
        if ok:
            done.append((request.future, value))
            return
        if request.op == "open":  # the session never came to be: later calls say "not open"
            self._sessions.pop(request.session_id, None)
            worker.sessions.discard(request.session_id)
        done.append((request.future, self._error(request, "raised", f"raised {value}", cause=value)))

    def _replace(self, worker: _Worker, late: _Request | None, done: list) -> None:
        """Kill `worker` (`late` missed its deadline; None: it died by itself), fail its calls and sessions, and
        start a fresh worker in its slot."""
        pid = worker.process.pid
        _kill(worker.process)
        worker.process.join(_JOIN_S)
        worker.conn.close()
        if late is not None:
            cause = (
                f"was killed because session {late.session_id!r} {late.what} ran past its {late.timeout_s:g}s deadline"
            )
        else:
            cause = f"{_exit_text(worker.process.exitcode)}"
        where = f"worker {worker.index} (pid {pid})"
        for session_id in worker.sessions:
            self._sessions.pop(session_id, None)
            self._lost[session_id] = f"{where} {cause}"
        others = sorted(worker.sessions - {late.session_id} if late else worker.sessions)
        for request in worker.pending():
            if request is late:
                error = self._error(
                    request,
                    "timeout",
                    f"did not return within its {late.timeout_s:g}s deadline; {where} was killed and replaced, "
                    f"ending the other sessions on it too ({', '.join(map(repr, others)) or 'none'}). Make the "
                    "environment faster or give its calls a longer deadline",
                )
            elif request.op == "close":
                error = None  # the session is gone either way
            else:
                error = self._error(
                    request,
                    "worker_died",
                    f"failed: {where} {cause}; the session's state is gone, open a new one",
                    cause=cause,
                )
            done.append((request.future, error))
        logger.warning("[%s] %s %s; sessions ended: %s", self.label, where, cause, sorted(worker.sessions))
        self._workers[worker.index] = self._start_worker(worker.index)


def _receive(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _kill(process) -> None:
    if process.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # no group yet: the worker had not set it up
        os.killpg(process.pid, signal.SIGKILL)
    if process.exitcode is None:
        process.kill()


def _kill_all(workers: list[_Worker], lock: threading.Lock, stopped: threading.Event) -> None:
    with lock:  # after this, the monitor thread replaces no worker
        stopped.set()
    for worker in workers:
        _kill(worker.process)
    for worker in workers:
        worker.process.join(_JOIN_S)
        worker.conn.close()


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _resolve(outcomes: list[tuple[Future, object]]) -> None:
    """Complete futures outside the host's lock: their callbacks may call the host again."""
    for future, outcome in outcomes:
        with contextlib.suppress(InvalidStateError):  # cancelled by the caller meanwhile
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def _failed(error: BaseException) -> Future:
    future = Future()
    future.set_exception(error)
    return future
