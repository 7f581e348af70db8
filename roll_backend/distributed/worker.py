"""`Worker`: the base of every role's Ray actor. One rank each: it joins the role's process group, knows
its (dp, tp, pp, cp) coordinates, and runs registered methods with rank-tagged errors."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from roll_backend.distributed import parallel
from roll_backend.distributed.collectives import StageColumns, broadcast_dataproto, check_columns, column_names
from roll_backend.distributed.dispatch import Dispatch, DispatchMode, register
from roll_backend.distributed.faults import FaultTrigger, fault_for_rank
from roll_backend.distributed.orphans import kill_children_with_this_process
from roll_backend.distributed.parallel import ParallelLayout, RankCoords
from roll_backend.errors import NotRestartableError, UserCodeError
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)


class RankError(RuntimeError):
    """An exception raised inside a rank, re-raised with the rank's role and coordinates in front.

    Keeps the parts apart (where, the original exception's type name and message) so the driver can write
    one readable line without parsing Ray's text; they survive pickling across Ray.
    """

    def __init__(self, where: str, type_name: str, message: str):
        super().__init__(f"[{where}] {type_name}: {message}")
        self.where, self.type_name, self.message = where, type_name, message

    def __reduce__(self):
        return type(self), (self.where, self.type_name, self.message)


class NotRestartableRankError(RankError, NotRestartableError):
    """A rank raised a NotRestartableError (e.g. a user reward function failed): the run stops, no restart."""


class Worker:
    """Base class of role actors (actor, critic, reference, reward, rollout)."""

    runs_megatron = True  # its calls run megatron-core code (on CPU: inside megatron_cpu's device mode)

    def __init__(self, role: str, rank: int, world_size: int, layout: ParallelLayout, use_gpu: bool, config: Any = None,
                 fault: str | None = None):
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.config = config
        self._watchdog = kill_children_with_this_process()  # before anything here starts a child process
        self.device = parallel.pick_device(use_gpu)
        self.coords: RankCoords | None = None
        self.last_broadcast_seconds = 0.0  # the in-actor broadcast of the last DP_MP_DISPATCH_FIRST call
        # Fault injection (tests only): `fault` from the run config, else the environment variable (faults.py).
        spec = fault_for_rank(fault, role, rank)
        self._fault = FaultTrigger(spec) if spec is not None else None

    # ---- set-up, called by the Cluster ---------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the process group meets."""
        return parallel.local_address()

    def init_distributed(self, master_addr: str, master_port: int) -> RankCoords:
        self.coords = parallel.init_distributed(
            self.rank, self.world_size, master_addr, master_port, self.layout, self.device
        )
        return self.coords

    def group_ranks(self) -> dict[str, list[int]]:
        return parallel.group_ranks()

    def pid(self) -> int:
        return os.getpid()

    def process_group_pids(self) -> list[int]:
        """The processes of this rank's process group: itself, its watchdog, its children (for orphan tests)."""
        import psutil

        pgid = os.getpgid(0)
        return sorted(p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid)
    @register(Dispatch.ONE_TO_ALL)
    def measure_gemm_tflops(self, dtype: str, shapes: list[tuple[int, int, int]], seconds: float) -> float:
        """This rank's matmul TFLOP/s in `dtype` on its device (with its own thread count): the MFU peak."""
        from roll_backend.perf.peak import measure_gemm_tflops

        return measure_gemm_tflops(dtype, self.device, shapes, seconds)

    # ---- what a role may override ---------------------------------------------------------------------
    def stage_columns(self, method_name: str) -> StageColumns | None:
        """Columns each pipeline stage needs for `method_name`; checked on every rank after the broadcast."""
        return None

    # ---- running a registered method ------------------------------------------------------------------
    @property
    def rank_where(self) -> str:
        """The role and this rank's coordinates, e.g. "actor rank 2/4, dp=0 tp=0 pp=1 cp=0"."""
        where = self.coords.describe() if self.coords else f"rank {self.rank}/{self.world_size}"
        return f"{self.role} {where}"

    @property
    def rank_tag(self) -> str:
        return f"[{self.rank_where}]"

    def run_registered(self, method, mode: DispatchMode, args: tuple, kwargs: dict):
        try:
            if self._fault is not None:
                self._fault.before_call(method.__name__, self.rank_tag)
            with parallel.device_call_context(self.device, self.runs_megatron):
                if mode.broadcast_in_actor:
                    started = time.perf_counter()
                    args, kwargs = self._receive_batches(method.__name__, args, kwargs)
                    self.last_broadcast_seconds = time.perf_counter() - started
                return method(self, *args, **kwargs)
        except UserCodeError as exc:
            # Keeps its type through Ray, so the driver (and recovery) can tell user code from a broken rank.
            raise UserCodeError(f"{self.rank_tag} {exc}") from exc
        except Exception as exc:
            # Ray attaches the remote traceback of this exception and of its cause; the class tells the driver
            # whether a restart could help.
            error_cls = NotRestartableRankError if isinstance(exc, NotRestartableError) else RankError
            raise error_cls(self.rank_where, type(exc).__name__, str(exc)) from exc

    def _receive_batches(self, method_name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The in-actor broadcast: every DataProto argument goes over TPxCP (on pp0), then over PP."""
        required = self.stage_columns(method_name)
        args = tuple(self._broadcast_batch(a, required) if isinstance(a, DataProto) else a for a in args)
        kwargs = {k: self._broadcast_batch(v, required) if isinstance(v, DataProto) else v for k, v in kwargs.items()}
        return args, kwargs

    def _broadcast_batch(self, batch: DataProto, required: StageColumns | None) -> DataProto:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        coords = self.coords
        hops = []
        if coords.tp_size * coords.cp_size > 1 and coords.pp == 0:
            hops.append(mpu.get_tensor_and_context_parallel_group())
        if coords.pp_size > 1:
            hops.append(mpu.get_pipeline_model_parallel_group())
        if not hops:
            check_columns(column_names(batch), required, self.rank_tag)  # no hop to make; same check
        for i, group in enumerate(hops):
            # Columns are checked at each rank's last hop: every rank takes part in one, so a missing
            # column fails everywhere at once instead of leaving the other stages waiting.
            last = i == len(hops) - 1
            batch = broadcast_dataproto(batch, group, dist.get_global_rank(group, 0), required if last else None, self.rank_tag)
        return batch


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:  # exited meanwhile
        return None
