"""`Worker`: the base of every role's Ray actor. One rank each: it joins the role's process group, knows
its (dp, tp, pp, cp) coordinates, and runs registered methods with rank-tagged errors. For a method registered
with an in-actor broadcast mode it first receives the batch: `parallel` names the hops, `collectives` moves it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
import time
from typing import Any

from roll_backend.distributed import heap, parallel
from roll_backend.distributed.collectives import StageColumns, broadcast_over_hops
from roll_backend.distributed.dispatch import Dispatch, MethodDispatch, register
from roll_backend.distributed.faults import FAULTS_OFF, FaultTrigger, fault_for_rank
from roll_backend.distributed.layout import ParallelLayout, RankCoords
from roll_backend.distributed.orphans import exit_once_on_sigterm, kill_children_with_this_process
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

    # Whether the role's ranks lay out Megatron's parallel state (tp x cp x dp x pp, experts); a role that runs no
    # Megatron model (an engine, plain code) says False: TP blocks only, and no megatron-core import.
    megatron_grid: bool = True
    # Whether a process of this role can tear its rank down in place and serve a later group's (rank_pool.py).
    poolable: bool = False

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        layout: ParallelLayout,
        use_gpu: bool,
        config: Any = None,
        fault: str | None = None,
        host: Worker | None = None,
    ):
        """`host`: the worker whose process this one shares (a facet of the hybrid engine, workers/hybrid.py): its
        watchdog and device serve both; the coordinates are set by the host."""
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.config = config
        # (before anything here starts a child process)
        self._watchdog = host._watchdog if host is not None else _process_watchdog()
        exit_once_on_sigterm()
        self.device = host.device if host is not None else parallel.pick_device(use_gpu)
        self.coords: RankCoords | None = None
        self.last_broadcast_seconds = 0.0  # the in-actor broadcast of the last DP_MP_DISPATCH_FIRST call
        # Fault injection (tests only): `fault` from the run config, else the environment variable (faults.py).
        spec = fault_for_rank(fault, role, rank)
        self._fault = FaultTrigger(spec) if spec is not None else None
        self._poisoned = False

    # ---- set-up, called by the WorkerGroup -----------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the process group meets: a store it serves for the group's life."""
        self._rendezvous_store, address, port = parallel.rendezvous_store()
        return address, port

    def init_distributed(self, master_addr: str, master_port: int) -> RankCoords:
        self.coords = parallel.init_distributed(
            self.rank,
            self.world_size,
            master_addr,
            master_port,
            self.layout,
            self.device,
            store=getattr(self, "_rendezvous_store", None),
            megatron_grid=self.megatron_grid,
        )
        return self.coords

    # ---- a pooled process (rank_pool.py), called by its RankHost ------------------------------------------
    def release_rank(self) -> bool:
        """Tear down what this rank holds (its role's state, then its process groups) so that the process can serve
        another group (of any worker class); True when it is clean to reuse, False where this role cannot tear down
        in place."""
        if not self.poolable or not self.release_role():
            return False
        parallel.destroy_distributed()
        self.__dict__.clear()
        if "torch._dynamo" in sys.modules:  # compiled code and its guards hold the old model
            sys.modules["torch._dynamo"].reset()
        heap.freeze_what_survives()  # (the imports: the next group's collections walk only what it makes)
        _return_freed_memory()
        return True

    def release_role(self) -> bool:
        """Drop the role's own state before `release_rank`; False where that cannot be undone in this process (an
        engine's own processes). A process that imported user code is not reused either way (RankHost.release_rank)."""
        return True

    @register(Dispatch.ONE_TO_ALL)
    def group_ranks(self) -> dict[str, list[int]]:
        """Global ranks of this rank's parallel groups (tp, pp, dp, cp, tp_cp, ep, etp, edp)."""
        return parallel.group_ranks()

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def process_group_pids(self) -> list[int]:
        """The processes of this rank's process group: itself, its watchdog, its children (for orphan tests)."""
        import psutil

        pgid = os.getpgid(0)
        return sorted(p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid)

    @register(Dispatch.ONE_TO_ALL)
    def inject_fault(self, setting: str | None) -> None:
        """Arm fault injection on this rank from now on (`action:role:rank:phase:step`, counted from this call; the
        ranks it does not name ignore it), or disarm it with None: a live group's recovery tested without a rebuild."""
        spec = fault_for_rank(setting or FAULTS_OFF, self.role, self.rank)
        self._fault = FaultTrigger(spec) if spec is not None else None

    @register(Dispatch.ONE_TO_ALL)
    def measure_gemm_tflops(self, dtype: str, shapes: list[tuple[int, int, int]], seconds: float) -> float:
        """This rank's matmul TFLOP/s in `dtype` on its device (with its own thread count): the MFU peak."""
        from roll_backend.perf.peak import measure_gemm_tflops

        return measure_gemm_tflops(dtype, self.device, shapes, seconds)

    @register(Dispatch.ONE_TO_ALL)
    def memory_gib(self) -> dict[str, float]:
        """This rank's process memory in GiB: resident now and at its peak, and on a GPU the peak allocated."""
        import resource

        import psutil

        memory = {
            "rss": psutil.Process().memory_info().rss / 2**30,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # (KiB on Linux)
        }
        if self.device == "cuda":
            import torch

            memory["peak_device"] = torch.cuda.max_memory_allocated() / 2**30
        return memory

    # ---- what a role may override ---------------------------------------------------------------------
    def stage_columns(self, method_name: str) -> StageColumns | None:
        """Columns each pipeline stage needs for `method_name`; checked on every rank after the broadcast."""
        return None

    def call_context(self) -> contextlib.AbstractContextManager:
        """What each registered call runs inside; a role whose strategy needs one returns the strategy's
        (Strategy.call_context)."""
        return contextlib.nullcontext()

    # ---- running a registered method ------------------------------------------------------------------
    @property
    def rank_where(self) -> str:
        """The role and this rank's coordinates, e.g. "actor rank 2/4, dp=0 tp=0 pp=1 cp=0"."""
        where = self.coords.describe() if self.coords else f"rank {self.rank}/{self.world_size}"
        return f"{self.role} {where}"

    @property
    def rank_tag(self) -> str:
        return f"[{self.rank_where}]"

    def fault_point(self, point: str) -> bool:
        """A point inside a call fault injection may target (roll_backend.roles.FAULT_POINTS); True when the caller
        must change its data here (a data action: faults.DATA_ACTIONS)."""
        return self._fault is not None and self._fault.before_call(point, self.rank_tag)

    def poisoned(self) -> bool:
        """Whether fault injection's `nan` action picked the call now running (it then makes its loss NaN)."""
        return self._poisoned

    def run_registered(self, method, how: MethodDispatch, args: tuple, kwargs: dict):
        try:
            self._poisoned = self._fault is not None and self._fault.before_call(how.deadline, self.rank_tag)
            with self.call_context():
                if how.mode.broadcast_in_actor:
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
        hops = parallel.batch_broadcast_hops(self.coords)

        def receive(value):
            return broadcast_over_hops(value, hops, required, self.rank_tag) if isinstance(value, DataProto) else value

        return tuple(receive(a) for a in args), {k: receive(v) for k, v in kwargs.items()}


def _return_freed_memory() -> None:
    """Give the heap's free memory back to the OS (a CPU rank's allocator keeps it: ray_env.CPU_RANK_ENV_DEFAULTS), so
    an idle pooled process holds what its imports need, not its last model's peak."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@functools.cache
def _process_watchdog():
    """The process's one watchdog, however many ranks it serves in turn (rank_pool.py)."""
    return kill_children_with_this_process()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:  # exited meanwhile
        return None
