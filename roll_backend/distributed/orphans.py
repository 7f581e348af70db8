"""No orphans: a process's children die with it, however it ends (SIGKILL included). Used by every rank (for
multiprocessing's resource tracker and the spawn/fork children of torch, Megatron or vLLM) and by the CLI driver
(for Ray's own node processes: the dashboard and runtime-env agents outlive a SIGKILLed driver otherwise).

How: a tiny watchdog child notes the process's descendants every POLL_S seconds; once the process is gone (the
watchdog's parent changes) it kills them, and with `own_group` the whole process group the process leads (so
children started after the last look go too)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

POLL_S = 1.0  # bounds how long descendants outlive the process
WATCHDOG = (
    f"POLL_S = {POLL_S}\n"
    """
import os, signal, sys, time
import psutil
parent, own_group, me = int(sys.argv[1]), sys.argv[2] == "1", os.getpid()
seen = {}
def note_descendants():
    try:
        for child in psutil.Process(parent).children(recursive=True):
            if child.pid != me:
                seen[child.pid] = child.create_time()
    except psutil.Error:
        pass
while os.getppid() == parent:
    note_descendants()
    time.sleep(POLL_S)
for pid, started in seen.items():
    try:
        child = psutil.Process(pid)
        if child.create_time() != started:
            continue  # the pid was reused
        if os.getpgid(pid) == pid and pid != parent:
            os.killpg(pid, signal.SIGKILL)  # a group leader (a rank, a Ray process): its whole group
        else:
            child.kill()
    except (psutil.Error, OSError):
        pass
if own_group and os.getpgid(0) == parent:
    os.killpg(parent, signal.SIGKILL)
"""
)


def kill_children_with_this_process(own_group: bool = True) -> subprocess.Popen | None:
    """Start the watchdog for this process (Linux/macOS); returns it, or None where it cannot work.
    `own_group`: first make this process a process-group leader (ranks; not the driver, whose group may hold
    the user's shell pipeline) and kill that group too."""
    if not hasattr(os, "setpgid"):
        return None
    if own_group:
        try:
            if os.getpgid(0) != os.getpid():
                os.setpgid(0, 0)
        except OSError as exc:  # e.g. a session leader already: its children are still noted and killed
            logger.warning("cannot give pid %d its own process group (%s)", os.getpid(), exc)
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, str(os.getpid()), "1" if own_group else "0"],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


def exit_once_on_sigterm() -> None:
    """Let a SIGTERM that arrives while the process is already exiting do nothing. Ray's handler turns SIGTERM into
    SystemExit; a second one (Ray may signal a worker twice as it stops it) raised again inside whatever the exit was
    running (an atexit callback, a Popen's finaliser) and printed "Exception ignored in ..." with a traceback at the
    end of a clean run. Main thread only (Python's rule for signal handlers); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or getattr(handler, "exits_once", False):
        return
    exiting = threading.Event()

    def once(signum, frame):
        if exiting.is_set():
            return
        exiting.set()
        handler(signum, frame)

    once.exits_once = True
    signal.signal(signal.SIGTERM, once)
