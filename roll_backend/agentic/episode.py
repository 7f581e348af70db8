"""One trajectory's environment side, run inside a session_host worker process (never in a rank's own): the environment
(if any) and the tools, turning each sampled reply into the messages that follow it.

A reply with tool calls (and tools configured) runs the tools and answers with one tool message per call; any other
reply is the environment's action. Without an environment, a reply with no tool call ends the trajectory.
The environment is the one the row names (`envs` by extra_info[env_key], ROLL's env tags), else `env`. Stateful
tools (verl's create / execute / calc_reward / release) get an instance per trajectory, created at reset with the
row's `extra_info.tools_kwargs[tool].create_kwargs`, released when the trajectory ends; their reward joins the
trajectory's.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from roll_backend.agentic.config import ToolSpec
from roll_backend.agentic.environments import EnvSpec, make_env, reset_env, step_env
from roll_backend.agentic.sandbox import SandboxLimits, SandboxSettings, make_sandbox
from roll_backend.agentic.tools import (
    BUILTIN_TOOLS,
    PythonCodeTool,
    ToolBox,
    is_stateful,
    load_user_tools,
    parse_tool_calls,
)


@dataclass(frozen=True)
class EpisodeSpec:
    """What a worker needs to build an Episode (picklable)."""

    env: EnvSpec | None
    tools: tuple[ToolSpec, ...] = ()
    envs: tuple[tuple[str, EnvSpec], ...] = ()  # named environments, one chosen per row by extra_info[env_key]
    env_key: str = "env"
    tool_timeout_s: float = 30.0
    observation_template: str = "{observation}"
    observation_role: str = "user"
    sandbox: SandboxSettings = SandboxSettings()


@dataclass
class Outcome:
    """What followed one reply: messages to append, the environment's reward, whether the trajectory ended."""

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    success: bool | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_reward: float = 0.0  # the stateful tools' reward so far (absolute, not a step's)
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def build_tools(specs: tuple[ToolSpec, ...], sandbox: SandboxSettings = SandboxSettings()) -> list:
    tools = []
    for spec in specs:
        if spec.builtin is not None:
            if spec.builtin not in BUILTIN_TOOLS:
                raise ValueError(f"unknown built-in tool {spec.builtin!r}; known: {', '.join(sorted(BUILTIN_TOOLS))}")
            if spec.builtin == "python":  # its kwargs are the sandbox's limits
                tools.append(PythonCodeTool(SandboxLimits(**spec.kwargs), make_sandbox(sandbox)))
            else:
                tools.append(BUILTIN_TOOLS[spec.builtin](**spec.kwargs))
        else:
            tools.extend(load_user_tools(spec.path, [spec.name], spec.kwargs))
    return tools


class Episode:
    """An environment and/or tools for one trajectory."""

    def __init__(self, spec: EpisodeSpec):
        self.spec = spec
        self.env = make_env(spec.env, spec.sandbox) if spec.env is not None and not spec.envs else None
        self.instance_id = uuid.uuid4().hex  # this trajectory's instance of each stateful tool
        tools = build_tools(spec.tools, spec.sandbox) if spec.tools else []
        self.toolbox = ToolBox(tools, spec.tool_timeout_s, instance_id=self.instance_id) if tools else None
        self.created: list = []  # stateful tools with an instance for this trajectory

    def tool_schemas(self) -> list[dict]:
        """The tools' JSON schemas for the chat template (asked of a worker: loading user tools runs their code)."""
        return self.toolbox.schemas() if self.toolbox is not None else []

    def reset(self, seed: int | None, task: dict) -> Outcome:
        """The first messages: the environment's first observation (none without an environment); the stateful
        tools' instances are created with the row's arguments."""
        started = time.perf_counter()
        self._create_tools(task.get("extra_info") or {})
        if self.spec.envs:
            self.env = self._row_env(task.get("extra_info") or {})
        if self.env is None:
            return Outcome(tool_reward=self._tool_reward(), seconds=time.perf_counter() - started)
        observation, info = reset_env(self.env, seed, task)
        return Outcome(
            messages=[self._observation(observation)],
            info=_plain(info),
            tool_reward=self._tool_reward(),
            seconds=time.perf_counter() - started,
        )

    def _row_env(self, extra_info: dict):
        """The environment the row names by extra_info[env_key], else `env`; ValueError naming the choices."""
        named = dict(self.spec.envs)
        choice = extra_info.get(self.spec.env_key)
        if choice is None and self.spec.env is not None:
            return make_env(self.spec.env, self.spec.sandbox)
        if choice not in named:
            raise ValueError(
                f"the row's extra_info[{self.spec.env_key!r}]={choice!r} names no environment of agentic.envs "
                f"({', '.join(named)}){'' if self.spec.env is not None else ' and agentic.env is unset'}"
            )
        return make_env(named[choice], self.spec.sandbox)

    def _create_tools(self, extra_info: dict) -> None:
        arguments = extra_info.get("tools_kwargs") or {}
        for tool in self.toolbox.tools.values() if self.toolbox is not None else ():
            if is_stateful(tool):
                tool.create(self.instance_id, **(arguments.get(tool.name) or {}).get("create_kwargs", {}))
                self.created.append(tool)

    def _tool_reward(self) -> float:
        return float(
            sum(tool.reward(self.instance_id) for tool in self.created if callable(getattr(tool, "reward", None)))
        )

    def act(self, reply: str) -> Outcome:
        started = time.perf_counter()
        calls, parse_errors = parse_tool_calls(reply) if self.toolbox is not None else ([], [])
        if calls or parse_errors:
            outcome = self._run_tools(calls, parse_errors)
        elif self.env is None:
            outcome = Outcome(done=True)  # the final answer
        else:
            observation, reward, terminated, truncated, info = step_env(self.env, reply)
            done = bool(terminated or truncated)
            outcome = Outcome(
                messages=[] if done else [self._observation(observation)],
                reward=float(reward),
                done=done,
                truncated=bool(truncated) and not terminated,
                success=info.get("success") if isinstance(info.get("success"), bool) else None,
                info=_plain(info),
            )
        outcome.tool_reward = self._tool_reward()
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _run_tools(self, calls, parse_errors) -> Outcome:
        messages = [{"role": "tool", "content": f"error: {error}"} for error in parse_errors]
        errors = len(parse_errors)
        for call in calls:
            result = self.toolbox.execute(call)
            errors += int(result.error)
            messages.append({"role": "tool", "name": call.name, "content": result.content})
        return Outcome(messages=messages, tool_calls=len(calls) + len(parse_errors), tool_errors=errors)

    def _observation(self, observation: str) -> dict:
        content = self.spec.observation_template.replace("{observation}", str(observation))
        return {"role": self.spec.observation_role, "content": content}

    def close(self) -> None:
        for tool in self.created:
            if callable(getattr(tool, "release", None)):
                tool.release(self.instance_id)
        self.created = []
        if self.env is not None and hasattr(self.env, "close"):
            self.env.close()


def _plain(info: Any) -> dict:
    """The numbers, strings and flags of an env's info dict (it travels back between processes)."""
    if not isinstance(info, dict):
        return {}
    return {str(k): v for k, v in info.items() if isinstance(v, (bool, int, float, str))}
