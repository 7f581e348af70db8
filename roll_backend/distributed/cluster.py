"""`Cluster`: one Ray actor per rank of a role, on a placement group, exposing the role's registered
methods as group methods (split by the method's dispatch mode, sent, collected)."""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll_backend.distributed.dispatch import DispatchError, MethodDispatch, method_dispatch
from roll_backend.distributed.parallel import ParallelLayout, RankCoords
from roll_backend.distributed.ray_env import cpu_rank_env
from roll_backend.distributed.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankResources:
    """What one rank of a role takes from its placement-group bundle: a GPU on a cluster, a CPU share here."""

    num_cpus: float = 0.5
    num_gpus: float = 0.0

    @property
    def use_gpu(self) -> bool:
        return self.num_gpus > 0


def create_placement_group(num_bundles: int, cpus_per_bundle: float, gpus_per_bundle: float = 0.0, timeout_s: float = 120.0) -> PlacementGroup:
    """Reserve `num_bundles` bundles (one per rank). Roles that share a group are colocated rank by rank."""
    bundle = {"CPU": cpus_per_bundle} | ({"GPU": gpus_per_bundle} if gpus_per_bundle else {})
    group = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise DispatchError(
            f"could not reserve {num_bundles} bundles of {bundle} within {timeout_s:.0f}s; "
            f"the cluster has {ray.available_resources()} free. Lower the role's world size or resources."
        )
    return group


class GroupFuture:
    """The pending result of a non-blocking group call; `get()` collects it, `wait_all` waits on many."""

    def __init__(self, cluster: "Cluster", method_name: str, refs: list, collect):
        self._cluster, self._method_name, self.refs, self._collect = cluster, method_name, refs, collect

    def get(self, timeout_s: float | None = None):
        return self._collect(self._cluster._gather(self._method_name, self.refs, timeout_s))


def wait_all(futures: Sequence[GroupFuture], timeout_s: float | None = None) -> list:
    """Wait for several non-blocking group calls (of one or more clusters) and collect each."""
    ray.wait([ref for future in futures for ref in future.refs], num_returns=sum(len(f.refs) for f in futures), timeout=timeout_s)
    return [future.get(timeout_s) for future in futures]


class GroupMethod:
    """A worker method as seen from the driver: calling it splits, sends and collects per its mode;
    `submit` always returns a GroupFuture (whatever `blocking` the method was registered with)."""

    def __init__(self, cluster: "Cluster", name: str, spec: MethodDispatch, method):
        self._cluster, self._name, self.spec = cluster, name, spec
        functools.update_wrapper(self, method)

    def submit(self, *args, **kwargs) -> GroupFuture:
        return self._cluster._submit(self._name, self.spec, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        future = self.submit(*args, **kwargs)
        return future.get() if self.spec.blocking else future


class Cluster:
    """An actor group for one role. Each `@register`-ed method of `worker_cls` becomes a method here.

    `placement_group`: share one with another role to colocate them (rank r of each role on bundle r);
    by default the cluster reserves its own.
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
    ):
        layout.dp_size(world_size)  # an impossible layout fails before any actor starts
        self.role, self.world_size, self.layout = role, world_size, layout
        self._owns_placement_group = placement_group is None
        self.placement_group = placement_group or create_placement_group(world_size, resources.num_cpus, resources.num_gpus)
        if self.placement_group.bundle_count < world_size:
            raise DispatchError(f"{role}: placement group has {self.placement_group.bundle_count} bundles, world_size={world_size} needs one per rank")
        actor_cls = ray.remote(worker_cls)
        rank_env = {} if resources.use_gpu else cpu_rank_env()  # merged into the job's runtime_env by Ray
        self.workers = [
            actor_cls.options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                runtime_env={"env_vars": rank_env} if rank_env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank),
            ).remote(role, rank, world_size, layout, resources.use_gpu, worker_config)
            for rank in range(world_size)
        ]
        try:
            master_addr, master_port = self._gather("rendezvous_address", [self.workers[0].rendezvous_address.remote()], start_timeout_s)[0]
            self.coords: list[RankCoords] = self._gather(
                "init_distributed", [w.init_distributed.remote(master_addr, master_port) for w in self.workers], start_timeout_s
            )
        except Exception:
            self.shutdown()
            raise
        self._bind_registered_methods(worker_cls)

    def _bind_registered_methods(self, worker_cls: type[Worker]) -> None:
        for name, method in inspect.getmembers(worker_cls, predicate=callable):
            spec = method_dispatch(method)
            if spec is not None:
                setattr(self, name, GroupMethod(self, name, spec, method))

    def _submit(self, method_name: str, spec: MethodDispatch, *args, **kwargs) -> GroupFuture:
        try:
            split = spec.mode.split(self.coords, args, kwargs)
        except DispatchError:
            raise
        except Exception as exc:
            raise DispatchError(f"{self.role}.{method_name}: cannot split arguments for {spec.mode.name}: {exc}") from exc
        refs = [
            getattr(worker, method_name).remote(*rank_args, **rank_kwargs)
            for worker, (rank_args, rank_kwargs) in zip(self.workers, split.per_rank)
        ]
        collect = functools.partial(spec.mode.collect, self.coords, context=split.context)
        return GroupFuture(self, method_name, refs, collect)

    def _gather(self, method_name: str, refs: list, timeout_s: float | None = None) -> list:
        """Results of every rank; the first error (or dead actor) fails the call at once, with its rank."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                raise DispatchError(f"{self.role}.{method_name}: no result from ranks {[rank_of[r] for r in pending]} within {timeout_s}s")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                raise DispatchError(f"{self.role}.{method_name} failed on rank {rank_of[ready[0]]}: {exc}") from exc
            except ray.exceptions.RayActorError as exc:
                raise DispatchError(
                    f"{self.role}.{method_name}: the actor of rank {rank_of[ready[0]]} died ({type(exc).__name__}); "
                    f"shut the group down and build it again"
                ) from exc
        return ray.get(refs)

    def execute_all(self, method_name: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Call a plain (unregistered) Worker method on every rank with the same arguments."""
        return self._gather(method_name, [getattr(w, method_name).remote(*args, **kwargs) for w in self.workers], timeout_s)

    def shutdown(self) -> None:
        """Kill every rank's actor and release the placement group if this cluster reserved it."""
        for worker in getattr(self, "workers", []):
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._owns_placement_group and getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
