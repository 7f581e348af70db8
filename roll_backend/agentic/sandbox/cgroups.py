"""A process-count cap for sandboxed code that may start processes, where RLIMIT_NPROC does not hold: the kernel
exempts a process whose user is root on the host, and bubblewrap run by root maps the sandbox's user to root. A
fresh pids cgroup (v1 `pids` controller, or v2 with `pids` delegated) under this process's own takes the run; every
process in it is killed and the cgroup removed afterwards."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from pathlib import Path

from roll_backend.agentic.sandbox.limits import SandboxUnavailable

logger = logging.getLogger(__name__)

_runs = itertools.count()


def _own_pids_cgroup() -> Path | None:
    """This process's pids cgroup folder (v1 pids hierarchy, else v2 with pids enabled for children), if writable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
            if (folder / "pids.max").exists() or folder == Path("/sys/fs/cgroup/pids"):
                return folder if os.access(folder, os.W_OK) else None
    for line in lines:
        if line.startswith("0::"):
            folder = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            control = folder / "cgroup.subtree_control"
            if control.exists() and "pids" in control.read_text().split() and os.access(folder, os.W_OK):
                return folder
    return None


@contextlib.contextmanager
def pids_limited(max_tasks: int):
    """Yields the cgroup.procs file a run's first process writes its pid into; its tasks are capped at `max_tasks`
    and all killed on exit. SandboxUnavailable when no pids cgroup can be made here."""
    parent = _own_pids_cgroup()
    if parent is None:
        raise SandboxUnavailable(
            "sandbox.max_processes > 0 run by root needs a writable pids cgroup (RLIMIT_NPROC does not bind root) "
            "and none is here; run the tool workers as an unprivileged user, or keep max_processes: 0"
        )
    folder = parent / f"roll_sandbox_{os.getpid()}_{next(_runs)}"
    folder.mkdir()
    try:
        (folder / "pids.max").write_text(str(max_tasks))
        yield folder / "cgroup.procs"
    finally:
        _empty_and_remove(folder)


def _empty_and_remove(folder: Path) -> None:
    for _ in range(100):  # processes may still be exiting after their SIGKILL
        try:
            pids = [int(pid) for pid in (folder / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            folder.rmdir()
            return
        except OSError:  # busy until the killed tasks have exited
            time.sleep(0.01)
    logger.warning("sandbox: could not remove the cgroup %s", folder)
