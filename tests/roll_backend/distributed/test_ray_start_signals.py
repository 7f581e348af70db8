"""`start_local_ray` (roll_backend/distributed/ray_env.py) and SIGTERM: once Ray is up, SIGTERM becomes SystemExit, so
the driver's `finally` shuts Ray down; while Ray is still starting, the process ends at once, as it would without a
handler (a start that hangs, say on a job's head that was stopped meanwhile, must not hold the exit: a stopped job's
driver once outlived its cluster that way). Each case runs in a process of its own, Ray's start stood in for."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

DRIVER = """
import sys, threading
from roll_backend.distributed import ray_env
ray_env.init_local_ray = lambda **kwargs: None if sys.argv[1] == "up" else threading.Event().wait()
ray_started = ray_env.start_local_ray(num_cpus=1)
if sys.argv[1] == "up":
    ray_started.result()
try:
    print("ready", flush=True)  # (inside the try: a SIGTERM right after it is in the driver's run)
    threading.Event().wait()  # the driver's own start-up, or its run
finally:
    print("finally ran", flush=True)
"""


@pytest.mark.parametrize("state, exit_code, cleaned_up", [("up", 15, True), ("starting", 128 + 15, False)])
def test_sigterm_exits_cleanly_once_ray_is_up_and_at_once_while_it_starts(state, exit_code, cleaned_up):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, state], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline() == "ready\n"
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=30) == exit_code
        assert ("finally ran" in driver.stdout.read()) is cleaned_up
    finally:
        driver.kill()
