"""Multi-turn rollouts on one rollout rank: many trajectories in flight on the engine while their environments, tools
or agent functions run in subprocesses (roll_backend.session_host), so a slow environment does not idle the engine.

The loop, single-threaded: hand each trajectory whose next prompt is ready to the engine (one request per turn,
seeded per trajectory and turn so the result does not depend on which environment answered first), step the engine,
send each finished reply to its environment (a future), and when nothing is on the engine wait for the first
environment to answer. Rows come out as the single-turn rollout's layout (agentic.trajectory keeps them exact).

One loop per rank holds every trajectory in flight, admitted by calls: a `generate` call admits its prompts and
advances the loop until they are done; in streaming mode (async_generation.mode: streaming) `stream_admit` admits
and `stream_run` advances the loop a bounded number of steps and returns the groups whose trajectories all ended.
A trajectory may then span weight updates: its turns in flight are kept, recomputed or resubmitted by the engine
(strategies/vllm/stream_session.py), and each sampled token carries the version that sampled it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from roll_backend import keys
from roll_backend.agentic.agent_server import AgentRunner, CompletionRequest, CompletionServer, completion_payload
from roll_backend.agentic.config import AgenticConfig
from roll_backend.agentic.episode import Episode, EpisodeSpec, Outcome
from roll_backend.agentic.tools import parse_tool_calls
from roll_backend.agentic.trajectory import ChatTurns, Conversation, TemplateBreak
from roll_backend.agentic.trajectory_rows import env_seed, tasks_of, trajectory_metrics, trajectory_rows
from roll_backend.errors import UserCodeError
from roll_backend.protocol import DataProto
from roll_backend.session_host import SessionError, SessionHost

logger = logging.getLogger(__name__)

SCHEMA_SESSION = "tool-schemas"


@dataclass
class Trajectory:
    """One sample's progress: its conversation, rewards and counters."""

    index: int  # output order: prompt row * n + sample
    row: int  # the input prompt row
    session: str
    task: dict
    env_seed: int | None
    conv: Conversation | None = None
    rewards: list[float] = field(default_factory=list)
    success: bool | None = None
    terminated: bool = False
    truncated: bool = False
    error: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_reward: float = 0.0  # stateful tools' reward for the trajectory so far (their `reward(instance_id)`)
    env_seconds: float = 0.0
    later_turn_input_tokens: int = 0  # what the engine computed to start turns 2, 3, ... (the rest: its KV cache)
    done: bool = False
    turns: ChatTurns | None = None  # agent mode: the chat template with the tools of the agent's requests
    pending: CompletionRequest | None = None  # agent mode: the request on the engine
    call: _Call | None = field(default=None, repr=False)  # the admission it came with
    closed: concurrent.futures.Future | None = field(default=None, repr=False)  # its session's close (tools released)

    def reward(self, mode: str) -> float:
        """The environment's reward (summed over steps, or its last), plus the stateful tools' reward."""
        if not self.rewards:
            return self.tool_reward
        env = float(sum(self.rewards)) if mode == "sum" else float(self.rewards[-1])
        return env + self.tool_reward


@dataclass
class _Call:
    """One admission: a generate call's prompt rows, or a streaming admission's, and their trajectories."""

    batch: DataProto  # the prompt rows (Trajectory.row indexes them)
    meta_info: dict  # the call's sampling settings (as for `generate`)
    seed: int | None  # turns are seeded from it (None: not seeded)
    max_tokens: int  # a trajectory's budget after its first prompt
    per_turn: int  # at most this many tokens a turn
    trajectories: list[Trajectory] = field(default_factory=list)
    agent_sessions: list[str] = field(default_factory=list)  # agent mode: one session per worker running its share
    closing: list[concurrent.futures.Future] = field(default_factory=list)  # agent mode: those sessions' closes
    started: float = field(default_factory=time.perf_counter)
    engine_seconds: float = 0.0  # the loop's engine time when the call was admitted
    streaming: bool = False  # a streaming admission: weight updates may come while its turns run

    @property
    def done(self) -> bool:
        return all(traj.done for traj in self.trajectories)


class AgenticRollout:
    """Drives an engine (a RolloutStrategy's add_request / step) through multi-turn trajectories."""

    def __init__(self, engine, tokenizer, config: AgenticConfig, max_model_len: int, prompt_width: int | None = None):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.max_model_len, self.prompt_width = max_model_len, prompt_width
        self.server = None
        if config.agent is not None:
            factory = functools.partial(AgentRunner, config.agent)
            self.server = CompletionServer(reply_timeout_s=config.agent_timeout_s)
        else:
            spec = EpisodeSpec(
                env=config.env,
                envs=tuple(config.envs.items()),
                env_key=config.env_key,
                tools=tuple(config.tools),
                tool_timeout_s=config.step_timeout_s,
                observation_template=config.observation_template,
                observation_role=config.observation_role,
                sandbox=config.sandbox,
            )
            factory = functools.partial(Episode, spec)
        self.host = SessionHost(factory, config.workers, label=_label(config), concurrency=config.worker_threads)
        schemas = None
        if config.tools:  # built in a worker: loading user tools runs their code
            self.host.open(SCHEMA_SESSION)
            schemas = self.host.call(SCHEMA_SESSION, "tool_schemas", timeout_s=config.step_timeout_s).result()
            self.host.close(SCHEMA_SESSION)
        self.turns = ChatTurns(tokenizer, tools=schemas, on_break=config.on_template_break)
        self._ids = itertools.count()
        self.loop = _Loop(self)
        self.stream_calls: list[_Call] = []  # streaming admissions with trajectories not yet returned

    def close(self) -> None:
        self.loop.release()
        self.host.shutdown()
        if self.server is not None:
            self.server.close()

    # ---- one generate call ---------------------------------------------------------------------------------
    def generate(self, batch: DataProto, n: int, max_tokens: int, temperature: float) -> DataProto:
        """Prompt rows [B] -> trajectory rows [B*n] (more with new segments), in the rollout batch layout."""
        call = self._admit(batch, n, max_tokens, temperature)
        self._advance(until=lambda: call.done)
        _wait_closed(call.trajectories, [call])
        failed = [traj.error for traj in call.trajectories if traj.error is not None]
        if failed:  # counted in agentic/env_errors_count; the message says why
            logger.warning(
                "%d of %d trajectories ended by an error; the first: %s", len(failed), len(call.trajectories), failed[0]
            )
        seconds = time.perf_counter() - call.started
        metrics = trajectory_metrics(call.trajectories, self.config.env_reward, self._env_key)
        metrics |= self._engine_metrics(call.engine_seconds, seconds)
        sampled = sum(t.conv.sampled_tokens for t in call.trajectories)
        metrics |= {"rollout/generate_s": seconds, "rollout/tokens_per_s": sampled / max(seconds, 1e-9)}
        return self._rows(call.batch, call.trajectories, max_tokens, metrics if call.trajectories else {})

    # ---- streaming (async_generation.mode: streaming) ------------------------------------------------------------
    def stream_admit(self, batch: DataProto, n: int, max_tokens: int, temperature: float) -> None:
        """Start n trajectories per prompt row; `stream_run` returns them by group once all n ended. Rows the DP
        split repeated (keys.DISPATCH_PADDING) are not played."""
        batch = batch.without_padding()
        if len(batch):
            call = self._admit(batch, n, max_tokens, temperature, streaming=True)
            # Rows of several admissions go back together: theirs carry no per-call meta (steps, seeds).
            call.batch = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info={})
            self.stream_calls.append(call)

    def stream_run(self, max_steps: int) -> tuple[DataProto | None, bool]:
        """Advance every trajectory up to `max_steps` loop steps (an engine step, or a wait for an environment);
        returns (the groups whose n trajectories all ended, with each token's weight version, or None; whether any
        trajectory is still going)."""
        started, engine_seconds = time.perf_counter(), self.loop.engine_seconds
        self._advance(max_steps=max_steps)
        by_call = []
        for call in self.stream_calls:
            rows = sorted({traj.row for traj in call.trajectories})
            done = {row for row in rows if all(t.done for t in call.trajectories if t.row == row)}
            if done:
                by_call.append((call, [traj for traj in call.trajectories if traj.row in done]))
                call.trajectories = [traj for traj in call.trajectories if traj.row not in done]
        self.stream_calls = [call for call in self.stream_calls if call.trajectories]
        ended = [traj for _, finished in by_call for traj in finished]
        _wait_closed(ended, [call for call, _ in by_call])
        self.loop.forget(ended)
        # One prompt width for the admissions' rows (without max_prompt_length each call's longest would differ).
        width = max((len(seg.prompt_ids) for traj in ended for seg in traj.conv.segments), default=0)
        parts = [
            self._rows(call.batch, finished, call.max_tokens, {}, versions=True, prompt_width=width)
            for call, finished in by_call
        ]
        batch = None
        if parts:
            batch = DataProto.concat(parts)
            metrics = trajectory_metrics(ended, self.config.env_reward, self._env_key)
            batch.meta_info[keys.META_METRICS] = metrics | self._engine_metrics(
                engine_seconds, time.perf_counter() - started
            )
        return batch, self.loop.busy()

    # ---- admissions and the loop -----------------------------------------------------------------------------
    def _admit(self, batch: DataProto, n: int, max_tokens: int, temperature: float, streaming: bool = False) -> _Call:
        base_seed = batch.meta_info.get(keys.META_SAMPLING_SEED)
        per_turn = min(self.config.max_tokens_per_turn or max_tokens, max_tokens)
        seed = base_seed if temperature > 0 else None
        call = _Call(batch, dict(batch.meta_info), seed, max_tokens, per_turn, streaming=streaming)
        call_id = next(self._ids)
        call.trajectories = [
            Trajectory(
                row * n + sample, row, f"{call_id}-{row}-{sample}", task, env_seed(task, base_seed, row), call=call
            )
            for row, task in enumerate(tasks_of(batch))
            for sample in range(n)
        ]
        call.engine_seconds = self.loop.engine_seconds
        self._advance(admit=call)
        return call

    def _advance(self, admit: _Call | None = None, **how) -> None:
        """Admit a call or advance the loop; any error ends every trajectory in flight (nothing stays on the engine
        or in the workers) before it propagates."""
        try:
            if admit is not None:
                self.loop.admit(admit)
            else:
                self.loop.advance(**how)
        except BaseException:
            self.loop.release()
            self.stream_calls = []
            raise

    @property
    def _env_key(self) -> str | None:
        """The extra_info key naming each row's environment, in a run of several (per-environment metrics)."""
        return self.config.env_key if self.config.envs else None

    def _engine_metrics(self, engine_seconds_before: float, seconds: float) -> dict[str, float]:
        busy = self.loop.engine_seconds - engine_seconds_before
        return {"agentic/engine_busy_fraction": busy / max(seconds, 1e-9)}

    def first_messages(self, traj: Trajectory, outcome: Outcome) -> list[dict]:
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        if self.config.env is not None or self.config.envs:
            return messages + outcome.messages
        prompt = traj.task["prompt"]
        return messages + (list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}])

    # ---- output rows ---------------------------------------------------------------------------------------
    def _rows(
        self, batch, trajectories, width: int, metrics: dict, versions: bool = False, prompt_width: int = 0
    ) -> DataProto:
        prompt_width = max(self.prompt_width or 0, prompt_width)
        return trajectory_rows(
            batch, trajectories, width, self.tokenizer, prompt_width, self.config.env_reward, metrics, versions
        )


class _Loop:
    """The trajectories in flight on one rank, of every call admitted (see the module docstring)."""

    def __init__(self, rollout: AgenticRollout):
        self.rollout, self.config, self.engine = rollout, rollout.config, rollout.engine
        self.server = rollout.server
        self.waiting: dict[concurrent.futures.Future, tuple[Trajectory | list[Trajectory], Callable]] = {}
        self.on_engine: dict[str, Trajectory] = {}
        self.ready: list[Trajectory] = []
        self.engine_seconds = 0.0  # inside engine.step: agentic/engine_busy_fraction
        self.by_session: dict[str, Trajectory] = {}  # agent mode: where an agent's request goes
        self.calls: list[_Call] = []

    def busy(self) -> bool:
        return bool(self.waiting or self.on_engine or self.ready)

    def admit(self, call: _Call) -> None:
        if not call.trajectories:
            return
        self.calls.append(call)
        self.by_session |= {traj.session: traj for traj in call.trajectories}
        if self.server is not None:
            self._start_agents(call)
            return
        host = self.rollout.host
        for traj in call.trajectories:
            host.open(traj.session)
            future = host.call(traj.session, "reset", traj.env_seed, traj.task, timeout_s=self._timeout())
            self._expect(traj, future, self._reset)

    def advance(self, until: Callable[[], bool] | None = None, max_steps: int | None = None) -> None:
        """Run the loop until `until()` holds, `max_steps` iterations passed or nothing is left to do."""
        steps = 0
        while self.busy() and not (until is not None and until()) and (max_steps is None or steps < max_steps):
            self._iterate()
            steps += 1

    def _iterate(self) -> None:
        for traj in self.ready:
            self._submit(traj)
        self.ready = []
        if self.on_engine:
            started = time.perf_counter()
            finished = self.engine.step()
            self.engine_seconds += time.perf_counter() - started
            for request in finished:
                self._replied(self.on_engine.pop(request.request_id), request)
        elif self.waiting:
            doorbell = [self.server.ring()] if self.server is not None else []
            # A request queued before this doorbell rang the previous one: look at the inbox after taking the bell
            # (requests are queued, then ring), or wait for a call that never answers without that reply.
            if self.server is None or self.server.inbox.empty():
                concurrent.futures.wait(list(self.waiting) + doorbell, return_when=concurrent.futures.FIRST_COMPLETED)
        if self.server is not None:
            self._take_requests()
        for future in [f for f in self.waiting if f.done()]:
            owner, then = self.waiting.pop(future)
            self._answered(owner, future, then)

    def _timeout(self) -> float:
        return self.config.step_timeout_s

    def _expect(self, traj: Trajectory, future, then: Callable) -> None:
        self.waiting[future] = (traj, then)

    def _answered(self, owner, future, then: Callable) -> None:
        """An environment, tool or agent call came back: go on, or end its trajectories (`owner`: one or a list)."""
        try:
            result = future.result()
        except SessionError as exc:
            if self.config.on_env_error == "raise":
                raise
            for traj in owner if isinstance(owner, list) else [owner]:
                traj.error = str(exc)
                self._finish(traj)
            return
        then(owner, result)

    def _reset(self, traj: Trajectory, outcome: Outcome) -> None:
        traj.env_seconds += outcome.seconds
        traj.tool_reward = outcome.tool_reward
        traj.conv = self.rollout.turns.start(self.rollout.first_messages(traj, outcome))
        prompt = len(traj.conv.current.prompt_ids)
        width = self.rollout.prompt_width
        if width is not None and prompt > width:  # rows of every rank share this width
            raise ValueError(
                f"a trajectory's first prompt (system prompt + first observation) is {prompt} tokens, above the "
                f"rollout's max_prompt_length={width}; raise actor_infer.strategy.max_prompt_length (and "
                "max_model_len) or shorten the observation"
            )
        if prompt + 1 > self.rollout.max_model_len:
            raise ValueError(
                f"a trajectory's first prompt is {prompt} tokens, at or above the engine's max_model_len="
                f"{self.rollout.max_model_len}; raise max_model_len or shorten the first observation"
            )
        self.ready.append(traj)

    def _submit(self, traj: Trajectory, per_turn: int | None = None) -> None:
        segment, call = traj.conv.current, traj.call
        room = min(per_turn or call.per_turn, call.max_tokens - len(segment.response_ids))
        room = min(room, self.rollout.max_model_len - len(segment.context()))
        if room < 1:
            traj.truncated = True
            if traj.pending is not None:  # the agent hears that nothing more fits the trajectory's budget
                traj.pending.reply.set_result((200, completion_payload("", "length", len(segment.context()), 0)))
                traj.pending = None
                return
            self._finish(traj)
            return
        request_id = f"{traj.session}-t{traj.conv.turns}"
        seed = None
        if call.seed is not None:
            seed = (call.seed * 1_000_003 + traj.index * 7919 + traj.conv.turns * 104_729) % (2**31 - 1)
        session = traj.session if self.config.keep_kv_between_turns and not call.streaming else None
        self.engine.add_request(
            request_id, segment.context(), room, seed, call.meta_info, updates_possible=call.streaming, session=session
        )
        self.on_engine[request_id] = traj

    def _replied(self, traj: Trajectory, request) -> None:
        if traj.conv.turns:  # not the first turn (a plain prompt, which prefix caching shares across trajectories)
            traj.later_turn_input_tokens += request.computed_prompt_tokens or 0
        if traj.pending is not None:  # agent mode: the answer goes back to the agent's HTTP request
            text = traj.turns.add_sampled(traj.conv, request.token_ids, request.log_probs, request.versions)
            payload = completion_payload(
                text,
                request.finish_reason,
                len(traj.conv.current.context()) - len(request.token_ids),
                len(request.token_ids),
            )
            traj.pending.reply.set_result((200, payload))
            traj.pending = None
            return
        text = self.rollout.turns.add_sampled(traj.conv, request.token_ids, request.log_probs, request.versions)
        if traj.conv.turns >= self.config.max_turns and self.config.tools and any(parse_tool_calls(text)):
            traj.truncated = True  # tool calls on the last turn: no turn is left to read their results
            self._finish(traj)
            return
        # Every other reply is acted on, the last allowed one too: its reward counts, and the trajectory is truncated
        # only if the environment does not end there (_acted).
        future = self.rollout.host.call(traj.session, "act", text, timeout_s=self._timeout())
        self._expect(traj, future, self._acted)

    def _acted(self, traj: Trajectory, outcome: Outcome) -> None:
        traj.env_seconds += outcome.seconds
        traj.rewards.append(outcome.reward)
        traj.tool_reward = outcome.tool_reward
        traj.tool_calls += outcome.tool_calls
        traj.tool_errors += outcome.tool_errors
        if outcome.success is not None:
            traj.success = outcome.success
        if outcome.done:
            traj.terminated, traj.truncated = not outcome.truncated, outcome.truncated
            self._finish(traj)
            return
        if traj.conv.turns >= self.config.max_turns:  # the last allowed turn was stepped and did not end it
            traj.truncated = True
            self._finish(traj)
            return
        segment = traj.conv.current
        kept = len(segment.response_ids)
        try:
            self.rollout.turns.extend(traj.conv, outcome.messages)
        except TemplateBreak as exc:
            raise TemplateBreak(f"{exc} (trajectory {traj.session})") from None
        if len(traj.conv.current.response_ids) > traj.call.max_tokens:  # the inserted messages do not fit the budget
            segment.truncate(kept)
            traj.truncated = True
            self._finish(traj)
            return
        self.ready.append(traj)

    def _finish(self, traj: Trajectory) -> None:
        traj.done = True
        self.engine.end_session(traj.session)
        if traj.conv is None:  # the environment failed at reset (or the agent asked nothing): an empty row
            traj.conv = self.rollout.turns.empty()
        if self.server is None:
            traj.closed = self.rollout.host.close(traj.session)
        call = traj.call
        if call.done:  # its trajectories stay with the call until their rows are built
            call.closing += [self.rollout.host.close(session) for session in call.agent_sessions]
            call.agent_sessions = []
            self.forget(call.trajectories)
            if call in self.calls:
                self.calls.remove(call)

    def forget(self, trajectories: list[Trajectory]) -> None:
        """Ended trajectories: an agent's late request for one is refused as for an unknown trajectory."""
        for traj in trajectories:
            self.by_session.pop(traj.session, None)

    # ---- agent mode ------------------------------------------------------------------------------------------
    def _start_agents(self, call: _Call) -> None:
        """The agent function for every trajectory, spread over the host's workers (each runs its share at once)."""
        host, workers = self.rollout.host, self.config.workers
        for worker in range(min(workers, len(call.trajectories))):
            share = call.trajectories[worker::workers]
            session = f"{share[0].session}-agents"
            host.open(session)
            jobs = [(traj.task, self.server.base_url(traj.session)) for traj in share]
            rounds = -(-len(share) // self.config.agent.concurrency)
            timeout = self.config.agent_timeout_s * rounds + 10.0
            future = host.call(session, "run_many", jobs, self.config.agent_timeout_s, timeout_s=timeout)
            self.waiting[future] = (share, self._agents_done)
            call.agent_sessions.append(session)

    def _agents_done(self, share: list[Trajectory], results: list[dict]) -> None:
        for traj, result in zip(share, results):
            if "error" in result:
                if self.config.on_env_error == "raise":
                    raise UserCodeError(result["error"])
                traj.error = result["error"]
            elif result["reward"] is not None:
                traj.rewards.append(result["reward"])
            traj.terminated = traj.error is None
            self._finish(traj)

    def _take_requests(self) -> None:
        while True:
            try:
                request = self.server.inbox.get_nowait()
            except queue.Empty:
                return
            traj = self.by_session.get(request.trajectory)
            if traj is None or traj.done or traj.pending is not None:
                problem = "unknown or finished trajectory" if traj is None or traj.done else "a request is in flight"
                request.reply.set_result((409, {"error": {"message": f"{problem}: {request.trajectory}"}}))
                continue
            self._completion(traj, request)

    def _completion(self, traj: Trajectory, request: CompletionRequest) -> None:
        messages = request.body["messages"]
        if traj.conv is None:
            traj.turns = ChatTurns(
                self.rollout.tokenizer, tools=request.body.get("tools"), on_break=self.config.on_template_break
            )
            traj.conv = traj.turns.start(messages)
        elif traj.conv.turns >= self.config.max_turns:
            traj.truncated = True
            request.reply.set_result((200, completion_payload("", "length", len(traj.conv.current.context()), 0)))
            return
        else:
            try:
                traj.turns.extend(traj.conv, new_messages(traj.conv.messages, messages, traj.conv.turns))
            except TemplateBreak as exc:
                request.reply.set_result((400, {"error": {"message": str(exc)}}))
                raise TemplateBreak(f"{exc} (agent trajectory {traj.session})") from None
        traj.pending = request
        per_turn = traj.call.per_turn
        limit = request.body.get("max_completion_tokens") or request.body.get("max_tokens") or per_turn
        self._submit(traj, min(int(limit), per_turn))

    def release(self) -> None:
        """After an error (or at shutdown): nothing of any call stays on the engine or in the workers."""
        if self.on_engine:
            self.engine.abort_requests(list(self.on_engine))
        for call in self.calls:
            for traj in call.trajectories:
                self.engine.end_session(traj.session)
                if traj.pending is not None:
                    traj.pending.reply.set_result((500, {"error": {"message": "the rollout stopped"}}))
                    traj.pending = None
                if not traj.done and self.server is None:
                    self.rollout.host.close(traj.session)
            for session in call.agent_sessions:
                self.rollout.host.close(session)
        self.waiting, self.on_engine, self.ready, self.by_session, self.calls = {}, {}, [], {}, []


def _wait_closed(ended: list[Trajectory], calls: list[_Call]) -> None:
    """Ended trajectories' rows come back once their sessions are closed (stateful tools released, environments
    closed; verl awaits a tool's release too), and a finished call's agent sessions too; waited for where the rows are
    built, not inside the loop, so a slow release holds up no other trajectory's turns. A close that fails (the
    host's deadline for it included) is logged; the rows stand."""
    closing = [traj.closed for traj in ended if traj.closed is not None]
    for call in calls:
        closing, call.closing = closing + call.closing, []
    for future in closing:
        try:
            future.result()
        except SessionError as exc:
            logger.warning("closing an ended trajectory's session failed: %s", exc)


def new_messages(recorded: list[dict], request: list[dict], turn: int) -> list[dict]:
    """The messages of an agent's request after those already recorded. Earlier messages must be the recorded ones
    (an assistant message may be the agent's own rendering of the reply: the recorded text stands for it)."""
    for index, (mine, theirs) in enumerate(zip(recorded, request)):
        same = mine["role"] == theirs.get("role") and (
            mine["role"] == "assistant" or mine.get("content") == theirs.get("content")
        )
        if not same:
            raise TemplateBreak(
                f"turn {turn + 1}: the request's message {index} ({theirs.get('role')}) differs from the one recorded "
                f"({mine['role']}: {str(mine.get('content'))[:60]!r}); an agent must extend its conversation, not "
                "rewrite it (or set agentic.on_template_break: new_segment)"
            )
    if len(request) <= len(recorded):
        raise TemplateBreak(f"turn {turn + 1}: the request adds no message after the recorded conversation")
    return [dict(m) for m in request[len(recorded) :]]


def _label(config: AgenticConfig) -> str:
    if config.agent is not None:
        return f"agent {config.agent.path}:{config.agent.name}"
    if config.env is not None or config.envs:
        return "environments " + ", ".join(
            env.label for env in [*([config.env] if config.env else []), *config.envs.values()]
        )
    return "tools " + ", ".join(spec.label for spec in config.tools)
