"""Streaming generation on one vLLM engine (async_generation.mode: streaming): prompts are admitted at any time,
the engine is stepped a few steps per call, and groups come back as soon as all their samples finish.

Weights are loaded between two engine steps, with requests in flight (partial rollouts). What happens to them is
`in_flight`: "keep" (their KV cache stays as computed by the old weights; new requests get a per-version
cache_salt, so they never reuse old-weight prefix blocks), "recompute" (vLLM preempts them: prompt and tokens so far
are prefilled again with the new weights; ids, earlier tokens and per-request generators stay) or "resubmit" (they
are aborted and added again with the tokens so far appended to the prompt and a derived seed). Every sampled token
records the weight version that sampled it (keys.TOKEN_POLICY_VERSION), and its log-prob is the one that version
gave it: nothing is rescored, which is what the per-token rollout correction needs.

The engine runs in this process and only advances inside `step()`: between two calls nothing runs, so no pause
is needed. `LLM.generate` drains every request on the engine, so while requests are in flight the log-prob probe
goes through `add_request` + `step()` here instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.strategies.vllm.config import SamplingConfig

PARTIAL_ROLLOUT_MODES = ("keep", "recompute", "resubmit")
RESUBMIT_SEED_STRIDE = 1_000_003  # a resubmitted seeded request draws a fresh stream, not its first tokens' again


@dataclass
class Sampled:
    """One sample: its token ids, their log-probs and (streaming) the weight version of each token."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"; None while the request runs
    text: str | None = None  # vLLM's text where stop strings needed its detokenizer; else decoded later
    versions: list[int] | None = None


@dataclass
class _Sample(Sampled):
    """A streaming request's sample as it grows, with what a resubmission needs."""

    seed: int | None = None
    text: str = ""
    versions: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    resubmits: int = 0


@dataclass
class _Group:
    row: DataProto  # the admitted prompt row (tensor and non-tensor columns, no meta)
    prompt_ids: list[int]
    sampling: SamplingConfig
    padding: bool  # a row the DP split repeated: generated (as the synchronous path does) but not returned
    samples: list[_Sample]

    @property
    def finished(self) -> bool:
        return all(sample.finish_reason is not None for sample in self.samples)


class StreamingSession:
    """The partial state of every request a rollout rank has admitted in streaming mode. Owned by the rank's
    VllmRolloutStrategy, which builds the finished groups' rows with the same code as `generate`."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.groups: dict[int, _Group] = {}
        self.requests: dict[str, tuple[int, int]] = {}  # engine request id -> (group key, sample index)
        self.probes: dict[str, object | None] = {}  # probe request id -> its final output
        self.keys = itertools.count()
        self.version = 0  # the trainer version of the weights the engine holds
        self.stats = {"partial_resumed_requests": 0, "recomputed_tokens": 0, "engine_steps": 0}

    @property
    def engine(self):
        return self.strategy.engine.llm_engine

    def in_flight(self) -> bool:
        return bool(self.requests)

    # ---- admission ---------------------------------------------------------------------------------------
    def admit(self, batch: DataProto) -> None:
        """Add n requests per prompt row (the rows of `generate`'s input), prompt-major as `LLM.generate` adds its
        n children, after reseeding the sampler with the batch's META_SAMPLING_SEED like `generate`."""
        strategy = self.strategy
        sampling = strategy.sampling_for(batch.meta_info)
        prompt_ids = strategy.prompt_token_ids(batch)
        strategy.check_prompt_lengths(prompt_ids, sampling)
        if batch.meta_info.get(keys.META_SAMPLING_SEED) is not None:
            strategy.engine.collective_rpc("reseed_sampler", args=(int(batch.meta_info[keys.META_SAMPLING_SEED]),))
        tensors = batch.batch
        padding = (
            tensors[keys.DISPATCH_PADDING].tolist()
            if tensors is not None and keys.DISPATCH_PADDING in tensors.keys()
            else [False] * len(batch)
        )
        rows = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info={})
        if tensors is not None and keys.DISPATCH_PADDING in tensors.keys():
            rows = rows.select(batch_keys=[k for k in tensors.keys() if k != keys.DISPATCH_PADDING])
        for index, ids in enumerate(prompt_ids):
            key = next(self.keys)
            seeds = [None if sampling.seed is None else sampling.seed + j for j in range(sampling.n)]
            group = _Group(
                rows.select_idxs([index]), ids, sampling, bool(padding[index]), [_Sample(seed=seed) for seed in seeds]
            )
            self.groups[key] = group
            for j, sample in enumerate(group.samples):
                self._add(f"g{key}-{j}", key, j, ids, sampling.max_tokens, sampling.min_tokens, sample.seed)

    def _add(self, request_id: str, key: int, j: int, prompt: list[int], max_tokens: int, min_tokens: int, seed):
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        group = self.groups[key]
        params = self.strategy.vllm_params(
            dataclasses.replace(group.sampling, n=1, max_tokens=max_tokens, min_tokens=min_tokens, seed=seed),
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens only: we keep the partial state
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt), cache_salt=f"v{self.version}")
        self.engine.add_request(request_id, prompt, params)
        self.requests[request_id] = (key, j)

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; every output's new tokens go to their sample, stamped with the current version."""
        self.stats["engine_steps"] += 1
        for output in self.engine.step():
            if output.request_id in self.probes:
                if output.finished:
                    self.probes[output.request_id] = output
                continue
            key, j = self.requests[output.request_id]
            sample = self.groups[key].samples[j]
            completion = output.outputs[0]
            new_ids = list(completion.token_ids)
            sample.token_ids += new_ids
            sample.log_probs += [step[token].logprob for step, token in zip(completion.logprobs or [], new_ids)]
            sample.versions += [self.version] * len(new_ids)
            sample.text += completion.text or ""
            if sample.cached_tokens is None:
                sample.cached_tokens = output.num_cached_tokens or 0
            if output.finished:
                sample.finish_reason = completion.finish_reason or "length"
                del self.requests[output.request_id]

    def run(self, max_steps: int) -> tuple[DataProto | None, bool, dict[str, float]]:
        """Step up to `max_steps` times while anything is on the engine; returns (the groups that finished, in
        rollout layout with TOKEN_POLICY_VERSION, or None; whether requests remain; counters since the last call)."""
        start = time.perf_counter()
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        done = [key for key, group in self.groups.items() if group.finished]
        finished = [self.groups.pop(key) for key in done]
        real = [group for group in finished if not group.padding]
        batch = self.strategy.rollout_rows(real, time.perf_counter() - start) if real else None
        stats, self.stats = self.stats, dict.fromkeys(self.stats, 0)
        return batch, self.engine.has_unfinished_requests(), {k: float(v) for k, v in stats.items()}

    # ---- weights -----------------------------------------------------------------------------------------
    def after_load(self, version: int | None, in_flight: str) -> None:
        """Weights were just loaded (between two steps): adopt `version` and treat the requests in flight by mode."""
        if in_flight not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"in_flight={in_flight!r}: use one of {PARTIAL_ROLLOUT_MODES}")
        if version is not None:
            self.version = version
        running = list(self.requests)
        started = [rid for rid in running if self._sample(rid).token_ids]
        self.stats["partial_resumed_requests"] += len(started)
        if running and in_flight == "recompute":
            self.stats["recomputed_tokens"] += sum(
                len(self.groups[self.requests[rid][0]].prompt_ids) + len(self._sample(rid).token_ids) for rid in started
            )
            self.strategy.engine.reset_prefix_cache(reset_running_requests=True)
            return
        if running and in_flight == "resubmit":
            self.engine.abort_request(running)
            for rid in running:
                self._resubmit(rid)
        # Nothing running (or kept as it is): old-weight prefix blocks go where the engine allows; the new
        # version's cache_salt keeps new requests off any that stay.
        self.strategy.engine.reset_prefix_cache()

    def _sample(self, request_id: str) -> _Sample:
        key, j = self.requests[request_id]
        return self.groups[key].samples[j]

    def _resubmit(self, request_id: str) -> None:
        key, j = self.requests.pop(request_id)
        group, sample = self.groups[key], self.groups[key].samples[j]
        sample.resubmits += 1
        seed = None if sample.seed is None else sample.seed + RESUBMIT_SEED_STRIDE * sample.resubmits
        max_tokens = group.sampling.max_tokens - len(sample.token_ids)
        min_tokens = max(group.sampling.min_tokens - len(sample.token_ids), 0)
        prompt = group.prompt_ids + sample.token_ids
        self._add(f"g{key}-{j}-r{sample.resubmits}", key, j, prompt, max_tokens, min_tokens, seed)

    def abort_all(self) -> int:
        """Drop every request and group (shutdown, or a driver that starts over); returns how many groups went."""
        if self.requests:
            self.engine.abort_request(list(self.requests))
        dropped = len(self.groups)
        self.groups.clear()
        self.requests.clear()
        return dropped

    # ---- probe -------------------------------------------------------------------------------------------
    def probe_outputs(self, prompts: list[list[int]], params) -> list:
        """Score fixed sequences (prompt_logprobs) while other requests are in flight: the probe requests join the
        running batch; the steps they take also advance the others (their tokens are kept, stamped as usual)."""
        from vllm.inputs import TokensPrompt

        ids = [f"probe-{next(self.keys)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            self.probes[request_id] = None
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        while any(self.probes[request_id] is None for request_id in ids):
            self.step()
        return [self.probes.pop(request_id) for request_id in ids]


def token_versions(samples: list[Sampled], width: int) -> torch.Tensor:
    """[rows, width] int64: each sampled token's weight version, -1 where the row has no token."""
    versions = torch.full((len(samples), width), -1, dtype=torch.int64)
    for row, sample in enumerate(samples):
        values = (sample.versions or [])[:width]
        versions[row, : len(values)] = torch.as_tensor(values, dtype=torch.int64)
    return versions
