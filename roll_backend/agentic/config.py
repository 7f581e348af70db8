"""The `agentic` config section: which environment, tools or agent function a multi-turn rollout runs, and its limits.

User code (environments, tools, agents) is named only through the explicit `path` + `name` fields below, and
runs in subprocesses (roll_backend.session_host), never in a rank's own process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll_backend.agentic.environments import EnvSpec
from roll_backend.agentic.sandbox.limits import SandboxSettings

ENV_REWARD_MODES = ("sum", "last")
ON_ENV_ERROR = ("end_trajectory", "raise")
ON_TEMPLATE_BREAK = ("error", "new_segment")


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: a built-in (`builtin: python | calculator`, with `kwargs`: e.g. the python
    sandbox's limits {wall_s, cpu_s, memory_mb, output_bytes, libraries, ...}), or user functions: `path` (a .py
    file or module) and `name` (a function or Tool in it)."""

    builtin: str | None = None  # python | calculator
    path: str | None = None  # a user tool: a .py file or importable module
    name: str | None = None  # the function (or Tool) in `path`
    kwargs: dict[str, Any] = field(default_factory=dict)  # the built-in's settings (python: the sandbox's limits)

    def __post_init__(self):
        if (self.builtin is None) == (self.path is None):
            raise ValueError(
                f"a tool needs exactly one of `builtin` (python, calculator) or `path` (+ `name`); got "
                f"builtin={self.builtin!r}, path={self.path!r}"
            )
        if self.path is not None and not self.name:
            raise ValueError(f"tool path={self.path!r} needs `name`: the function (or Tool) to load from it")

    @property
    def label(self) -> str:
        return self.builtin if self.builtin is not None else f"{self.path}:{self.name}"


@dataclass(frozen=True)
class AgentSpec:
    """An agent function users bring: `async def name(task, client, **kwargs)` in `path` (a .py file or module).
    `task` is {prompt, answer, extra_info}; `client` an openai.AsyncOpenAI bound to the rollout engine's loopback
    endpoint (every completion it requests is recorded as tokens). Returns a reward (a number) or None to leave
    the score to the reward functions."""

    path: str  # a .py file (relative to the working dir) or an importable module
    name: str = "run_agent"  # the async function in it
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to it after (task, client)
    concurrency: int = 16  # agents one worker process runs at once (asyncio)


@dataclass(frozen=True)
class AgenticConfig:
    """Multi-turn rollouts: an environment (`env`), tools the model calls, or an agent function (`agent`).

    Each turn samples at most `max_tokens_per_turn`; a trajectory's sampled plus inserted tokens stay within
    the run's response_length (its row width), and it ends at `max_turns`, when the environment terminates, or
    (tools without an environment) at a reply with no tool call."""

    env: EnvSpec | None = None  # where the environment comes from: gem, gymnasium or path + name
    # Several environments in one run (ROLL's env tags): name -> environment, each row's extra_info[env_key] naming
    # its own; rows without one take `env`.
    envs: dict[str, EnvSpec] = field(default_factory=dict)
    env_key: str = "env"  # the extra_info key whose value names a row's environment among `envs`
    tools: tuple[ToolSpec, ...] = ()  # each {builtin: python | calculator, kwargs} or {path, name}
    agent: AgentSpec | None = None  # an agent function that runs its own loop against the rollout's endpoint
    max_turns: int = 4  # assistant turns per trajectory
    max_tokens_per_turn: int | None = None  # None: the run's response_length
    system_prompt: str | None = None  # a system message before the first observation
    observation_template: str = "{observation}"  # how an environment observation is written as a message
    observation_role: str = "user"  # the role of observation messages
    env_reward: str = "sum"  # "sum": the environment's step rewards summed; "last": its final reward
    step_timeout_s: float = 30.0  # per environment reset/step or tool round; past it the trajectory ends
    agent_timeout_s: float = 600.0  # per agent function call (a whole trajectory)
    on_env_error: str = "end_trajectory"  # an env/tool/agent that raises or times out: end it (counted) or "raise"
    on_template_break: str = "error"  # a chat template that re-renders earlier turns: stop, or "new_segment"
    workers: int = 2  # subprocesses hosting environments, tools and agents (per rollout rank)
    # calls one worker runs at once, each in a thread and for a different trajectory: environments and tools that
    # wait (web requests, sandboxes, services) overlap; 1 for environments that are not thread-safe
    worker_threads: int = 8
    # a generate call's trajectory keeps its KV cache on the engine between turns (each turn computes only what
    # was inserted since the last); false: every turn is a new request that reuses full cached blocks only
    keep_kv_between_turns: bool = True
    sandbox: SandboxSettings = SandboxSettings()  # where model-written code runs: bubblewrap | remote | process

    def __post_init__(self):
        if self.env is None and not self.envs and not self.tools and self.agent is None:
            raise ValueError("agentic needs an `env`, `tools` or an `agent`; e.g. env: {gymnasium: FrozenLake-v1}")
        if self.agent is not None and (self.env is not None or self.envs or self.tools):
            raise ValueError(
                "agentic.agent runs its own loop (with its own tools and environment); remove agentic.env and "
                "agentic.tools, or drop the agent"
            )
        for name, value, choices in (
            ("env_reward", self.env_reward, ENV_REWARD_MODES),
            ("on_env_error", self.on_env_error, ON_ENV_ERROR),
            ("on_template_break", self.on_template_break, ON_TEMPLATE_BREAK),
        ):
            if value not in choices:
                raise ValueError(f"agentic.{name}={value!r}; choose one of {', '.join(choices)}")
        for name in ("max_turns", "workers", "worker_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"agentic.{name}={getattr(self, name)}; it must be >= 1")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ValueError(f"agentic.max_tokens_per_turn={self.max_tokens_per_turn}; it must be >= 1 (or null)")
        for name in ("step_timeout_s", "agent_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"agentic.{name}={getattr(self, name)}; it must be > 0")
        if "{observation}" not in self.observation_template:
            raise ValueError(
                f"agentic.observation_template={self.observation_template!r} has no '{{observation}}' placeholder"
            )

    def problems(self, where: str = "agentic") -> list[str]:
        """What is wrong with the named user code and ids, found without running any of it (before Ray starts)."""
        from roll_backend.agentic.tools import BUILTIN_TOOLS
        from roll_backend.rewards.user_functions import RewardFunctionSpec, check_spec

        problems = self.env.problems(f"{where}.env") if self.env is not None else []
        for name, env in self.envs.items():
            problems += env.problems(f"{where}.envs.{name}")
        for index, tool in enumerate(self.tools):
            if tool.builtin is not None and tool.builtin not in BUILTIN_TOOLS:
                problems.append(
                    f"{where}.tools[{index}].builtin={tool.builtin!r} is unknown; choose one of "
                    f"{', '.join(sorted(BUILTIN_TOOLS))} or give path + name"
                )
            elif tool.builtin == "python":
                problems += _sandbox_limit_problems(tool.kwargs, f"{where}.tools[{index}].kwargs")
            elif tool.path is not None:
                problems += check_spec(RewardFunctionSpec(path=tool.path, name=tool.name), f"{where}.tools[{index}]")
        if self.agent is not None:
            problems += check_spec(RewardFunctionSpec(path=self.agent.path, name=self.agent.name), f"{where}.agent")
        return problems


def _sandbox_limit_problems(kwargs: dict[str, Any], where: str) -> list[str]:
    """What is wrong with the python tool's sandbox limits (unknown keys, ranges, libraries not installed here)."""
    import dataclasses
    import importlib.util

    from roll_backend.agentic.sandbox import SandboxLimits

    known = [f.name for f in dataclasses.fields(SandboxLimits)]
    unknown = [key for key in kwargs if key not in known]
    if unknown:
        return [f"{where}: unknown sandbox limit(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"]
    try:
        limits = SandboxLimits(**kwargs)
    except (TypeError, ValueError) as exc:
        return [f"{where}: {exc}"]
    missing = [name for name in limits.libraries if importlib.util.find_spec(name) is None]
    if missing:
        return [f"{where}.libraries: {', '.join(missing)} not installed here; install them or drop them from the list"]
    return []
