"""The rollout role: each rank hosts a rollout strategy (vLLM) that generates, takes new weights, probes log-probs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from roll_backend import keys, roles
from roll_backend.distributed import parallel
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.faults import perturb_first_tensor, perturb_whole_tensor
from roll_backend.distributed.worker import Worker
from roll_backend.protocol import DataProto
from roll_backend.workers.strategy_host import start_strategy, strategy_call_context


@dataclass(frozen=True)
class RolloutWorkerConfig:
    """The `actor_infer` role section: which rollout strategy, with its typed settings."""

    strategy: Any  # the strategy's config class, e.g. VllmRolloutConfig
    strategy_name: str = "vllm_rollout"
    agentic: Any = None  # roll_backend.agentic.config.AgenticConfig: generate runs multi-turn trajectories


class RolloutWorker(Worker):
    """One rank of the rollout role. Call `init_model` once after the group is built. Every rank of a TP group
    gets the whole batch from the controller (DP_MP_COMPUTE): the engine, not an in-actor broadcast, shards it."""

    megatron_grid = False  # (the engine lays out its own groups over the process group)
    poolable = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.config, RolloutWorkerConfig):
            raise TypeError(
                f"RolloutWorker takes a RolloutWorkerConfig as worker_config, got {type(self.config).__name__}"
            )
        self.strategy = None
        self.agentic = None  # the multi-turn rollout driving the strategy, with config.agentic

    def call_context(self):
        return strategy_call_context(self.config.strategy_name, self.device)

    def release_role(self) -> bool:
        """Reusable once the environments' workers and the engine stopped (an agentic rollout's user code runs in its
        workers, not here)."""
        if self.agentic is not None:
            self.agentic.close()
            self.agentic = None
        strategy, self.strategy = self.strategy, None
        return strategy is None or strategy.shutdown()

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Start the engine on every rank (after the rank joined its process group)."""
        strategy_config = self.config.strategy
        if self.coords is not None and self.coords.dp and hasattr(strategy_config, "seed"):
            # DP ranks sample different streams; the ranks of one TP group must share a seed.
            strategy_config = dataclasses.replace(strategy_config, seed=strategy_config.seed + self.coords.dp)
        self.strategy = start_strategy(self, self.config.strategy_name, strategy_config)
        self.set_agentic(self.config.agentic)

    @register(Dispatch.ONE_TO_ALL)
    def set_agentic(self, agentic) -> None:
        """Generate multi-turn trajectories with this AgenticConfig from now on (None: single-turn samples); e.g. a
        driver script validating on another environment. The previous environments' workers are shut down."""
        from roll_backend.agentic.multi_turn import AgenticRollout

        if self.agentic is not None:
            self.agentic.close()
            self.agentic = None
        if agentic is not None:
            strategy = self._strategy()
            self.agentic = AgenticRollout(
                strategy,
                strategy.tokenizer,
                agentic,
                max_model_len=strategy.max_model_len,
                prompt_width=strategy.max_prompt_length,
            )

    @register(Dispatch.DP_MP_COMPUTE, deadline=roles.GENERATION_DEADLINE)
    def generate(self, batch: DataProto) -> DataProto:
        """Prompts -> n responses each, with log-probs, masks and uids (see VllmRolloutStrategy.generate); with
        `agentic`, n multi-turn trajectories each (roll_backend.agentic.multi_turn)."""
        if self.agentic is not None:
            sampling = self._strategy().sampling_for(batch.meta_info)
            return self.agentic.generate(batch, sampling.n, sampling.max_tokens, sampling.temperature)
        return self._strategy().generate(batch)

    def __del__(self):
        if getattr(self, "agentic", None) is not None:
            self.agentic.close()

    @register(Dispatch.ONE_TO_ALL)
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        in_flight: str | None = None,
    ) -> int:
        """Load HF-named tensors into every rank's engine; returns how many tensors were loaded. `version` and
        `in_flight` as for `load_weight_buckets`."""
        return self._strategy().update_weights(named_tensors, version=version, in_flight=in_flight)

    @register(Dispatch.ONE_TO_ALL, deadline=roles.WEIGHT_SYNC_DEADLINE)
    def load_weight_buckets(
        self, bucket_refs: list, version: int | None = None, in_flight: str | None = None
    ) -> dict[str, int]:
        """Load buckets the trainer published (ActorWorker.publish_hf_weights), fetching one bucket at a
        time so a rank never holds more than one bucket beyond the engine's own weights. `version`: the trainer
        version they are; `in_flight` (streaming): keep | recompute | resubmit the requests in flight. Returns
        {"tensors": how many were loaded, "bytes": their size}."""
        import ray

        size = [0]

        def named():
            for ref in bucket_refs:
                for name, tensor in ray.get(ref):
                    size[0] += tensor.numel() * tensor.element_size()
                    yield name, tensor

        loaded = self._strategy().update_weights(named(), version=version, in_flight=in_flight)
        return {"tensors": loaded, "bytes": size[0]}

    @register(Dispatch.ONE_TO_ALL, deadline=roles.WEIGHT_SYNC_DEADLINE)
    def load_weight_deltas(
        self, bucket_refs: list, version: int | None = None, in_flight: str | None = None
    ) -> dict[str, int]:
        """A minimal sync the trainer published (ActorWorker.publish_weight_deltas): the engine serves its version
        until every bucket has landed and been checked, then switches; a failure part-way leaves it on its version
        (VllmRolloutStrategy.load_weight_deltas). Returns the counts: "bytes" received, "full_bytes" (a full sync's),
        "tensors" sent, "unchanged", "loaded" into the engine, and "version" now served."""
        import ray

        def landed():
            perturb = False
            for ref in bucket_refs:
                bucket = ray.get(ref)
                perturb |= self.fault_point(roles.WEIGHT_SYNC_BUCKET)  # (fault injection's perturb: a silent error)
                perturb = perturb and not perturb_whole_tensor(bucket)
                yield bucket

        counts = self._strategy().load_weight_deltas(
            landed(),
            version=version,
            in_flight=in_flight,
            after_bucket=lambda: self.fault_point(roles.ENGINE_LOAD_BUCKET),
            all_loaded=lambda loaded: parallel.every_rank_agrees(loaded, self.device),  # every engine or none
        )
        return counts | {"version": version}

    @register(Dispatch.ONE_TO_ALL, deadline=roles.WEIGHT_SYNC_DEADLINE)
    def revert_weights(self) -> int | None:
        """Undo the last minimal sync, whose probe failed: the engine serves the version before it again; returns
        that version (VllmRolloutStrategy.revert_weights)."""
        return self._strategy().revert_weights()

    @register(Dispatch.ONE_TO_ALL)
    def weights_version(self) -> int | None:
        """The version a minimal sync may be relative to (None: the next must send whole tensors)."""
        return self._strategy().weights_version

    @register(Dispatch.ONE_TO_ALL)
    def measured_memory(self) -> dict:
        """What this rank's engine holds: its weights and KV cache (VllmRolloutStrategy.measured_memory)."""
        return {**self._strategy().measured_memory(), "pp_rank": 0}

    @register(Dispatch.ONE_TO_ALL)
    def weights_digest(self) -> str:
        """A digest of the engine's weights on this rank (equal digests: bit-for-bit equal weights)."""
        return self._strategy().weights_digest()

    @register(Dispatch.ONE_TO_ALL, deadline=roles.WEIGHT_SYNC_DEADLINE)
    def load_adapter(
        self, adapter_refs: list, version: int | None = None, in_flight: str | None = None
    ) -> dict[str, int]:
        """Serve the LoRA adapters the trainer published (ActorWorker.publish_adapter) from now on, in place of the
        engine's last ones; `version`: the trainer version they are; `in_flight` (streaming): resubmit the requests
        in flight under them. Returns {"tensors", "bytes"} as load_weight_buckets."""
        import ray

        (ref,) = adapter_refs
        tensors, peft_config = ray.get(ref)
        if self.fault_point(roles.WEIGHT_SYNC_BUCKET):  # (fault injection's perturb: the adapters arrive wrong)
            tensors = perturb_first_tensor(tensors)
        loaded = self._strategy().load_adapter(tensors, peft_config, version=version, in_flight=in_flight)
        return {"tensors": loaded, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    # ---- streaming (pipelines/loops/streaming.py drives these; strategies/vllm/stream_session.py holds the state)
    @register(Dispatch.DP_MP_COMPUTE)
    def stream_admit(self, prompts: DataProto) -> None:
        """Start n samples per prompt (split over DP ranks and seeded as `generate` splits and seeds); they come
        back from `stream_run` as their groups finish; with `agentic`, n multi-turn trajectories each."""
        if self.agentic is not None:
            sampling = self._strategy().sampling_for(prompts.meta_info)
            self.agentic.stream_admit(prompts, sampling.n, sampling.max_tokens, sampling.temperature)
            return
        self._strategy().stream_admit(prompts)

    @register(Dispatch.ONE_TO_ALL, deadline=roles.GENERATION_DEADLINE)
    def stream_run(self, max_steps: int) -> tuple[DataProto | None, bool, dict[str, float]]:
        """Up to `max_steps` engine steps: (this rank's groups that finished, in rollout layout with per-token
        versions, or None; whether requests remain on the engine; counters since the last call). With `agentic`:
        up to `max_steps` steps of the trajectories' loop (roll_backend.agentic.multi_turn), groups of trajectories."""
        if self.agentic is not None:
            finished, unfinished = self.agentic.stream_run(max_steps)
            return finished, unfinished, self._strategy().stream_stats()
        return self._strategy().stream_run(max_steps)

    @register(Dispatch.DP_MP_COMPUTE)
    def probe_log_probs(self, batch: DataProto) -> DataProto:
        """The engine's log-probs of the batch's fixed responses: keys.LOG_PROBS [B, T_resp] float32."""
        return DataProto.from_dict(tensors={keys.LOG_PROBS: self._strategy().probe_log_probs(batch)})

    def _strategy(self):
        if self.strategy is None:
            raise RuntimeError(f"{self.rank_tag} the rollout engine is not started; call the group's init_model first")
        return self.strategy
