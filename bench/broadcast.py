"""Broadcast a DataProto over 4 gloo ranks: ours (a header, then buckets of whole columns with the schema in the
first; a column over a MiB alone) against the pickled way (`broadcast_object_list` of the whole batch, as ROLL does)
and raw per-tensor `dist.broadcast` with the shapes known in advance (the transport's own limit; below a MiB per
column ours takes fewer collectives than it). Moves float32 and int64 tensors only: no compute dtype.
Run: .venv/bin/python bench/broadcast.py [--sizes-mib 64 512] [--repeats 3]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _machine import announce

from roll_backend.distributed.collectives import broadcast_dataproto
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.ray_env import init_local_ray
from roll_backend.distributed.worker import Worker
from roll_backend.distributed.worker_group import RankResources, WorkerGroup
from roll_backend.protocol import DataProto

COLUMNS = 8  # a batch is 8 float32 columns (plus an int64 id column) adding up to the requested size


def make_batch(mib: int) -> DataProto:
    rows = 512
    cols = mib * 2**20 // (4 * COLUMNS * rows)
    tensors = {f"col{i}": torch.randn(rows, cols) for i in range(COLUMNS)}
    tensors["ids"] = torch.arange(rows)
    return DataProto.from_dict(tensors=tensors, meta_info={"step": 1})


class BroadcastBenchWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def time_broadcasts(self, mib: int, repeats: int) -> dict[str, float]:
        is_src = dist.get_rank() == 0
        batch = make_batch(mib) if is_src else None
        # The raw way knows the shapes in advance: share them once, outside the timings.
        holder = [{k: (v.shape, v.dtype) for k, v in batch.batch.items()} if is_src else None]
        dist.broadcast_object_list(holder, src=0)
        shapes = holder[0]

        def ours():
            broadcast_dataproto(batch, None, 0)

        def pickled():
            holder = [batch]
            dist.broadcast_object_list(holder, src=0)

        def raw():
            for key in sorted(shapes):
                shape, dtype = shapes[key]
                tensor = batch.batch[key] if is_src else torch.empty(shape, dtype=dtype)
                dist.broadcast(tensor, src=0)

        times: dict[str, list[float]] = {"ours": [], "pickled": [], "raw": []}
        for _ in range(repeats):
            for name, fn in (("raw", raw), ("ours", ours), ("pickled", pickled)):
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the broadcast is done when the slowest rank is
                times[name].append(float(elapsed))
        return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    announce()
    init_local_ray(num_cpus=8)
    group = WorkerGroup(BroadcastBenchWorker, "bench", 4, ParallelLayout(), RankResources(num_cpus=0.5))
    try:
        results = {
            mib: group.call(BroadcastBenchWorker.time_broadcasts, mib, args.repeats)[0] for mib in args.sizes_mib
        }
    finally:
        group.shutdown()
    for mib, t in results.items():
        print(
            f"{mib:4d} MiB over 4 gloo ranks: ours {t['ours']:.3f} s, pickled {t['pickled']:.3f} s, "
            f"raw {t['raw']:.3f} s"
        )
    mib, t = max(results.items())
    print(f"{mib} MiB: {t['pickled'] / t['ours']:.1f}x faster than pickled, {t['ours'] / t['raw']:.2f}x the raw time")


if __name__ == "__main__":
    main()
