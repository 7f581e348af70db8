"""Runs model-written Python in a fresh local process and reports what happened in words a model can read.

The process starts either inside the bubblewrap boundary (bubblewrap.py: namespaces, a minimal read-only root, a
capped tmpfs, seccomp) or, only when named (`backend: process`), as a plain subprocess in a private temporary
directory with `unshare -rn` where the machine allows it. Both then get the same layers from the prelude (prelude.py):
rlimits (CPU seconds then SIGKILL, address space, file size, no core files, with processes allowed a process count)
and an audit hook that turns refused operations into clear messages. The supervisor here reads stdout and stderr
up to their caps, kills the process group at the wall-clock deadline or on an output flood, and reaps the child
with its CPU time.

The audit hook is not a boundary (CPython says so): without bubblewrap, code that corrupts the interpreter or
calls native code the hook does not see gets past it, and what holds is the rlimits, the wall clock and the
namespace when present. That is why the process backend must be chosen by name.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from roll_backend.agentic.sandbox import bubblewrap, cgroups, seccomp
from roll_backend.agentic.sandbox.limits import STDERR_TAIL_CHARS, SandboxLimits, SandboxResult

logger = logging.getLogger(__name__)

PRELUDE = Path(__file__).with_name("prelude.py")
MAIN_FILE = "main.py"  # the prelude's name for the user's code (tracebacks show it)
STDIN_FILE = ".stdin"  # the process backend: the run's standard input, beside main.py
READ_CHUNK = 65536
POLL_S = 0.05  # how often the supervisor looks at the clock while the child is quiet
DRAIN_S = 0.5  # after the main process exits, how long a child that left its process group may hold the pipes
THREAD_ALLOWANCE = 32  # RLIMIT_NPROC counts threads too: room for the code's own and its libraries' threads
# The kernel kills at its sampled CPU time; wait4's rusage reports less under contention (0.95 s for a 1 s limit
# on a busy 2-core machine), so a SIGKILL with this fraction of the limit used is the CPU limit.
CPU_ACCOUNTING_FRACTION = 0.8
# The prelude's refusal as Python prints it; found anywhere in a failed run's stderr, since a library may wrap it
# (urllib's URLError shows it as the exception "during handling" of which its own was raised).
_VIOLATION = re.compile(r"^(?:SandboxViolation|SandboxBlockedImport): (.+)$", re.M)


@dataclass
class _Run:
    """What the supervisor saw of the child."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    exit_code: int | None = None
    cpu_s: float = 0.0
    timed_out: bool = False
    flooded: bool = False


def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), backend: str = "bubblewrap", stdin: str = ""
) -> SandboxResult:
    """Run `code` (reading `stdin`) in a fresh interpreter under `backend` (bubblewrap, or process when named);
    everything it started is killed and its files are gone before this returns."""
    if backend == "bubblewrap":
        with _bubblewrap_run(code, limits, stdin) as (command, pass_fds), _process_cap(limits) as procs:
            if procs is not None:  # the first process joins the capped cgroup, then becomes bwrap
                command = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]
            env = _child_env(bubblewrap.WORKDIR)
            run, seconds = _start_and_supervise(command, limits, cwd=None, env=env, **pass_fds)
        run.exit_code = _signal_from_bwrap(run.exit_code)
    else:
        root = tempfile.mkdtemp(prefix="roll_sandbox_")
        try:
            Path(root, MAIN_FILE).write_text(code, encoding="utf-8")
            Path(root, STDIN_FILE).write_text(stdin, encoding="utf-8")
            config = json.dumps(_child_config(limits, stdin=STDIN_FILE))
            command = [*_namespace_prefix(limits.network), sys.executable, "-I", str(PRELUDE), config]
            run, seconds = _start_and_supervise(command, limits, cwd=root, env=_child_env(root))
        finally:
            _remove_tree(root)
    stdout = run.stdout.decode("utf-8", errors="replace")
    stderr = run.stderr.decode("utf-8", errors="replace")
    exit_code = None if run.timed_out or run.flooded else run.exit_code  # None: the supervisor stopped it
    return SandboxResult(stdout, stderr, exit_code, seconds, _describe_failure(run, stderr, limits))


@contextlib.contextmanager
def _bubblewrap_run(code: str, limits: SandboxLimits, stdin: str):
    """The bwrap command for one run and the descriptors it reads: the seccomp program (a pipe), the code and its
    input (unlinked temporary files, so nothing stays on the host's disk)."""
    program = seccomp.filter_program(processes=limits.max_processes > 0)
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as given:
        try:
            os.write(write_end, program)  # a few hundred bytes: far below a pipe's buffer
            os.close(write_end)
            for file, text in ((source, code), (given, stdin)):
                file.write(text.encode("utf-8"))
                file.flush()
                file.seek(0)
            config = _child_config(limits, stdin=bubblewrap.STDIN_AT)
            command = bubblewrap.command(limits, read_end, source.fileno(), given.fileno(), PRELUDE, config)
            yield command, {"pass_fds": (read_end, source.fileno(), given.fileno())}
        finally:
            os.close(read_end)


@contextlib.contextmanager
def _process_cap(limits: SandboxLimits):
    """Under root with processes allowed, a pids cgroup (RLIMIT_NPROC does not bind root); else nothing is needed:
    the seccomp filter forbids processes, or RLIMIT_NPROC counts the sandbox's own user namespace."""
    if limits.max_processes == 0 or os.geteuid() != 0:
        yield None
        return
    with cgroups.pids_limited(limits.max_processes + THREAD_ALLOWANCE + 2) as procs:  # + bwrap and the interpreter
        yield procs


def _start_and_supervise(command: list[str], limits: SandboxLimits, cwd, env, pass_fds=()) -> tuple[_Run, float]:
    started = time.monotonic()
    child = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=pass_fds,
        start_new_session=True,  # its own process group: one killpg ends it and its children
    )
    run = _supervise(child, limits, deadline=started + limits.wall_s)
    return run, time.monotonic() - started


def _signal_from_bwrap(code: int | None) -> int | None:
    """bwrap exits with 128 + N when the code died of signal N; report it as Popen would (-N)."""
    if code is not None and 128 < code <= 128 + 64:
        return -(code - 128)
    return code


def _child_config(limits: SandboxLimits, stdin: str) -> dict:
    cpu = math.ceil(limits.cpu_s)
    memory = limits.memory_mb * 2**20
    rlimits = {
        "RLIMIT_CPU": (cpu, cpu),  # soft = hard: SIGKILL (no SIGXCPU the code could ignore) at the limit
        "RLIMIT_AS": (memory, memory),
        "RLIMIT_FSIZE": (limits.file_mb * 2**20, limits.file_mb * 2**20),
        "RLIMIT_CORE": (0, 0),
    }
    if os.geteuid() != 0:  # the kernel exempts root; for others it counts every task of the uid, so add theirs
        nproc = _tasks_of_uid(os.geteuid()) + limits.max_processes + THREAD_ALLOWANCE
        rlimits["RLIMIT_NPROC"] = (nproc, nproc)
    return {"limits": rlimits, "network": limits.network, "processes": limits.max_processes > 0, "stdin": stdin}


def _child_env(root: str) -> dict[str, str]:
    threads = "1"  # BLAS/OpenMP pools would spend the CPU and process budget on threads
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": root,
        "TMPDIR": root,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }


@functools.cache
def _namespace_prefix(network: bool) -> tuple[str, ...]:
    """`unshare -rn --` when a new user + network namespace can be made here (tried once), else nothing."""
    unshare = shutil.which("unshare")
    if network or unshare is None:
        return ()
    try:
        probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.info("sandbox: no network namespace (unshare failed: %s); the audit hook alone blocks network", exc)
        return ()
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip()
        logger.info("sandbox: no network namespace (unshare -rn: %s); the audit hook alone blocks network", reason)
        return ()
    return (unshare, "-rn", "--")


def _tasks_of_uid(uid: int) -> int:
    """Tasks (threads included) the kernel counts against this uid's RLIMIT_NPROC."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                total += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:  # the process ended while we looked
            continue
    return total


def _supervise(child: subprocess.Popen, limits: SandboxLimits, deadline: float) -> _Run:
    """Read both pipes (capped) until they close, the deadline passes, or the output overflows; then kill the
    process group and reap the child with its CPU time."""
    run = _Run()
    buffers = {child.stdout: run.stdout, child.stderr: run.stderr}
    try:
        with selectors.DefaultSelector() as selector:
            for pipe in buffers:
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map() and not run.flooded:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    run.timed_out = run.exit_code is None
                    break
                for key, _ in selector.select(timeout=min(remaining, POLL_S)):
                    if not _read_into(key.fileobj, buffers[key.fileobj], limits.output_bytes, run):
                        selector.unregister(key.fileobj)
                if run.exit_code is None and _reap(child, run, block=False):
                    _kill_group(child.pid)  # the run ends with its main process; children left are stopped
                    deadline = min(deadline, time.monotonic() + DRAIN_S)
    finally:
        _kill_group(child.pid)
        if run.exit_code is None:
            _reap(child, run, block=True)
        for pipe in buffers:
            pipe.close()
    return run


def _read_into(pipe, buffer: bytearray, cap: int, run: _Run) -> bool:
    """Read what the pipe has into `buffer`, keeping at most `cap` bytes; False at end of file."""
    chunk = os.read(pipe.fileno(), READ_CHUNK)
    if not chunk:
        return False
    room = cap - len(buffer)
    buffer += chunk[:room]
    if len(chunk) > room:
        run.flooded = True
    return True


def _reap(child: subprocess.Popen, run: _Run, block: bool) -> bool:
    """Collect the exit status and CPU time (wait4's rusage) once the child ends; False if it still runs."""
    pid, status, usage = os.wait4(child.pid, 0 if block else os.WNOHANG)
    if pid == 0:
        return False
    run.exit_code = child.returncode = os.waitstatus_to_exitcode(status)
    run.cpu_s = usage.ru_utime + usage.ru_stime
    return True


def _kill_group(pgid: int) -> None:
    # Safe after the leader was reaped: the kernel does not reuse an id while its process group has members.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_tree(root: str) -> None:
    def make_writable_and_retry(function, path, _exc_info):
        os.chmod(os.path.dirname(path), 0o700)  # the code may have taken its own permissions away
        function(path)

    try:
        shutil.rmtree(root, onerror=make_writable_and_retry)
    except OSError as exc:
        logger.warning("sandbox: could not remove %s: %s", root, exc)


def _describe_failure(run: _Run, stderr: str, limits: SandboxLimits) -> str | None:
    """The message for what went wrong, most telling first; None when the run succeeded."""
    last_line = stderr.rstrip().rsplit("\n", 1)[-1].strip()
    violations = _VIOLATION.findall(stderr)
    code = run.exit_code
    if run.timed_out:
        return f"timed out after {limits.wall_s:g}s (wall clock)"
    if run.flooded:
        return f"output truncated at {limits.output_bytes} bytes (the program was stopped)"
    if violations and code:
        return violations[-1]
    cpu_limit_hit = run.cpu_s >= CPU_ACCOUNTING_FRACTION * math.ceil(limits.cpu_s)
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu_limit_hit):
        return f"CPU time limit of {limits.cpu_s:g}s exceeded"
    if code and "MemoryError" in stderr[-STDERR_TAIL_CHARS:]:
        return f"memory limit of {limits.memory_mb} MB exceeded (MemoryError)"
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    if code:
        return f"exited with code {code}: {last_line}" if last_line else f"exited with code {code}"
    return None
