"""How fast failures are noticed (README figures, not a test): a rank killed while the others wait for it in a
collective, and a rank that hangs past a call's deadline; plus how long the killed group's processes take to go.

    PYTHONPATH=$PWD .venv/bin/python bench/fault_detection.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from _machine import announce

SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"
sys.path.insert(0, str(SUPPORT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    announce()
    from roll_backend.distributed.ray_env import init_local_ray

    support_path = os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    init_local_ray(num_cpus=8, env_vars={"PYTHONPATH": support_path})
    from probe_workers import ProbeWorker
    from process_checks import wait_until_gone

    from roll_backend.distributed.dispatch import DispatchError
    from roll_backend.distributed.layout import ParallelLayout
    from roll_backend.distributed.worker import Worker
    from roll_backend.distributed.worker_group import WorkerGroup

    death, hang, cleanup = [], [], []
    for _ in range(args.repeats):
        group = WorkerGroup(ProbeWorker, "bench", 4, ParallelLayout(tp=2))
        pids = group.call(Worker.pid)
        # rank 1 waits on an event, the others in a barrier (a non-blocking method: call returns a GroupFuture)
        future = group.call(ProbeWorker.block_in_collective, 1)
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        try:
            future.get(timeout_s=300)
        except DispatchError:
            death.append(time.monotonic() - killed)
        group_pids = [pid for rank in range(4) if rank != 1 for pid in [pids[rank]]]
        gone_from = time.monotonic()
        wait_until_gone(group_pids, within_s=60)
        cleanup.append(time.monotonic() - gone_from)
        group.shutdown()
        group = WorkerGroup(ProbeWorker, "bench", 2, ParallelLayout(tp=2))
        sent = time.monotonic()
        try:
            group.call(ProbeWorker.answer_after, 3600.0, timeout_s=5)
        except DispatchError:
            hang.append(time.monotonic() - sent - 5)
        group.shutdown()
    for name, values in (
        ("rank killed -> driver's error", death),
        ("hang: detection after the 5 s deadline", hang),
        ("broken group's other ranks gone after the error", cleanup),
    ):
        print(f"{name}: median {statistics.median(values):.2f} s, max {max(values):.2f} s over {len(values)}")


if __name__ == "__main__":
    main()
