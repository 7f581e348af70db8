"""`HybridWorker`: the hybrid engine. One Ray actor per rank hosts actor_train's trainer and, as facets sharing its
process, the rollout engine and optionally the reference and the critic: each facet is its role's own worker class
(ActorWorker, RolloutWorker, ...), so every role method runs as it does in a role of its own. The device goes in turn
to the engine (generation) and to the Megatron models (log-probs, values, training): before a facet's call the engine
sleeps or wakes and the models' state moves to host memory or back (`DeviceHandover`); weights go from trainer to
engine inside the process (`sync_engine_weights`), with the engine's TP groups over the same ranks as the trainer's.

The driver reaches a facet through `WorkerGroup.facet` (distributed/worker_group.py): its calls arrive here as
`facet_call(role, method, ...)`, dispatched by the facet's own coordinates (the engine's TP-only grid for the
rollout, the trainer's Megatron grid for the others).
"""

from __future__ import annotations

import functools
import logging
import resource
from dataclasses import dataclass
from typing import Any

import torch

from roll_backend import roles
from roll_backend.distributed import parallel
from roll_backend.distributed.dispatch import Dispatch, method_dispatch, register
from roll_backend.distributed.faults import perturb_first_tensor, perturb_whole_tensor
from roll_backend.distributed.layout import ParallelLayout, RankCoords
from roll_backend.distributed.worker import Worker
from roll_backend.errors import WeightSyncFailed

logger = logging.getLogger(__name__)

ALL_PARTS = frozenset({"params", "grads", "optimizer"})
# The phase whose memory a facet call reports: the step phase of the call's role and deadline (roles.PHASES).
_PHASE_OF = {(phase.role, phase.deadline): name for name, phase in roles.PHASES.items()}
_FULL_STATE_DEADLINES = (roles.TRAIN_DEADLINE, roles.CHECKPOINT)  # calls that need gradients and optimizer state


@dataclass(frozen=True)
class HybridFacet:
    """One role hosted by the hybrid worker: its worker class and config, and its layout (the rollout engine's TP,
    or the trainer's layout for a Megatron role)."""

    role: str
    worker_cls: type
    config: Any
    layout: ParallelLayout

    @property
    def is_engine(self) -> bool:
        return self.role == roles.ACTOR_INFER


@dataclass(frozen=True)
class HybridConfig:
    """What a HybridWorker hosts: actor_train's facet first, then the rollout engine's, the reference's, the critic's.
    `adapter_sync`: the weight sync sends the trainer's LoRA adapters, which the engine serves. `engine_copy`
    (weight_sync_delta): the engine keeps a host copy of the weights it serves, so a sync loads only the tensors that
    changed, all or nothing, and a sync whose probe fails is undone; without it a sync loads whole tensors in place."""

    facets: tuple[HybridFacet, ...]
    adapter_sync: bool = False
    engine_copy: bool = False
    bucket_bytes: int = 512 << 20  # the trainer gathers this much at a time for the engine


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


class WeightSyncInterrupted(RuntimeError):
    """A weight sync stopped part-way: the engine holds some tensors of the new version and some of the old."""


class WeightSyncUndone(RuntimeError):
    """A weight sync failed while loading and the engine reloaded what it had changed from its host copy: it serves
    the version before the sync again, whole."""


class DeviceHandover:
    """Who holds the device now: the engine (its weights and KV cache awake), or the Megatron models, each with the
    parts of its state on the device that its calls need. Every move is idempotent: asking for the current holder
    moves nothing. `load(version, whole)` puts the trainer's weights into the engine (the worker's in-process sync;
    `whole`: every tensor, the engine's own no longer being what it served)."""

    def __init__(self, rollout, models: dict[str, Any], trainer_role: str, load, on_device=None):
        self.rollout, self.models, self.trainer_role, self.load = rollout, models, trainer_role, load
        self.awake = {"weights": True, "kv_cache": True}
        self.engine_weights_valid = True  # False after a level-2 sleep or a sync that stopped part-way
        # the parts of each model's state on the device now (all of them, unless given)
        self.on_device = dict(on_device) if on_device is not None else {role: ALL_PARTS for role in models}
        self.moved_bytes = 0

    def _move(self, role: str, parts: frozenset[str], to_host: bool) -> None:
        model = self.models[role]
        now = self.on_device[role]
        chosen = (parts & now) if to_host else (parts - now)
        if chosen:
            self.moved_bytes += model.move_model_state(chosen, to_host)
            self.on_device[role] = (now - chosen) if to_host else (now | chosen)

    def _release_models(self, keep: str | None = None) -> None:
        for role, model in self.models.items():
            if role != keep:
                self._move(role, model.offloaded_parts, to_host=True)

    def _wake(self, *tags: str) -> None:
        asleep = tuple(tag for tag in tags if not self.awake[tag])
        if asleep:
            self.rollout.wake_up(asleep if len(asleep) < len(self.awake) else None)
            self.awake |= dict.fromkeys(asleep, True)

    def for_engine(self) -> None:
        """Generation: every model's offloaded parts to the host, the engine awake with valid weights (refilled from
        the trainer first where they are not)."""
        self._release_models()
        if not self.engine_weights_valid:
            self.sync()
        self._wake("weights", "kv_cache")

    def for_model(self, role: str, parts: frozenset[str]) -> None:
        """A Megatron model's call: the engine asleep, the other models' offloaded parts on the host, `parts` of this
        one's state on the device."""
        if any(self.awake.values()):
            self.engine_weights_valid &= self.rollout.sleep()  # (False: level 2 discarded the weights)
            self.awake = dict.fromkeys(self.awake, False)
        self._release_models(keep=role)
        self._move(role, parts, to_host=False)

    def sync(self, version: int | None = None, whole: bool = False) -> dict[str, float]:
        """The trainer's weights into the engine: the trainer's parameters on the device (its gradients and optimizer
        state need not be), the engine's weights awake and its KV cache still asleep; then the KV cache back. A load
        that fails part-way leaves the engine marked as holding mixed weights, refilled before it generates again,
        unless the engine undid it (WeightSyncUndone: it serves its version again)."""
        self._release_models(keep=self.trainer_role)
        self._move(self.trainer_role, self.models[self.trainer_role].offloaded_parts - {"params"}, to_host=True)
        self._move(self.trainer_role, frozenset({"params"}), to_host=False)
        self._wake("weights")
        try:
            loaded = self.load(version, whole or not self.engine_weights_valid)
        except WeightSyncUndone:
            self.engine_weights_valid = True
            raise
        except Exception as exc:
            self.engine_weights_valid = False
            raise WeightSyncInterrupted(
                f"the weight sync into the engine stopped part-way ({type(exc).__name__}: {exc}); the engine's weights "
                "are mixed, and it refills them from the trainer before it generates again"
            ) from exc
        self.engine_weights_valid = True
        self._wake("kv_cache")
        self._release_models()
        return loaded


class HybridWorker(Worker):
    """One rank of the hybrid engine (see the module docstring). Call `init_model` once after the group starts."""

    poolable = True

    def __init__(self, role, rank, world_size, layout, use_gpu, config: HybridConfig, fault=None):
        super().__init__(role, rank, world_size, layout, use_gpu, config, fault)
        self.facets = {
            facet.role: facet.worker_cls(
                facet.role, rank, world_size, facet.layout, use_gpu, facet.config, fault, host=self
            )
            for facet in config.facets
        }
        self.handover: DeviceHandover | None = None
        self.memory: dict[str, dict[str, float]] = {}  # phase -> its memory figures, since the last report
        self.measuring_sync = False  # the sync in progress counts its gathers (sync_engine_weights)

    def init_distributed(self, master_addr: str, master_port: int) -> RankCoords:
        coords = super().init_distributed(master_addr, master_port)
        for facet in self.config.facets:
            if facet.is_engine:  # vLLM lays its TP groups over consecutive ranks of the same world
                self.facets[facet.role].coords = parallel.tp_only_coords(self.rank, self.world_size, facet.layout.tp)
            else:
                self.facets[facet.role].coords = coords
        return coords

    def release_role(self) -> bool:
        """Every facet's own tear-down, the engine's first (its process groups are the trainer's world); not
        reusable where a facet's strategy failed to start (start_strategy)."""
        self.handover = None
        facets = sorted(self.facets.values(), key=lambda facet: facet.role != roles.ACTOR_INFER)
        released = [facet.release_role() for facet in facets]
        return all(released) and all(facet.poolable for facet in facets)

    @register(Dispatch.ONE_TO_ALL)
    def facet_coords(self) -> dict[str, RankCoords]:
        """Each facet's coordinates on this rank (the driver dispatches a facet's calls by them)."""
        return {role: facet.coords for role, facet in self.facets.items()}

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the Megatron models, move their offloaded state to the host, then start the engine (which sizes its
        cache by the device memory left), holding the device."""
        engine_role = roles.ACTOR_INFER
        models = {}
        for role, facet in self.facets.items():
            if role != engine_role:
                facet.init_model()
                models[role] = facet.strategy
        for model in models.values():
            model.move_model_state(model.offloaded_parts, to_host=True)
        self.facets[engine_role].init_model()
        rollout = self.facets[engine_role].strategy
        on_device = {role: ALL_PARTS - model.offloaded_parts for role, model in models.items()}
        self.handover = DeviceHandover(rollout, models, roles.ACTOR_TRAIN, self._load_into_engine, on_device)
        if self.device == "cpu":
            _say_once(
                "hybrid engine on CPU: vLLM has no sleep mode there (the engine keeps its weights and KV cache), and "
                "the models' offloaded state is copied within host memory (the moves run, nothing is freed overall)"
            )

    def facet_call(self, role: str, method_name: str, args: tuple, kwargs: dict):
        """Run `method_name` of role `role`'s facet on this rank, the device handed to what it uses first."""
        facet = self.facets[role]
        how = method_dispatch(getattr(type(facet), method_name))
        deadline = how.deadline if how is not None else None
        if self.handover is not None and method_name not in ("init_model", "measured_memory"):
            if role == roles.ACTOR_INFER:
                self.handover.for_engine()
            else:
                parts = ALL_PARTS if deadline in _FULL_STATE_DEADLINES else frozenset({"params"})
                self.handover.for_model(role, parts)
        result = getattr(facet, method_name)(*args, **kwargs)
        phase = _PHASE_OF.get((role, deadline))
        if phase is not None:
            self.memory[phase] = self._memory_now()
        return result

    # ---- weights, trainer -> engine, in the process ----------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL, deadline=roles.WEIGHT_SYNC_DEADLINE)
    def sync_engine_weights(
        self, version: int | None = None, whole: bool = False, measure_memory: bool = False
    ) -> dict[str, float]:
        """The trainer's weights (or LoRA adapters) into this rank's engine, bucket by bucket, with no copy through
        the object store: the trainer gathers full HF tensors over its TP/PP groups, the engine takes its TP shard
        of each; with the engine's host copy (HybridConfig.engine_copy) only the tensors that changed, all or
        nothing, unless `whole`. Returns {"tensors", "bytes"} (and a minimal sync's other counts). `measure_memory`:
        the trainer's gathers count as its weight_sync phase on a CPU rank too (measured_memory)."""
        self.measuring_sync = measure_memory
        try:
            loaded = self.handover.sync(version, whole)
        finally:
            self.measuring_sync = False
        self.memory[roles.WEIGHT_SYNC] = self._memory_now()
        return loaded

    def _load_into_engine(self, version: int | None, whole: bool = False) -> dict[str, float]:
        """The trainer's adapters or weights into the engine (the handover's `load`); `whole`: the engine's own weights
        are not what it served (a level-2 sleep, a sync stopped part-way), so every tensor loads."""
        if self.config.adapter_sync:
            return self._load_adapters(version)
        if self.config.engine_copy:
            return self._load_changed(version, whole)
        rollout = self.facets[roles.ACTOR_INFER].strategy
        loaded = size = 0
        for bucket in self._gathered_buckets():
            size += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            if self._engine_bucket_perturbed():
                bucket = list(perturb_first_tensor(dict(bucket)).items())
            loaded += rollout.update_weights(bucket, version=version)
        return {"tensors": float(loaded), "bytes": float(size)}

    def _load_adapters(self, version: int | None) -> dict[str, float]:
        trainer = self.facets[roles.ACTOR_TRAIN].strategy
        with self.facets[roles.ACTOR_TRAIN].call_context():
            tensors = trainer.adapter_tensors("sync_engine_weights")  # (rank 0 gathers them)
            peft_config = trainer.peft_config()
        tensors = _from_rank_zero(tensors)  # every engine rank serves the whole adapter
        if self._engine_bucket_perturbed():
            tensors = perturb_first_tensor(tensors)
        loaded = self.facets[roles.ACTOR_INFER].strategy.load_adapter(tensors, peft_config, version=version)
        return {"tensors": float(loaded), "bytes": float(sum(t.numel() * t.element_size() for t in tensors.values()))}

    def _load_changed(self, version: int | None, whole: bool) -> dict[str, float]:
        """The tensors that differ from the engine's host copy of what it serves (every one when `whole`), all or
        nothing (VllmRolloutStrategy.load_changed_weights): every bucket gathered and compared before the engine
        loads any; a load that fails part-way reloads what it changed from the copy (WeightSyncUndone), and a sync
        whose probe fails is undone by `revert_weights`. Counts as a minimal sync's ("bytes": those loaded)."""
        engine = self.facets[roles.ACTOR_INFER]
        perturb = [False]

        def on_bucket(bucket) -> None:  # fault injection's perturb, as a rollout rank of its own takes it
            perturb[0] |= self._engine_bucket_perturbed()
            perturb[0] = perturb[0] and not perturb_whole_tensor(bucket)

        try:
            counts = engine.strategy.load_changed_weights(
                self._gathered_buckets(),
                version=version,
                whole=whole,
                on_bucket=on_bucket,
                after_bucket=lambda: engine.fault_point(roles.ENGINE_LOAD_BUCKET),
                all_loaded=lambda loaded: parallel.every_rank_agrees(loaded, self.device),
            )
        except WeightSyncFailed as exc:
            if exc.restored:
                raise WeightSyncUndone(str(exc)) from exc
            raise
        return {name: float(value) for name, value in counts.items()}

    def _gathered_buckets(self):
        """The trainer's weights as full HF tensors over its TP/PP groups, a bucket at a time: each gather in the
        trainer's call context (what runs between them, in the engine's)."""
        trainer_context = self.facets[roles.ACTOR_TRAIN].call_context
        with trainer_context():
            trainer = self.facets[roles.ACTOR_TRAIN].strategy
            buckets = iter(trainer.iter_hf_weights(self.config.bucket_bytes, self.measuring_sync))
        while True:
            with trainer_context():
                bucket = next(buckets, None)
            if bucket is None:
                return
            yield bucket

    def _engine_bucket_perturbed(self) -> bool:
        """Fault injection's perturb at the engine facet's weight_sync_bucket point (as a rollout rank of its own
        takes it): the bucket's first tensor arrives off by 0.5, a silent error only the probe sees."""
        return self.facets[roles.ACTOR_INFER].fault_point(roles.WEIGHT_SYNC_BUCKET)

    # ---- memory -----------------------------------------------------------------------------------------------
    def _memory_now(self) -> dict[str, float]:
        """Device memory (torch's allocator on a GPU; on CPU the model state the models hold on the device, by
        tensor accounting) and the process's resident host memory, in GiB."""
        if self.device == "cuda":
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        else:
            allocated = reserved = sum(
                sum(model.model_state_bytes().values()) for model in self.handover.models.values()
            )
        import psutil

        return {
            "allocated_gib": allocated / 2**30,
            "reserved_gib": reserved / 2**30,
            "host_gib": psutil.Process().memory_info().rss / 2**30,
        }

    @register(Dispatch.ONE_TO_ALL)
    def memory_by_phase(self) -> dict[str, float]:
        """`memory/<phase>/<figure>` after each phase since the last call, and the bytes the hand-over moved; then
        starts over."""
        out = {
            f"memory/{phase}/{name}": value for phase, figures in self.memory.items() for name, value in figures.items()
        }
        out["memory/handover_gib"] = self.handover.moved_bytes / 2**30
        out["memory/peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        self.memory, self.handover.moved_bytes = {}, 0
        return out


def _from_rank_zero(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Global rank 0's tensors on every rank of the world (small: LoRA adapters)."""
    import torch.distributed as dist

    box = [tensors]
    dist.broadcast_object_list(box, src=0)
    return box[0]
