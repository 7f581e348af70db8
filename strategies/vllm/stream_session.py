"""Streaming generation on one vLLM engine (async_generation.mode: streaming): prompts are admitted at any time,
the engine is stepped a few steps per call, and groups come back as soon as all their samples finish.

Weights are loaded between two engine steps, with requests in flight (partial rollouts). What happens to them is
`in_flight`: "keep" (their KV cache stays as computed by the old weights; new requests get a per-version
cache_salt, so they never reuse old-weight prefix blocks), "recompute" (vLLM preempts them: prompt and tokens so far
are prefilled again with the new weights; ids, earlier tokens and per-request generators stay) or "resubmit" (they
are aborted and added again with the tokens so far appended to the prompt and a derived seed). Every sampled token
records the weight version that sampled it (keys.TOKEN_POLICY_VERSION), and its log-prob is the one that version
gave it: nothing is rescored, which is what the per-token rollout correction needs.

The single requests of multi-turn rollouts (`add_turn`, one per assistant turn: roll_backend.agentic drives them)
live here too, so a turn in flight at an update is kept, recomputed or resubmitted like a group's sample and its
tokens carry their versions. A generate call's turns (no update can come while they run) may name a session: the
turns of one trajectory then continue one resumable vLLM request (vLLM's streaming input), which keeps the KV cache of
the conversation so far between turns, its last, partly filled block included: a turn computes only the tokens
inserted since the last one (prefix caching alone recomputes the partial block and needs a fresh request per turn).

The engine runs in this process and only advances inside `step()`: between two calls nothing runs, so no pause
is needed. `LLM.generate` drains every request on the engine, so while requests are in flight the log-prob probe
and a validation `generate` go through `add_request` + `step()` here instead (`side_outputs`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.strategies.vllm.config import PARTIAL_ROLLOUT_MODES, SamplingConfig

RESUBMIT_SEED_STRIDE = 1_000_003  # a resubmitted seeded request draws a fresh stream, not its first tokens' again


@dataclass
class Sampled:
    """One sample: its token ids, their log-probs and (streaming) the weight version of each token."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"; None while the request runs
    text: str | None = None  # vLLM's text where stop strings needed its detokenizer; else decoded later
    versions: list[int] | None = None
    computed_prompt_tokens: int | None = None  # a turn's prompt tokens the engine computed (not from its KV cache)


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


@dataclass
class _Request:
    """A request on the engine: where its tokens go, and what a resubmission needs."""

    prompt_ids: list[int]
    sampling: SamplingConfig  # one sample's settings (max_tokens: the whole budget, before any resubmission)
    sample: _Sample
    origin: str  # the caller's id: a group's sample "g{key}-{j}", or a turn's request id
    group: int | None = None  # the streaming group's key; None for a turn (`add_turn`)
    partial: bool = True  # its tokens arrive each step (an update may come while it runs); else all at its end
    session: str | None = None  # the KV session it continues (`add_turn(session=)`), if any
    skip: int = 0  # a session's output holds every turn's tokens so far: this many are earlier turns'
    new_input: int | None = None  # a session's turn: the tokens it gave the engine (the rest was kept)


@dataclass
class _KvSession:
    """A trajectory's resumable request on the engine: its KV cache stays between turns."""

    engine_id: str  # the id we gave vLLM (its outputs carry it)
    internal_id: str  # vLLM's id of the request, which the next turn's input must name
    tokens: list[int]  # the conversation the engine holds: its last turn's prompt and sampled tokens
    busy: bool = True  # a turn is running
    sampled: int = 0  # tokens its turns sampled so far (vLLM's final output of a turn repeats them first)


class StreamingSession:
    """The partial state of every request a rollout rank has on its engine outside `LLM.generate`: streaming groups
    and multi-turn turns. Owned by the rank's VllmRolloutStrategy, which builds the finished groups' rows with the
    same code as `generate`."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.groups: dict[int, _Group] = {}
        self.requests: dict[str, _Request] = {}  # engine request id -> its request
        self.finished_turns: list[tuple[str, _Sample]] = []  # (turn id, sample) finished since the last take
        self.side: dict[str, object | None] = {}  # probe / validation request id -> its final output
        self.kv_sessions: dict[str, _KvSession] = {}  # a trajectory's id -> its resumable request
        self.keys = itertools.count()
        self.version = 0  # the trainer version of the weights the engine holds
        self.weight_changes = 0  # loads, adapter swaps and undos so far: each gets its own prefix-cache salt
        self.version_before = 0  # the version before the last change (an undo's tokens to drop are the others)
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
        padding = batch.padding_mask().tolist()  # padded rows are generated, as the synchronous path does, not returned
        rows = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info={})
        rows = rows.without_padding(keep_rows=True)
        one = dataclasses.replace(sampling, n=1)
        for index, ids in enumerate(prompt_ids):
            key = next(self.keys)
            seeds = [None if sampling.seed is None else sampling.seed + j for j in range(sampling.n)]
            group = _Group(
                rows.select_idxs([index]), ids, sampling, bool(padding[index]), [_Sample(seed=seed) for seed in seeds]
            )
            self.groups[key] = group
            for j, sample in enumerate(group.samples):
                request = _Request(ids, dataclasses.replace(one, seed=sample.seed), sample, f"g{key}-{j}", key)
                self._add(request.origin, request)

    def add_turn(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        partial: bool = True,
        session: str | None = None,
    ) -> None:
        """One sample (`sampling.n` must be 1) continuing `prompt_ids`; `take_finished_turns` returns it. With
        `partial=False` (no weight update before it ends) its output comes once, at its end: a step's bookkeeping
        does not grow with the requests in flight. A `session` (partial=False only) continues the session's last
        turn on the engine when `prompt_ids` extend that turn's prompt and sampled tokens; otherwise the session
        starts over from `prompt_ids`. `end_session` releases it."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already on the engine")
        request = _Request(list(prompt_ids), sampling, _Sample(seed=sampling.seed), request_id, partial=partial)
        if session is None or partial or sampling.stop:  # vLLM's streaming input takes no stop strings
            self._add(request_id, request)
            return
        request.session = session
        self._continue(session, request)

    def _continue(self, session: str, request: _Request) -> None:
        known = self.kv_sessions.get(session)
        if known is not None and known.busy:
            raise ValueError(f"session {session!r} has a turn running")
        prompt = request.prompt_ids
        if known is not None and len(prompt) > len(known.tokens) and prompt[: len(known.tokens)] == known.tokens:
            # The engine computed every token it holds but the last sampled one, which the new input repeats.
            new_input = prompt[len(known.tokens) - 1 :]
        else:
            if known is not None:  # the conversation was rewritten (a new segment): start the session over
                self.end_session(session)
            known = _KvSession(engine_id=f"{session}-kv{next(self.keys)}", internal_id="", tokens=[])
            self.kv_sessions[session] = known
            new_input = prompt
        engine_request = self._session_input(known, new_input, request.sampling)
        known.tokens, known.busy = list(prompt), True
        # a session's first input is a plain prompt (prefix caching counts its cached part); later ones are new tokens
        request.skip, request.new_input = known.sampled, len(new_input) if known.sampled else None
        # In process, the output processor and the scheduler would share the prompt list and both extend it with
        # the next input (AsyncLLM's engine core gets a serialised copy): the output processor gets its own.
        own = copy.copy(engine_request)
        own.prompt_token_ids = list(new_input)
        self.engine.output_processor.add_request(own, None, None, 0)
        self.engine.engine_core.add_request(engine_request)
        if known.sampled and request.sampling.seed is not None:  # vLLM keeps a session's first generator
            self.strategy.engine.collective_rpc("reseed_request", args=(known.internal_id, request.sampling.seed))
        self.requests[known.engine_id] = request

    def _session_input(self, known: _KvSession, new_input: list[int], sampling: SamplingConfig):
        """vLLM's request for a session's next input, as vllm.v1.engine.async_llm adds streaming input: the first
        gets vLLM's internal id, the next ones name it (LLMEngine.add_request would make each a new request)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.engine
        params = self.strategy.vllm_params(sampling, output_kind=RequestOutputKind.FINAL_ONLY)
        request = engine.input_processor.process_inputs(
            known.internal_id or known.engine_id,
            TokensPrompt(prompt_token_ids=new_input, cache_salt=self.salt()),
            params,
            supported_tasks=engine.get_supported_tasks(),
            lora_request=self.strategy.lora_request,
            resumable=True,
        )
        if known.internal_id:
            request.external_req_id = known.engine_id
        else:
            engine.input_processor.assign_request_id(request)
            known.internal_id = request.request_id
        return request

    def end_session(self, session: str) -> None:
        """Release a session's request and KV cache (its trajectory ended); a turn still running is aborted."""
        known = self.kv_sessions.pop(session, None)
        if known is None:
            return
        self.engine.abort_request([known.engine_id])
        request = self.requests.pop(known.engine_id, None)
        if request is not None:
            self.finished_turns = [(origin, s) for origin, s in self.finished_turns if origin != request.origin]

    def _add(self, engine_id: str, request: _Request) -> None:
        """Put `request` on the engine from where its sample stands (a resubmission continues after its tokens)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sample, sampling = request.sample, request.sampling
        done = len(sample.token_ids)
        params = self.strategy.vllm_params(
            dataclasses.replace(
                sampling,
                max_tokens=sampling.max_tokens - done,
                min_tokens=max(sampling.min_tokens - done, 0),
                seed=None if sample.seed is None else sample.seed + RESUBMIT_SEED_STRIDE * sample.resubmits,
            ),
            # each step's new tokens only (we keep the partial state), or the whole sample once at its end
            output_kind=RequestOutputKind.DELTA if request.partial else RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=request.prompt_ids + sample.token_ids, cache_salt=self.salt())
        self.engine.add_request(engine_id, prompt, params, lora_request=self.strategy.lora_request)
        self.requests[engine_id] = request

    def salt(self) -> str:
        """The prefix-cache salt of requests added now: blocks computed by other weights are never reused."""
        return f"v{self.version}-{self.weight_changes}"

    def weights_changed(self, version: int | None) -> None:
        """The engine's weights changed (a load, an adapter swap, an undo): tokens from now on carry `version` (None:
        unchanged), and requests added from now on get a salt of their own, so no block computed by other weights
        is reused, a rejected load's of the same version number included."""
        self.version_before = self.version
        if version is not None:
            self.version = version
        self.weight_changes += 1

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; every output's new tokens go to their sample, stamped with the current version."""
        self.stats["engine_steps"] += 1
        for output in self.engine.step():
            if output.request_id in self.side:
                if output.finished:
                    self.side[output.request_id] = output
                continue
            request = self.requests[output.request_id]
            sample = request.sample
            completion = output.outputs[0]
            new_ids = list(completion.token_ids[request.skip :])
            steps = (completion.logprobs or [])[request.skip :]
            sample.token_ids += new_ids
            sample.log_probs += [step[token].logprob for step, token in zip(steps, new_ids)]
            sample.versions += [self.version] * len(new_ids)
            if request.session is None:  # a session's text spans its turns (its turns take no stop strings)
                sample.text += completion.text or ""
            if sample.cached_tokens is None:
                sample.cached_tokens = output.num_cached_tokens or 0
            # a session's turn ends with a finish reason while its request stays on the engine for the next input
            if output.finished or (request.session is not None and completion.finish_reason is not None):
                self._turn_ended(output.request_id, request, completion.finish_reason)

    def _turn_ended(self, engine_id: str, request: _Request, finish_reason: str | None) -> None:
        sample = request.sample
        sample.finish_reason = finish_reason or "length"
        if request.new_input is not None:
            sample.computed_prompt_tokens = request.new_input
        else:
            sample.computed_prompt_tokens = len(request.prompt_ids) - (sample.cached_tokens or 0)
        del self.requests[engine_id]
        if request.session is not None:
            known = self.kv_sessions[request.session]
            known.tokens += sample.token_ids
            known.sampled += len(sample.token_ids)
            known.busy = False
        if request.group is None:
            self.finished_turns.append((request.origin, sample))

    def take_finished_turns(self) -> list[tuple[str, Sampled]]:
        finished, self.finished_turns = self.finished_turns, []
        return finished

    def abort_turns(self, request_ids: list[str]) -> None:
        wanted = set(request_ids)
        sessions = [r.session for r in self.requests.values() if r.session is not None and r.origin in wanted]
        for session in sessions:
            self.end_session(session)
        engine_ids = [
            rid for rid, request in self.requests.items() if request.group is None and request.origin in wanted
        ]
        if engine_ids:
            self.engine.abort_request(engine_ids)
        for rid in engine_ids:
            del self.requests[rid]
        self.finished_turns = [(origin, sample) for origin, sample in self.finished_turns if origin not in wanted]

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
        return batch, self.engine.has_unfinished_requests(), self.take_stats()

    def take_stats(self) -> dict[str, float]:
        """The counters since the last take."""
        stats, self.stats = self.stats, dict.fromkeys(self.stats, 0)
        return {k: float(v) for k, v in stats.items()}

    # ---- weights ---------------------------------------------------------------------------------------------
    def after_load(self, version: int | None, in_flight: str) -> None:
        """Weights were just loaded (between two steps): adopt `version` and treat the requests in flight by mode."""
        if in_flight not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"in_flight={in_flight!r}: use one of {PARTIAL_ROLLOUT_MODES}")
        self._check_partial_state()
        self.weights_changed(version)
        running = list(self.requests)
        started = [self.requests[rid] for rid in running if self.requests[rid].sample.token_ids]
        self.stats["partial_resumed_requests"] += len(started)
        if running and in_flight == "recompute":
            self.stats["recomputed_tokens"] += sum(len(r.prompt_ids) + len(r.sample.token_ids) for r in started)
            self.strategy.engine.reset_prefix_cache(reset_running_requests=True)
            return
        if running and in_flight == "resubmit":
            self._add_again(self._abort(running))
        # Nothing running (or kept as it is): old-weight prefix blocks go where the engine allows; the new
        # version's cache_salt keeps new requests off any that stay.
        self.strategy.engine.reset_prefix_cache()

    def swap_adapter(self, load, version: int | None) -> None:
        """`load()` puts a new LoRA adapter on the engine with requests in flight: a request keeps the LoRARequest it
        was added with, so they are aborted first (the old adapter is then free to go) and added again under the new
        one after `load()`, continuing after their tokens so far (partial_rollout: resubmit)."""
        self._check_partial_state()
        requests = self._abort(list(self.requests))
        load()
        self.weights_changed(version)
        self.stats["partial_resumed_requests"] += sum(1 for request in requests if request.sample.token_ids)
        self._add_again(requests)

    def undo_load(self, revert: Callable[[], int | None]) -> int | None:
        """The probe of the last load failed and `revert()` puts back the weights (or adapter) of the version it
        returns. The steps the engine took since the load (the probe's own advance the requests in flight) sampled
        from the rejected weights: those tokens are dropped, and every sample they reached (finished by one or not)
        continues from its earlier tokens under the reverted weights, resubmitted (its KV cache may hold the
        rejected weights' keys and values). No sample keeps a token of the rejected version. Returns the version."""
        self._check_partial_state()
        requests = self._abort(list(self.requests))
        # (a load that kept the version number leaves its tokens indistinguishable: none is dropped)
        rejected = self.version if self.version != self.version_before else None
        version = revert()
        for key, group in self.groups.items():
            for j, sample in enumerate(group.samples):
                if sample.finish_reason is not None and rejected is not None and rejected in sample.versions:
                    sample.finish_reason = None
                    one = dataclasses.replace(group.sampling, n=1, seed=sample.seed)
                    requests.append(_Request(group.prompt_ids, one, sample, f"g{key}-{j}", key))
        for request in requests:
            self._rewind(request.sample, rejected)
        self.weights_changed(version)
        self.strategy.engine.reset_prefix_cache()  # (what it can: the rejected blocks' salt is never used again)
        self._add_again(requests)
        return version

    def _rewind(self, sample: _Sample, rejected: int | None) -> None:
        """Drop the sample's tokens stamped `rejected` (the last ones: versions only grow within a sample)."""
        if rejected is None:
            return
        kept = next((i for i, v in enumerate(sample.versions) if v == rejected), len(sample.versions))
        if kept == len(sample.token_ids):
            return
        del sample.token_ids[kept:], sample.log_probs[kept:], sample.versions[kept:]
        if sample.text:  # (a stop-string sample's text so far: its tokens, decoded)
            sample.text = self.strategy.tokenizer.decode(sample.token_ids, skip_special_tokens=True)

    def _check_partial_state(self) -> None:
        # idle sessions too: the KV cache they keep was computed by the weights being replaced
        whole = [rid for rid, request in self.requests.items() if not request.partial] + list(self.kv_sessions)
        if whole:
            raise RuntimeError(
                f"a weight update arrived while {len(whole)} requests added with updates_possible=False were running "
                f"or kept their KV cache (e.g. {whole[0]!r}); their tokens cannot be attributed to versions: add "
                "them with updates_possible=True (streaming) or update between generate calls"
            )

    def _abort(self, running: list[str]) -> list[_Request]:
        if running:
            self.engine.abort_request(running)
        return [self.requests.pop(rid) for rid in running]

    def _add_again(self, requests: list[_Request]) -> None:
        for request in requests:
            request.sample.resubmits += 1
            self._add(f"{request.origin}-r{request.sample.resubmits}", request)

    def abort_all(self) -> int:
        """Drop every request and group (shutdown, or a driver that starts over); returns how many groups went."""
        for session in list(self.kv_sessions):
            self.end_session(session)
        if self.requests:
            self.engine.abort_request(list(self.requests))
        dropped = len(self.groups)
        self.groups.clear()
        self.requests.clear()
        self.finished_turns.clear()
        return dropped

    # ---- requests beside the stream ----------------------------------------------------------------------
    def side_outputs(self, prompts: list[list[int]], params) -> list:
        """Final outputs of requests added beside the ones in flight (a log-prob probe, a validation generate): they
        join the running batch; the steps they take also advance the others (their tokens are kept, stamped as
        usual)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY  # n > 1: one output with every child
        ids = [f"side-{next(self.keys)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            self.side[request_id] = None
            prompt = TokensPrompt(prompt_token_ids=prompt, cache_salt=self.salt())
            self.engine.add_request(request_id, prompt, params, lora_request=self.strategy.lora_request)
        while any(self.side[request_id] is None for request_id in ids):
            self.step()
        return [self.side.pop(request_id) for request_id in ids]


def token_versions(samples: list[Sampled], width: int) -> torch.Tensor:
    """[rows, width] int64: each sampled token's weight version, -1 where the row has no token."""
    versions = torch.full((len(samples), width), -1, dtype=torch.int64)
    for row, sample in enumerate(samples):
        values = (sample.versions or [])[:width]
        versions[row, : len(values)] = torch.as_tensor(values, dtype=torch.int64)
    return versions
