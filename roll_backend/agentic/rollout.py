"""Multi-turn rollouts on one rollout rank: many trajectories in flight on the engine while their environments, tools
or agent functions run in subprocesses (env_host), so a slow environment does not idle the engine.

The loop, single-threaded: hand each trajectory whose next prompt is ready to the engine (one request per turn,
seeded per trajectory and turn so the result does not depend on which environment answered first), step the engine,
send each finished reply to its environment (a future), and when nothing is on the engine wait for the first
environment to answer. Rows come out as the single-turn rollout's layout (agentic.trajectory keeps them exact).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from roll_backend import keys
from roll_backend.agentic.agent_server import AgentRunner, CompletionRequest, CompletionServer, completion_payload
from roll_backend.agentic.config import AgenticConfig
from roll_backend.agentic.env_host import SessionError, SessionHost
from roll_backend.agentic.episode import Episode, EpisodeSpec, Outcome
from roll_backend.agentic.trajectory import ChatTurns, Conversation, TemplateBreak
from roll_backend.algorithms.tokens import left_pad, sequence_columns
from roll_backend.errors import UserCodeError
from roll_backend.protocol import DataProto

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
    env_seconds: float = 0.0
    done: bool = False
    turns: ChatTurns | None = None  # agent mode: the chat template with the tools of the agent's requests
    pending: CompletionRequest | None = None  # agent mode: the request on the engine

    def reward(self, mode: str) -> float:
        if not self.rewards:
            return 0.0
        return float(sum(self.rewards)) if mode == "sum" else float(self.rewards[-1])


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
                tools=tuple(config.tools),
                tool_timeout_s=config.step_timeout_s,
                observation_template=config.observation_template,
                observation_role=config.observation_role,
            )
            factory = functools.partial(Episode, spec)
        self.host = SessionHost(factory, config.workers, label=_label(config))
        schemas = None
        if config.tools:  # built in a worker: loading user tools runs their code
            self.host.open(SCHEMA_SESSION)
            schemas = self.host.call(SCHEMA_SESSION, "tool_schemas", timeout_s=config.step_timeout_s).result()
            self.host.close(SCHEMA_SESSION)
        self.turns = ChatTurns(tokenizer, tools=schemas, on_break=config.on_template_break)
        self._ids = itertools.count()

    def close(self) -> None:
        self.host.shutdown()
        if self.server is not None:
            self.server.close()

    # ---- one generate call ---------------------------------------------------------------------------------
    def generate(self, batch: DataProto, n: int, max_tokens: int, temperature: float) -> DataProto:
        """Prompt rows [B] -> trajectory rows [B*n] (more with new segments), in the rollout batch layout."""
        started = time.perf_counter()
        base_seed = batch.meta_info.get(keys.META_SAMPLING_SEED)
        call = next(self._ids)
        trajectories = [
            Trajectory(row * n + sample, row, f"{call}-{row}-{sample}", task, _env_seed(task, base_seed, row))
            for row, task in enumerate(_tasks(batch))
            for sample in range(n)
        ]
        loop = _Loop(self, trajectories, max_tokens, base_seed if temperature > 0 else None, batch.meta_info)
        try:
            loop.run()
        finally:
            loop.release()
        failed = [traj.error for traj in trajectories if traj.error is not None]
        if failed:  # counted in agentic/env_errors_count; the message says why
            logger.warning(
                "%d of %d trajectories ended by an error; the first: %s", len(failed), len(trajectories), failed[0]
            )
        return self._rows(batch, trajectories, max_tokens, loop.metrics(time.perf_counter() - started))

    def first_messages(self, traj: Trajectory, outcome: Outcome) -> list[dict]:
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        if self.config.env is not None:
            return messages + outcome.messages
        prompt = traj.task["prompt"]
        return messages + (list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}])

    # ---- output rows ---------------------------------------------------------------------------------------
    def _rows(self, batch: DataProto, trajectories: list[Trajectory], width: int, metrics: dict) -> DataProto:
        segments = [(traj, seg) for traj in trajectories for seg in traj.conv.segments] if trajectories else []
        pad_id = self.tokenizer.pad_token_id
        longest = max((len(seg.prompt_ids) for _, seg in segments), default=1)
        prompts, prompt_mask = left_pad(
            [seg.prompt_ids for _, seg in segments], pad_id, max(longest, self.prompt_width or 0)
        )
        responses = torch.full((len(segments), width), pad_id, dtype=torch.int64)
        present = torch.zeros((len(segments), width), dtype=torch.int64)
        loss_mask = torch.zeros((len(segments), width), dtype=torch.int64)
        log_probs = torch.zeros((len(segments), width), dtype=torch.float32)
        for i, (_, seg) in enumerate(segments):
            length = len(seg.response_ids)
            responses[i, :length] = torch.tensor(seg.response_ids, dtype=torch.int64)
            present[i, :length] = 1
            loss_mask[i, :length] = torch.tensor(seg.loss_mask, dtype=torch.int64)
            log_probs[i, :length] = torch.tensor(seg.log_probs, dtype=torch.float32)
        rows = [traj.row for traj, _ in segments]
        tensors = sequence_columns(prompts, prompt_mask, responses, present)
        tensors |= {
            keys.RESPONSE_MASK: loss_mask,
            keys.ROLLOUT_LOG_PROBS: log_probs,
            keys.ENV_REWARDS: torch.tensor(
                [traj.reward(self.config.env_reward) for traj, _ in segments], dtype=torch.float32
            ),
        }
        if batch.batch is not None:
            tensors |= {k: v[rows] for k, v in batch.batch.items() if k not in tensors and k != keys.ATTENTION_MASK}
        non_tensors = {name: column[rows] for name, column in batch.non_tensor_batch.items()}
        if keys.UID not in non_tensors:
            uids = np.array([uuid.uuid4().hex for _ in range(len(batch))], dtype=object)
            non_tensors[keys.UID] = uids[rows]
        texts = self.tokenizer.batch_decode([seg.response_ids for _, seg in segments], skip_special_tokens=True)
        non_tensors[keys.RESPONSE_TEXT] = np.array(texts, dtype=object)
        meta_info = dict(batch.meta_info)
        meta_info[keys.META_METRICS] = metrics
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


class _Loop:
    """The state of one generate call's loop (see the module docstring)."""

    def __init__(self, rollout: AgenticRollout, trajectories: list[Trajectory], max_tokens: int, seed, meta_info):
        self.rollout, self.config, self.meta_info = rollout, rollout.config, dict(meta_info)
        self.trajectories, self.max_tokens, self.seed = trajectories, max_tokens, seed
        self.per_turn = min(self.config.max_tokens_per_turn or max_tokens, max_tokens)
        self.waiting: dict[concurrent.futures.Future, tuple[Trajectory, Callable]] = {}
        self.on_engine: dict[str, Trajectory] = {}
        self.ready: list[Trajectory] = []
        self.engine_seconds = 0.0  # inside engine.step: agentic/engine_busy_fraction
        self.agent_sessions: list[str] = []  # agent mode: one session per worker running its share
        self.breaks = 0
        self.server = rollout.server
        self.by_session = {traj.session: traj for traj in trajectories}

    def run(self) -> None:
        if self.server is not None:
            self._start_agents()
        else:
            host = self.rollout.host
            for traj in self.trajectories:
                host.open(traj.session)
                future = host.call(traj.session, "reset", traj.env_seed, traj.task, timeout_s=self._timeout())
                self._expect(traj, future, self._reset)
        while self.waiting or self.on_engine or self.ready:
            for traj in self.ready:
                self._submit(traj)
            self.ready = []
            if self.on_engine:
                started = time.perf_counter()
                finished = self.rollout.engine.step()
                self.engine_seconds += time.perf_counter() - started
                for request in finished:
                    self._replied(self.on_engine.pop(request.request_id), request)
            elif self.waiting:
                doorbell = [self.server.ring()] if self.server is not None else []
                pending = list(self.waiting) + doorbell
                concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
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
        segment = traj.conv.current
        room = min(per_turn or self.per_turn, self.max_tokens - len(segment.response_ids))
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
        if self.seed is not None:
            seed = (self.seed * 1_000_003 + traj.index * 7919 + traj.conv.turns * 104_729) % (2**31 - 1)
        self.rollout.engine.add_request(request_id, segment.context(), room, seed, self.meta_info)
        self.on_engine[request_id] = traj

    def _replied(self, traj: Trajectory, request) -> None:
        if traj.pending is not None:  # agent mode: the answer goes back to the agent's HTTP request
            text = traj.turns.add_sampled(traj.conv, request.token_ids, request.log_probs)
            payload = completion_payload(
                text,
                request.finish_reason,
                len(traj.conv.current.context()) - len(request.token_ids),
                len(request.token_ids),
            )
            traj.pending.reply.set_result((200, payload))
            traj.pending = None
            return
        text = self.rollout.turns.add_sampled(traj.conv, request.token_ids, request.log_probs)
        if traj.conv.turns >= self.config.max_turns:
            traj.truncated = True
            self._finish(traj)
            return
        future = self.rollout.host.call(traj.session, "act", text, timeout_s=self._timeout())
        self._expect(traj, future, self._acted)

    def _acted(self, traj: Trajectory, outcome: Outcome) -> None:
        traj.env_seconds += outcome.seconds
        traj.rewards.append(outcome.reward)
        traj.tool_calls += outcome.tool_calls
        traj.tool_errors += outcome.tool_errors
        if outcome.success is not None:
            traj.success = outcome.success
        if outcome.done:
            traj.terminated, traj.truncated = not outcome.truncated, outcome.truncated
            self._finish(traj)
            return
        segment = traj.conv.current
        kept = len(segment.response_ids)
        segments = len(traj.conv.segments)
        try:
            self.rollout.turns.extend(traj.conv, outcome.messages)
        except TemplateBreak as exc:
            raise TemplateBreak(f"{exc} (trajectory {traj.session})") from None
        self.breaks += len(traj.conv.segments) - segments
        if len(traj.conv.current.response_ids) > self.max_tokens:  # the inserted messages do not fit the budget
            segment.truncate(kept)
            traj.truncated = True
            self._finish(traj)
            return
        self.ready.append(traj)

    def _finish(self, traj: Trajectory) -> None:
        traj.done = True
        if traj.conv is None:  # the environment failed at reset (or the agent asked nothing): an empty row
            traj.conv = self.rollout.turns.empty()
        if self.server is None:
            self.rollout.host.close(traj.session)

    # ---- agent mode ------------------------------------------------------------------------------------------
    def _start_agents(self) -> None:
        """The agent function for every trajectory, spread over the host's workers (each runs its share at once)."""
        host, workers = self.rollout.host, self.config.workers
        for worker in range(min(workers, len(self.trajectories))):
            share = self.trajectories[worker::workers]
            session = f"{share[0].session}-agents"
            host.open(session)
            jobs = [(traj.task, self.server.base_url(traj.session)) for traj in share]
            rounds = -(-len(share) // self.config.agent.concurrency)
            timeout = self.config.agent_timeout_s * rounds + 10.0
            future = host.call(session, "run_many", jobs, self.config.agent_timeout_s, timeout_s=timeout)
            self.waiting[future] = (share, self._agents_done)
            self.agent_sessions.append(session)

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
            segments = len(traj.conv.segments)
            try:
                traj.turns.extend(traj.conv, new_messages(traj.conv.messages, messages, traj.conv.turns))
            except TemplateBreak as exc:
                request.reply.set_result((400, {"error": {"message": str(exc)}}))
                raise TemplateBreak(f"{exc} (agent trajectory {traj.session})") from None
            self.breaks += len(traj.conv.segments) - segments
        traj.pending = request
        limit = request.body.get("max_completion_tokens") or request.body.get("max_tokens") or self.per_turn
        self._submit(traj, min(int(limit), self.per_turn))

    def release(self) -> None:
        """After an error: nothing of this call stays on the engine or in the workers."""
        if self.on_engine:
            self.rollout.engine.abort_requests(list(self.on_engine))
        for traj in self.trajectories:
            if traj.pending is not None:
                traj.pending.reply.set_result((500, {"error": {"message": "the rollout stopped"}}))
            if not traj.done and self.server is None:
                self.rollout.host.close(traj.session)
        for session in self.agent_sessions:
            self.rollout.host.close(session)

    def metrics(self, seconds: float) -> dict[str, Any]:
        trajs = self.trajectories
        if not trajs:
            return {}
        reward_mode = self.config.env_reward
        successes = [
            t.success if t.success is not None else (t.terminated and t.reward(reward_mode) > 0) for t in trajs
        ]
        sampled = sum(t.conv.sampled_tokens for t in trajs)
        return {
            "agentic/success_rate": float(np.mean(successes)),
            "agentic/env_reward_mean": float(np.mean([t.reward(reward_mode) for t in trajs])),
            "agentic/turns_mean": float(np.mean([t.conv.turns for t in trajs])),
            "agentic/trajectory_tokens_mean": float(np.mean([len(t.conv.current.response_ids) for t in trajs])),
            "agentic/sampled_tokens_mean": sampled / len(trajs),
            "agentic/truncated_fraction": float(np.mean([t.truncated for t in trajs])),
            "agentic/tool_calls_count": float(sum(t.tool_calls for t in trajs)),
            "agentic/tool_errors_count": float(sum(t.tool_errors for t in trajs)),
            "agentic/env_errors_count": float(sum(t.error is not None for t in trajs)),
            "agentic/template_breaks_count": float(self.breaks),
            "agentic/env_seconds": float(sum(t.env_seconds for t in trajs)),
            "agentic/engine_busy_fraction": self.engine_seconds / max(seconds, 1e-9),
            "rollout/generate_s": seconds,
            "rollout/tokens_per_s": sampled / max(seconds, 1e-9),
        }


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


def _tasks(batch: DataProto) -> list[dict]:
    """Each prompt row as the task an environment or agent sees: prompt, answer, extra_info."""
    columns = batch.non_tensor_batch
    rows = len(batch)
    pick = lambda name, default: list(columns[name]) if name in columns else [default] * rows  # noqa: E731
    prompts, answers, extras = pick(keys.PROMPT_TEXT, ""), pick(keys.ANSWER, ""), pick(keys.EXTRA_INFO, None)
    return [
        {"prompt": _plain_prompt(p), "answer": str(a), "extra_info": dict(e) if isinstance(e, dict) else {}}
        for p, a, e in zip(prompts, answers, extras)
    ]


def _plain_prompt(prompt):
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return [dict(message) for message in prompt]
    return str(prompt)


def _env_seed(task: dict, base_seed: int | None, row: int) -> int | None:
    """A row's `extra_info.seed`, else one derived from the call's seed and the row (the n samples share it)."""
    seed = task["extra_info"].get("seed")
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return int(seed)
    return None if base_seed is None else (int(base_seed) * 31 + row) % (2**31 - 1)


def _label(config: AgenticConfig) -> str:
    if config.agent is not None:
        return f"agent {config.agent.path}:{config.agent.name}"
    if config.env is not None:
        return f"environment {config.env.label}"
    return "tools " + ", ".join(spec.label for spec in config.tools)
