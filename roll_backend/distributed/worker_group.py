"""`WorkerGroup`: one Ray actor per rank of a role, on a placement group. `group.call(Worker.method, ...)` runs a
registered worker method on every rank: split by the method's dispatch mode, sent, collected, under one deadline."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll_backend.distributed import rank_pool
from roll_backend.distributed.deadlines import Deadline, call_deadline, earliest
from roll_backend.distributed.dispatch import DispatchError, MethodDispatch, method_dispatch
from roll_backend.distributed.layout import ParallelLayout, RankCoords
from roll_backend.distributed.placement import (  # noqa: F401  (create_placement_group: part of this module's API)
    RankPlacement,
    create_placement_group,
    reserve_rank_bundles,
    shared_rank_bundles,
)
from roll_backend.distributed.rank_host import RankHost
from roll_backend.distributed.ray_env import cpu_rank_env
from roll_backend.distributed.worker import RankError, Worker
from roll_backend.errors import NotRestartableError, UserCodeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankResources:
    """What one rank of a role takes from its placement-group bundle: a GPU on a cluster, a CPU share here."""

    num_cpus: float = 0.5
    num_gpus: float = 0.0

    @property
    def use_gpu(self) -> bool:
        return self.num_gpus > 0


class RankDiedError(DispatchError):
    """A rank's actor (or its node) went away during a call."""


class GroupTimeoutError(DispatchError):
    """Ranks did not answer a call within its deadline."""


class RankRaisedError(DispatchError):
    """A rank raised; `restartable` is False when its exception was a NotRestartableError (user code, data)."""

    def __init__(self, message: str, restartable: bool = True):
        super().__init__(message)
        self.restartable = restartable


class GroupBrokenError(DispatchError):
    """A call on a group that an earlier failure broke; `first_failure` is that failure."""

    def __init__(self, message: str, first_failure: DispatchError):
        super().__init__(message)
        self.first_failure = first_failure
        self.restartable = getattr(first_failure, "restartable", True)


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI_ESCAPE.sub("", text)


def rank_failure_line(role: str, method_name: str, where: str, error: ray.exceptions.RayTaskError) -> str:
    """One readable line for a rank's exception: role, method, the rank's coordinates, the rank's own exception
    type and message; no Ray banner or colour codes (the full remote traceback stays on the DispatchError's
    __cause__ and in the driver's log)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, RankError):
        type_name, message = cause.type_name, cause.message
    elif cause is not None and not isinstance(cause, ray.exceptions.RayError):
        type_name, message = type(cause).__name__, str(cause)
    else:  # the cause could not be rebuilt on the driver: Ray's own summary is all there is
        type_name, message = type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else ""
    message = " ".join(strip_ansi(message).split())  # one line, whatever the rank's message held
    return f"{role}.{method_name} failed on {where}: {type_name}: {message}"


class GroupFuture:
    """The pending result of a non-blocking group call; `get()` collects it, `wait_all` waits on many.
    The call's deadline (its `timeout_s` or the enclosing deadline scope's) counts from when it was sent."""

    def __init__(self, group: WorkerGroup, method_name: str, refs: list, collect, deadline: Deadline | None = None):
        self._group, self._method_name, self.refs, self._collect = group, method_name, refs, collect
        self.deadline = deadline

    def get(self, timeout_s: float | None = None):
        """The collected result; `timeout_s` is one limit for all ranks together, counted from now."""
        return self._get_by(earliest(self.deadline, Deadline.after(timeout_s, f"{timeout_s}s from get()")))

    def _get_by(self, deadline: Deadline | None):
        return self._collect(self._group._gather(self._method_name, self.refs, deadline))


def wait_all(futures: Sequence[GroupFuture], timeout_s: float | None = None) -> list:
    """Collect several non-blocking group calls (of one or more groups) within one shared deadline."""
    shared = Deadline.after(timeout_s, f"{timeout_s}s from wait_all()")
    return [future._get_by(earliest(future.deadline, shared)) for future in futures]


def start_together(groups: Sequence[WorkerGroup]) -> None:
    """Wait for groups built with `wait=False`: each joins its process groups as soon as its rank 0 is up, while
    the others still start (ranks of all groups import and join at once, not one group after another)."""
    for group in groups:
        try:
            group._join()
        except Exception:
            group.shutdown()
            raise
    for group in groups:
        group.wait_started()


class WorkerGroup:
    """The actor group of one role: one `worker_cls` actor per rank. `call(worker_cls.method, *args)` runs a
    `@register`-ed method on every rank by its dispatch mode; `submit` returns a GroupFuture instead of waiting.

    `placement_group`: share one with another role to colocate them (rank r of each role on bundle r);
    by default the group reserves its own, one per TP x CP block so such a block never spans two nodes.

    Health: once a rank died, missed a call's deadline, or raised while other ranks of the call were still
    busy (possibly waiting for it in a collective), the group is broken: its actors are killed (gloo cannot be
    aborted reliably; killing frees the waiting ranks) and every later call fails at once, naming that first
    failure. Build a new WorkerGroup to go on. `settle_s`: how long the other ranks of a call get to finish after
    one rank raised before the group counts as broken. `placement_timeout_s`: how long reserving the ranks'
    resources may wait (a PlacementError after it).
    `fault`: fault injection for tests (distributed/faults.py); None reads ROLL_BACKEND_INJECT_FAULT.
    `wait`: return once every rank is up (False: return at once; `wait_started()`, `start_together` or the first
    call waits).
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        role: str,
        world_size: int,
        layout: ParallelLayout = ParallelLayout(),
        resources: RankResources = RankResources(),
        placement_group: PlacementGroup | None = None,
        worker_config: Any = None,
        start_timeout_s: float = 300.0,
        placement_timeout_s: float = 120.0,
        settle_s: float = 10.0,
        fault: str | None = None,
        wait: bool = True,
    ):
        layout.dp_size(world_size)  # an impossible layout fails before any actor starts
        self.worker_cls, self.role, self.world_size, self.layout = worker_cls, role, world_size, layout
        self.settle_s = settle_s
        self.broken: DispatchError | None = None
        self.coords: list[RankCoords] = []
        block = layout.tp * layout.cp
        self._bundles: RankPlacement = (
            reserve_rank_bundles(world_size, block, resources.num_cpus, resources.num_gpus, placement_timeout_s)
            if placement_group is None
            else shared_rank_bundles(placement_group, world_size, block, role)
        )
        rank_env = {} if resources.use_gpu else cpu_rank_env()  # merged into the job's runtime_env by Ray
        self._pool = rank_pool.pool_for(worker_cls, resources.num_cpus, resources.num_gpus)
        self._pool_key = tuple(sorted(rank_env.items()))
        reused = self._pool.take(self._pool_key, world_size, worker_cls) if self._pool is not None else []
        ranks_args = [
            (worker_cls, role, rank, world_size, layout, resources.use_gpu, worker_config, fault)
            for rank in range(world_size)
        ]
        self._reinits = [worker.reinit_rank.remote(*args) for worker, args in zip(reused, ranks_args)]
        host_cls = ray.remote(RankHost)
        self.workers = reused + [
            host_cls.options(
                runtime_env={"env_vars": rank_env} if rank_env else None,
                **self._placement(rank, resources),
            ).remote(*ranks_args[rank])
            for rank in range(len(reused), world_size)
        ]
        self._start_deadline = earliest(
            call_deadline(None), Deadline.after(start_timeout_s, f"start-up ({start_timeout_s:g}s)")
        )
        self._rendezvous, self._joining = self._send(self.workers[0], "rendezvous_address", (), {}), None
        if wait:
            self.wait_started()

    def _placement(self, rank: int, resources: RankResources) -> dict:
        """A new rank's resources and where it runs: its bundle; a pooled process (which outlives the group's
        placement group) takes no resources of its own, the group's bundles count them."""
        if self._pool is not None:
            return {"num_cpus": 0, "num_gpus": 0}
        return {
            "num_cpus": resources.num_cpus,
            "num_gpus": resources.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(*self._bundles.bundles[rank]),
        }

    def wait_started(self) -> WorkerGroup:
        """Wait until every rank is up and has joined the group's process groups (at once when it already has).
        A group built with `wait=False` starts its ranks in the background, so several groups start together
        (`start_together`)."""
        if self.coords:
            return self
        try:
            self._join()
            self.coords = self._gather("init_distributed", self._joining, self._start_deadline)
        except Exception:
            self.shutdown()
            raise
        return self

    def _join(self) -> None:
        """Once rank 0 is up, send every rank the rendezvous address to join the process groups (no waiting)."""
        if self._joining is None:
            if self._reinits:  # pooled processes become this group's ranks first
                self._gather("reinit_rank", self._reinits, self._start_deadline)
                self._reinits = []
            master_addr, master_port = self._gather("rendezvous_address", [self._rendezvous], self._start_deadline)[0]
            self._joining = [self._send(w, "init_distributed", (master_addr, master_port), {}) for w in self.workers]

    def call(self, method, *args, timeout_s: float | None = None, **kwargs):
        """Run `method` (a `@register`-ed method of this group's worker class, e.g. `ActorWorker.train_step`) on
        every rank and collect the results by its dispatch mode; a method registered with `blocking=False` gives
        a GroupFuture instead. `timeout_s`: one deadline for the whole call (every rank), on top of any deadline
        scope."""
        future = self.submit(method, *args, timeout_s=timeout_s, **kwargs)
        return future.get() if method_dispatch(method).blocking else future

    def submit(self, method, *args, timeout_s: float | None = None, **kwargs) -> GroupFuture:
        """As `call`, without waiting: the GroupFuture's `get()` collects (see also `wait_all`)."""
        spec = self._registered(method)
        return self._submit(method.__name__, spec, args, kwargs, call_deadline(timeout_s))

    def _registered(self, method) -> MethodDispatch:
        spec = method_dispatch(method)
        name = getattr(method, "__name__", repr(method))
        if spec is None:
            raise TypeError(f"{self.role}: {name} is not a @register-ed worker method; tag it with @register(mode)")
        owner = method.__qualname__.rpartition(".")[0]
        if owner not in {cls.__qualname__ for cls in self.worker_cls.__mro__}:
            raise TypeError(
                f"{self.role}: {method.__qualname__} is not a method of this group's worker {self.worker_cls.__name__}"
            )
        return spec

    def _submit(
        self, method_name: str, spec: MethodDispatch, args: tuple, kwargs: dict, deadline: Deadline | None
    ) -> GroupFuture:
        self._check_usable(method_name)
        self.wait_started()  # a group built with wait=False: its first call waits for its ranks
        try:
            split = spec.mode.split(self.coords, args, kwargs)
        except DispatchError:
            raise
        except Exception as exc:
            raise DispatchError(
                f"{self.role}.{method_name}: cannot split arguments for {spec.mode.name}: {exc}"
            ) from exc
        refs = [
            self._send(worker, method_name, rank_args, rank_kwargs)
            for worker, (rank_args, rank_kwargs) in zip(self.workers, split.per_rank)
        ]
        collect = functools.partial(spec.mode.collect, self.coords, context=split.context)
        return GroupFuture(self, method_name, refs, collect, deadline)

    def _send(self, worker, method_name: str, args: tuple, kwargs: dict):
        return worker.call.remote(method_name, args, kwargs)

    def facet(self, role: str, worker_cls: type[Worker], coords: Sequence[RankCoords] | None = None) -> FacetGroup:
        """Role `role` hosted in this group's actors (the hybrid engine, workers/hybrid.py): a group whose calls run
        `worker_cls` methods on that role's facet of each rank, dispatched by `coords` (default: this group's)."""
        return FacetGroup(self, role, worker_cls, coords)

    def _check_usable(self, method_name: str) -> None:
        if self.broken is not None:
            raise GroupBrokenError(
                f"{self.role}.{method_name}: the group is broken since an earlier call failed ({self.broken}); "
                f"its ranks were stopped. Shut it down and build it again",
                self.broken,
            )

    def _where(self, rank: int) -> str:
        """A rank with its parallel coordinates when known: `rank 1/4, dp=0 tp=1 pp=0 cp=0`."""
        coords = getattr(self, "coords", None) or []  # unset while init_distributed itself runs
        return coords[rank].describe() if rank < len(coords) else f"rank {rank}/{self.world_size}"

    def _ranks(self, ranks: Sequence[int]) -> str:
        return " ".join(f"[{self._where(rank)}]" for rank in ranks)

    def _gather(self, method_name: str, refs: list, deadline: Deadline | None = None) -> list:
        """Results of every rank. A dead rank, a missed deadline or a rank's exception fails the call at once
        with the ranks involved; the first two (and an exception that leaves others busy) break the group."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            wait_s = None if deadline is None else deadline.remaining()
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                self._break(
                    GroupTimeoutError(
                        f"{self.role}.{method_name}: no answer from {self._ranks(sorted(rank_of[r] for r in pending))} "
                        f"within {deadline.describe()}"
                    )
                )
            try:
                ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, UserCodeError):  # the user's code failed, not the group: say only that
                    raise UserCodeError(f"{self.role}.{method_name}: {exc.cause}") from exc
                rank = rank_of[ready[0]]
                logger.error(
                    "%s.%s failed on rank %d; the rank's traceback:\n%s",
                    self.role,
                    method_name,
                    rank,
                    strip_ansi(str(exc)),
                )
                failure = RankRaisedError(
                    rank_failure_line(self.role, method_name, self._where(rank), exc),
                    restartable=not isinstance(exc, NotRestartableError),
                )
                if not pending:
                    raise failure from exc
                settled, still_pending = self._settle(pending, deadline)
                # A peer that died is the cause of a rank's collective error (connection reset): name the death.
                for ref in settled:
                    if (died := self._died(method_name, ref, rank_of[ref])) is not None:
                        self._break(died, cause=died.__cause__)
                if still_pending:
                    self._break(failure, cause=exc)
                raise failure from exc
            except ray.exceptions.RayActorError:
                died = self._died(method_name, ready[0], rank_of[ready[0]])
                self._break(died, cause=died.__cause__)
        return ray.get(refs)

    def _died(self, method_name: str, ref, rank: int) -> RankDiedError | None:
        """The rank's death as a RankDiedError when `ref` (settled) failed because its actor went away, else None."""
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else ""
            died = RankDiedError(
                f"{self.role}.{method_name}: the actor of {self._ranks([rank])} died ({type(exc).__name__}: {reason})"
            )
            died.__cause__ = exc
            return died
        except ray.exceptions.RayError:
            return None
        return None

    def _settle(self, pending: list, deadline: Deadline | None) -> tuple[list, list]:
        """After one rank raised: the others of the call that finish (return, raise or die) within `settle_s`, and
        those that do not (likely waiting for the failed rank in a collective)."""
        settle_s = self.settle_s if deadline is None else min(self.settle_s, deadline.remaining())
        return ray.wait(pending, num_returns=len(pending), timeout=settle_s)

    def _break(self, failure: DispatchError, cause: BaseException | None = None):
        """Mark the group broken, stop its ranks, raise `failure`."""
        self.broken = failure
        logger.error("%s group broken: %s; stopping its %d ranks", self.role, failure, len(self.workers))
        self._kill_workers()
        raise failure from cause

    def _kill_workers(self) -> None:
        for worker in getattr(self, "workers", []):
            try:
                ray.kill(worker, no_restart=True)
            except Exception as exc:  # an actor of a removed node may be unreachable: nothing left to stop
                logger.warning("%s: could not kill an actor: %s", self.role, exc)
        self.workers = []

    def shutdown(self) -> None:
        """Stop every rank's actor (with the rank pool on, a healthy group's go back to it: rank_pool.py) and release
        the placement groups this group reserved."""
        if getattr(self, "_pool", None) is not None and self.broken is None and self.workers:
            workers, self.workers = self.workers, []
            self._pool.give_back(self._pool_key, workers, self.worker_cls)
        self._kill_workers()
        if getattr(self, "_bundles", None) is not None:
            self._bundles.release()


class FacetGroup(WorkerGroup):
    """One role of a hybrid group (see WorkerGroup.facet): the host's actors, health and deadlines, this role's worker
    class and coordinates. Breaking it breaks the host (one process per rank serves every facet); shutting it down
    shuts the host down."""

    def __init__(self, host: WorkerGroup, role: str, worker_cls: type[Worker], coords: Sequence[RankCoords] | None):
        self.host, self.role, self.worker_cls = host, role, worker_cls
        self.world_size, self.layout, self.settle_s = host.world_size, host.layout, host.settle_s
        self._own_coords = None if coords is None else list(coords)

    @property
    def coords(self) -> list[RankCoords]:
        return self._own_coords if self._own_coords is not None else self.host.coords

    @property
    def workers(self) -> list:
        return self.host.workers

    @workers.setter
    def workers(self, value: list) -> None:
        self.host.workers = value

    @property
    def broken(self) -> DispatchError | None:
        return self.host.broken

    @broken.setter
    def broken(self, value: DispatchError | None) -> None:
        self.host.broken = value

    def wait_started(self) -> FacetGroup:
        self.host.wait_started()
        return self

    def _send(self, worker, method_name: str, args: tuple, kwargs: dict):
        return worker.call.remote("facet_call", (self.role, method_name, args, kwargs), {})

    def shutdown(self) -> None:
        self.host.shutdown()
