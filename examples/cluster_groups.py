"""An actor group from a plain Ray driver: a Worker subclass with registered methods, four ranks as TP=2 x DP=2,
and group calls that split a batch by DP rank (padding an uneven one), run it, and join the answers.

    .venv/bin/python examples/cluster_groups.py

The worker class is defined right here: Ray pickles classes of __main__ by value, so the ranks can use it.
"""

from __future__ import annotations

import os
import time

import torch

from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.ray_env import init_local_ray
from roll_backend.distributed.worker import Worker
from roll_backend.distributed.worker_group import WorkerGroup
from roll_backend.protocol import DataProto


class SquareWorker(Worker):
    """Squares its chunk of the batch and says which rank did it."""

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> str:
        return f"pid {os.getpid()}: {self.coords.describe()}"

    @register(Dispatch.DP_MP_COMPUTE)
    def square(self, batch: DataProto) -> DataProto:
        """x [B] float32 -> x_squared [B] float32 and dp_rank [B] int64 (every rank of a DP group gets the chunk)."""
        x = batch.batch["x"]
        return DataProto.from_dict(
            tensors={"x_squared": x * x, "dp_rank": torch.full_like(x, self.coords.dp, dtype=torch.int64)}
        )


def main() -> None:
    start = time.perf_counter()
    init_local_ray(num_cpus=4)
    group = WorkerGroup(SquareWorker, role="square", world_size=4, layout=ParallelLayout(tp=2))
    print(f"group of {group.world_size} ready in {time.perf_counter() - start:.1f}s")
    for line in group.call(SquareWorker.where):  # ONE_TO_ALL: one answer per rank
        print(" ", line)

    batch = DataProto.from_dict(tensors={"x": torch.arange(5, dtype=torch.float32)})  # 5 rows over dp=2: padded to 6
    out = group.call(SquareWorker.square, batch)  # split by DP, collected from tp0 of each DP group, padding dropped
    print("x        ", batch.batch["x"].tolist())
    print("x_squared", out.batch["x_squared"].tolist())
    print("dp_rank  ", out.batch["dp_rank"].tolist())
    assert torch.equal(out.batch["x_squared"], batch.batch["x"] ** 2)
    group.shutdown()


if __name__ == "__main__":
    main()
