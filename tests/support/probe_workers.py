"""Worker classes used only by tests: they report where they run and what they received."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import ray
import torch
import torch.distributed as dist

from roll_backend import keys
from roll_backend.distributed.collectives import StageColumns, broadcast_dataproto
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.worker import Worker
from roll_backend.protocol import DataProto


def batch_checksums(batch: DataProto) -> dict:
    tensors = {k: float(v.double().sum()) for k, v in batch.batch.items()} if batch.batch is not None else {}
    return {
        "tensors": tensors,
        "non_tensor": {k: v.tolist() for k, v in batch.non_tensor_batch.items()},
        "meta": dict(batch.meta_info),
    }


class ProbeWorker(Worker):
    required: StageColumns | None = None

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, note: str) -> dict:
        return {
            "rank": self.rank,
            "coords": self.coords,
            "note": note,
            "pid": os.getpid(),
            "env": {key: os.environ.get(key) for key in ("MALLOC_MMAP_MAX_", "RAY_DEDUP_LOGS", "VLLM_RPC_BASE_PATH")},
            "megatron_imported": "megatron.core" in sys.modules,
            "trackers_imported": [name for name in ("wandb", "torch.utils.tensorboard") if name in sys.modules],
        }

    @register(Dispatch.ONE_TO_ALL)
    def sums_over_megatron_groups(self) -> dict:
        """All-reduce of rank + 1 over the TP, PP and DP groups, and the gloo event-loop threads of this process."""
        from megatron.core import parallel_state as mpu

        sums = {}
        for name, group in (
            ("tp", mpu.get_tensor_model_parallel_group()),
            ("pp", mpu.get_pipeline_model_parallel_group()),
            ("dp", mpu.get_data_parallel_group()),
        ):
            value = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(value, group=group)
            sums[name] = float(value)
        names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
        return {"sums": sums, "gloo_loop_threads": names.count("gloo_tcp_loop")}

    @register(Dispatch.ALL_TO_ALL)
    def echo(self, value):
        return (self.rank, value)

    @register(Dispatch.DP_MP_COMPUTE)
    def tag_rows(self, batch: DataProto) -> DataProto:
        n = len(batch)
        batch.non_tensor_batch["served_by_rank"] = np.full(n, self.rank, dtype=object)
        padding = (
            batch.batch[keys.DISPATCH_PADDING]
            if keys.DISPATCH_PADDING in batch.batch.keys()
            else torch.zeros(n, dtype=torch.bool)
        )
        return DataProto.from_dict(
            tensors={
                "ids": batch.batch["ids"].clone(),
                "dp": torch.full((n,), self.coords.dp),
                "padding_rows_in_chunk": torch.full((n,), int(padding.sum())),
            },
            non_tensors={"served_by_rank": np.full(n, self.rank, dtype=object)},
        )

    @register(Dispatch.DP_MP_DISPATCH_FIRST)
    def what_arrived(self, batch: DataProto) -> dict:
        """What this rank holds when the method body runs (after the in-actor broadcast)."""
        return {"rank": self.rank, "rows": len(batch) if batch.batch is not None else 0, "meta": dict(batch.meta_info)}

    @register(Dispatch.ONE_TO_ALL)
    def require_columns(self, required: StageColumns | None) -> None:
        self.required = required

    def stage_columns(self, method_name: str) -> StageColumns | None:
        return self.required if method_name == "received_checksums" else None

    @register(Dispatch.DP_MP_DISPATCH_FIRST)
    def received_checksums(self, batch: DataProto) -> DataProto:
        """Returns one row per input row, from the collect rank; every rank records its checksums."""
        self.last_checksums = batch_checksums(batch)
        return DataProto.from_dict(tensors={"ids": batch.batch["ids"]}, meta_info={"metrics": {"rows": [len(batch)]}})

    @register(Dispatch.ONE_TO_ALL)
    def broadcast_counting(self, batch: DataProto, bucket_bytes: int) -> dict:
        """`batch` broadcast from rank 0 over the whole group in buckets of `bucket_bytes` (the other ranks pass
        nothing): the tensors this rank received, its non-tensor columns and meta_info, and the collectives it took."""
        from unittest import mock

        with mock.patch.object(dist, "broadcast", wraps=dist.broadcast) as counted:
            got = broadcast_dataproto(batch if self.rank == 0 else None, None, 0, bucket_bytes=bucket_bytes)
        return {
            "tensors": dict(got.batch.items()),
            "non_tensor": {k: v.tolist() for k, v in got.non_tensor_batch.items()},
            "meta": got.meta_info,
            "collectives": counted.call_count,
        }

    @register(Dispatch.ONE_TO_ALL)
    def recorded_checksums(self) -> dict:
        return {"rank": self.rank, "coords": self.coords, **self.last_checksums}

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_pp(self, pp: int) -> int:
        if self.coords.pp == pp:
            raise ValueError(f"deliberate failure on pp={pp}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, rank: int, message: str) -> int:
        if self.rank == rank:
            raise RuntimeError(message)
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def block_in_collective(self, victim_rank: int) -> None:
        """The victim waits on an event nobody sets (the test kills it); the others wait in a barrier."""
        if self.rank == victim_rank:
            threading.Event().wait(timeout=120)
        dist.barrier()

    @register(Dispatch.ONE_TO_ALL)
    def placement(self) -> dict:
        """The placement group this actor's resources come from, and how much it holds."""
        context = ray.get_runtime_context()
        return {
            "group": context.get_placement_group_id(),
            "resources": context.get_assigned_resources(),
            "node": context.get_node_id(),
        }

    @register(Dispatch.ONE_TO_ALL)
    def answer_after(self, seconds_per_rank: float) -> int:
        """Rank r answers after (r + 1) * seconds_per_rank: a slow group, for deadlines."""
        threading.Event().wait(timeout=(self.rank + 1) * seconds_per_rank)
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def raise_before_collective(self, victim_rank: int) -> None:
        """The victim raises; the others then wait for it in a barrier that never completes."""
        if self.rank == victim_rank:
            raise ValueError(f"deliberate failure before a collective on rank {victim_rank}")
        dist.barrier()

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def die_in_collective(self, victim_rank: int) -> None:
        """The victim's process is killed while the others wait for it in a barrier, which then fails on them with
        a connection error (usually before Ray has noticed the death)."""
        if self.rank == victim_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    @register(Dispatch.ONE_TO_ALL)
    def start_child_processes(self) -> list[int]:
        """A spawn child and multiprocessing's resource tracker, like torch/vLLM start; returns the group's pids."""
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._lock = context.Lock()  # a semaphore: starts the resource tracker
        self._child = context.Process(target=time.sleep, args=(3600,), daemon=False)
        self._child.start()
        return self.process_group_pids()


class EngineProbeWorker(ProbeWorker):
    """A probe whose role runs no Megatron model (as the rollout and reward roles): TP blocks, no megatron-core."""

    megatron_grid = False
