"""Text environments for multi-turn rollouts: one `TextEnv` interface (GEM / gymnasium style, text in and out), an
`EnvSpec` that names where an environment comes from, and `make_env` that builds it.

Three sources, exactly one per spec (YAML `agentic.env`):
- `gem: game:GuessTheNumber-v0-easy`: an environment registered by the gem-llm library, built by
  `gem.make(id, **kwargs)` and run unchanged (GEM envs already speak text).
- `gymnasium: FrozenLake-v1`: a gymnasium env with Discrete actions and observations, wrapped by `GymTextEnv`. Keys of
  `kwargs` go to `gymnasium.make`, except the nested dict `kwargs.text`, which goes to `GymTextEnv`
  (e.g. `kwargs: {is_slippery: false, text: {instructions: false}}`).
- `path: my_env.py` (a file, or an importable module) with `name: MyEnv` (a class or factory there): built as
  `MyEnv(**kwargs)`.

A data row parametrises an episode: `reset_env` passes `{"prompt", "answer", "extra_info"}` as `options` to a reset
that accepts `options` (gymnasium style), and only the seed to one that does not (GEM's games).
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from roll_backend.agentic.sandbox import Sandbox, SandboxLimits, SandboxSettings, make_sandbox
from roll_backend.errors import UserCodeError
from roll_backend.rewards.user_functions import (
    RewardFunctionSpec,
    check_spec,
    import_user_module,
    is_file_path,
    source_file,
)

TEXT_KWARGS_KEY = "text"  # EnvSpec.kwargs[TEXT_KWARGS_KEY]: GymTextEnv's own arguments, not gymnasium.make's
SHOWN_CHARS = 120


class TextEnv(Protocol):
    """An environment with text observations and actions. `close()` is optional; `close_env` calls it if present."""

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]: ...


class EnvOutputError(UserCodeError):
    """An environment's reset() or step() returned something outside the TextEnv contract."""


@dataclass(frozen=True)
class EnvSpec:
    """Where an environment comes from: exactly one of `gem` (a gem-llm id), `gymnasium` (a gymnasium id) or `path`
    (a .py file or module) with `name` (the class or factory in it); `kwargs` go to its constructor."""

    gem: str | None = None  # a gem-llm environment id, e.g. game:GuessTheNumber-v0-easy (run unchanged)
    gymnasium: str | None = None  # a gymnasium id, e.g. FrozenLake-v1 (Discrete actions/states, through GymTextEnv)
    path: str | None = None  # your environment: a .py file (relative to the working dir) or an importable module
    name: str | None = None  # the class (or factory) in `path`
    # Constructor / gem.make / gymnasium.make arguments; for gymnasium, `text: {...}` holds GymTextEnv's own
    # (instructions, action_names, invalid_action_reward, render: board | state, goal_progress_reward).
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        given = {key: value for key, value in self._sources().items() if value is not None}
        if len(given) != 1:
            seen = " and ".join(f"{key}={value!r}" for key, value in given.items()) or "none"
            raise ValueError(
                "an environment needs exactly one of `gem` (a gem-llm id, e.g. game:GuessTheNumber-v0-easy), "
                "`gymnasium` (a gymnasium id, e.g. FrozenLake-v1) or `path` (a .py file or module, with `name`: "
                f"the class in it); got {seen}" + ("; keep one" if given else "")
            )
        if self.path is not None and not self.name:
            raise ValueError(f"environment path={self.path!r} needs `name`: the environment class (or factory) there")
        if self.name is not None and self.path is None:
            raise ValueError(f"environment name={self.name!r} needs `path`: the .py file or module that defines it")
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"environment {self.label}: kwargs={self.kwargs!r} must be a mapping of keyword arguments")

    def _sources(self) -> dict[str, str | None]:
        return {"gem": self.gem, "gymnasium": self.gymnasium, "path": self.path}

    @property
    def label(self) -> str:
        """The name messages and metrics use: `gem:<id>`, `gymnasium:<id>`, or `file_stem.Name` / `module.Name`."""
        if self.gem is not None:
            return f"gem:{self.gem}"
        if self.gymnasium is not None:
            return f"gymnasium:{self.gymnasium}"
        source = Path(self.path).stem if is_file_path(self.path) else self.path
        return f"{source}.{self.name}"

    def problems(self, where: str) -> list[str]:
        """Problems findable without running user code: unknown ids (with the closest known ones), a missing file or
        module, a name it does not define, unknown `kwargs.text` keys for the gymnasium wrapper."""
        if self.gem is not None:
            known = _gem_ids()
            if known is None:
                return [
                    f"{where}.gem={self.gem!r} needs the gem-llm package, which is not installed: pip install gem-llm"
                ]
            return _unknown_id(f"{where}.gem", self.gem, known, "gem-llm (see gem.print_envs())")
        if self.gymnasium is not None:
            import gymnasium

            found = _unknown_id(f"{where}.gymnasium", self.gymnasium, list(gymnasium.envs.registry), "gymnasium")
            return found + _text_kwargs_problems(f"{where}.kwargs.{TEXT_KWARGS_KEY}", self.kwargs)
        found = check_spec(RewardFunctionSpec(path=self.path, name=self.name), where)
        source = source_file(self.path)
        classes = _top_level_classes(source) if found and source is not None else None
        if classes is not None:  # the name is missing from a file that parses: environments are mostly classes
            found = [f"{found[0]}; classes there: {', '.join(classes) or 'none'}"]
        return found


def _gem_ids() -> list[str] | None:
    """gem-llm's registered ids; None when it is not installed. Importing gem registers its envs (~1 s, most of it
    reasoning-gym) and, as of gem-llm 0.1.0, calls logging.basicConfig(level=INFO) on the root logger."""
    try:
        from gem.envs.registration import ENV_REGISTRY
    except ImportError:
        return None
    return list(ENV_REGISTRY)


def _unknown_id(where: str, env_id: str, known: list[str], library: str) -> list[str]:
    if env_id in known:
        return []
    close = difflib.get_close_matches(env_id, known, n=5, cutoff=0.5)
    hint = f"closest: {', '.join(close)}" if close else f"{len(known)} are registered"
    return [f"{where}={env_id!r} is no environment registered by {library}; {hint}"]


def _top_level_classes(source: Path) -> list[str] | None:
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError:
        return None
    return sorted(node.name for node in tree.body if isinstance(node, ast.ClassDef))


# ---- building and calling ------------------------------------------------------------------------------------


def make_env(spec: EnvSpec, sandbox: SandboxSettings = SandboxSettings()) -> TextEnv:
    """The environment `spec` names, built fresh. Unknown ids or names raise ValueError; the environment's own code
    raising while loading or building raises UserCodeError naming `spec.label`. GEM environments run the code a
    model writes in `sandbox` (patches.gem_sandbox)."""
    problems = spec.problems("env")
    if problems:
        raise ValueError(problems[0])
    kwargs = dict(spec.kwargs)
    if spec.gem is not None:  # outside the try below: a sandbox that cannot run is not the environment's fault
        from roll_backend.patches import gem_sandbox

        gem_sandbox.apply(functools.partial(run_in_sandbox, make_sandbox(sandbox)))
    try:
        if spec.gem is not None:
            import gem

            return gem.make(spec.gem, **kwargs)
        if spec.gymnasium is not None:
            import gymnasium

            text_kwargs = kwargs.pop(TEXT_KWARGS_KEY, None) or {}
            return GymTextEnv(gymnasium.make(spec.gymnasium, **kwargs), **text_kwargs)
        module = import_user_module(spec.path)
        env = getattr(module, spec.name)(**kwargs)
    except Exception as exc:
        raise UserCodeError(
            f"building environment {spec.label} with kwargs {_clip(repr(kwargs))} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise UserCodeError(
            f"environment {spec.label} built a {type(env).__name__}, which lacks reset() or step(); an environment has "
            "reset(seed=None, options=None) -> (observation, info) and step(action) -> "
            "(observation, reward, terminated, truncated, info)"
        )
    return env


def run_in_sandbox(sandbox: Sandbox, code: str, stdin: str, timeout_s: float | None) -> tuple[bool, str, str]:
    """gem-llm's code-runner contract over `sandbox`: (success, stdout, stderr with the sandbox's error last)."""
    limits = SandboxLimits() if timeout_s is None else SandboxLimits(wall_s=float(timeout_s))
    result = sandbox.run_python(code, limits, stdin)
    return result.ok, result.stdout, result.stderr if result.ok else f"{result.stderr}\n{result.error}".lstrip("\n")


def reset_env(env: TextEnv, seed: int | None = None, task: dict | None = None, label: str | None = None):
    """env.reset(seed=seed, options=task) when its reset takes `options`, else env.reset(seed=seed); the result
    checked to be (observation: str, info: dict). `task` is the data row: {"prompt", "answer", "extra_info"}."""
    parameters = inspect.signature(env.reset).parameters.values()
    takes_options = any(p.name == "options" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    result = env.reset(seed=seed, options=task) if takes_options else env.reset(seed=seed)
    name = label or _env_name(env)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise EnvOutputError(f"environment {name}: reset() returned {_clip(repr(result))}; {_CONTRACT}")
    observation, info = result
    _check_observation(name, "reset", observation)
    _check_info(name, "reset", info)
    return observation, info


def step_env(env: TextEnv, action: str, label: str | None = None) -> tuple[str, float, bool, bool, dict]:
    """env.step(action), checked to be (observation: str, reward: finite number, terminated, truncated, info: dict)
    and returned with plain Python types."""
    result = env.step(action)
    name = label or _env_name(env)
    if not (isinstance(result, tuple) and len(result) == 5):
        raise EnvOutputError(f"environment {name}: step() returned {_clip(repr(result))}; {_CONTRACT}")
    observation, reward, terminated, truncated, info = result
    _check_observation(name, "step", observation)
    _check_info(name, "step", info)
    if hasattr(reward, "item") and getattr(reward, "ndim", 1) == 0:  # numpy scalars
        reward = reward.item()
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvOutputError(f"environment {name}: step() returned reward {reward!r}; a reward is a finite number")
    return (
        observation,
        float(reward),
        _as_flag(name, "terminated", terminated),
        _as_flag(name, "truncated", truncated),
        info,
    )


def close_env(env: TextEnv) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


_CONTRACT = (
    "reset() returns (observation: str, info: dict); step() returns (observation, reward, terminated, truncated, info)"
)


def _env_name(env) -> str:
    return getattr(env, "env_id", None) or type(env).__name__  # gem.make sets env_id


def _check_observation(name: str, method: str, observation) -> None:
    if not isinstance(observation, str):
        raise EnvOutputError(
            f"environment {name}: {method}() returned observation {_clip(repr(observation))} of type "
            f"{type(observation).__name__}; a text environment's observation is a str"
        )


def _check_info(name: str, method: str, info) -> None:
    if not isinstance(info, dict):
        raise EnvOutputError(f"environment {name}: {method}() returned info {_clip(repr(info))}; info is a dict")


def _as_flag(name: str, what: str, value) -> bool:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, numbers.Integral) and value in (0, 1):  # bool, or 0 / 1
        return bool(value)
    raise EnvOutputError(f"environment {name}: step() returned {what}={value!r}; it is a bool")


def _clip(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- gymnasium envs as text envs ----------------------------------------------------------------------------

# Keyed by the unwrapped env's class name: what the actions mean, and a one-line description of the game.
_ACTION_NAMES = {
    "FrozenLakeEnv": ("left", "down", "right", "up"),
    "CliffWalkingEnv": ("up", "right", "down", "left"),
    "TaxiEnv": ("south", "north", "east", "west", "pickup", "dropoff"),
}
_DESCRIPTIONS = {
    "FrozenLakeEnv": "Frozen lake: walk P from S to the goal G; F is ice, stepping on a hole H ends the game.",
}
RENDER_CHOICES = ("board", "state")


class GymTextEnv:
    """A gymnasium env with Discrete actions and observations as a text env. Observation: the board of a grid env
    with a `desc` (FrozenLake; the agent's cell shown as P), else `state: N`; the first one starts with a short
    instruction. Action: the last action name or index in the text; none found -> no move, `invalid_action_reward`."""

    def __init__(
        self,
        env,
        instructions: bool = True,
        action_names: Sequence[str] | None = None,
        invalid_action_reward: float = 0.0,
        render: str = "board",
        goal_progress_reward: float = 0.0,
    ):
        from gymnasium.spaces import Discrete

        if not (isinstance(env.action_space, Discrete) and isinstance(env.observation_space, Discrete)):
            raise ValueError(
                f"GymTextEnv needs Discrete action and observation spaces; {_env_id(env)} has "
                f"{env.action_space} and {env.observation_space}. Write a text env for it (agentic.env.path)"
            )
        if render not in RENDER_CHOICES:
            raise ValueError(f"GymTextEnv render={render!r}; choose one of {', '.join(RENDER_CHOICES)}")
        kind = type(env.unwrapped).__name__
        names = tuple(action_names or _ACTION_NAMES.get(kind, ()))
        if names and len(names) != env.action_space.n:
            raise ValueError(
                f"GymTextEnv action_names={list(names)} has {len(names)} names; {_env_id(env)} has "
                f"{env.action_space.n} actions"
            )
        self.env, self.instructions, self.invalid_action_reward = env, instructions, float(invalid_action_reward)
        self.action_names = tuple(name.lower() for name in names)
        self._description = _DESCRIPTIONS.get(kind, f"Environment {_env_id(env)}.")
        self._board = _board(env)  # the grid, also behind render="state" (goals, shaping)
        self._render_board = render == "board" and self._board is not None
        self._is_goal_grid = self._board is not None and (self._board == b"G").any()
        # Potential-based shaping (Ng, Harada & Russell 1999; it keeps the optimal policy): the potential of a cell is
        # 1 - its distance to G (the shortest path around the holes) / the longest such distance, and 0 once the
        # episode ended (goal or hole), so each move earns
        # `goal_progress_reward` x the potential it gains. Summed over an episode: goal_progress_reward x (1 - final
        # distance / diameter) for an episode still running at the turn limit, and nothing for one that ended (a
        # hole takes the progress back), on top of the environment's own reward.
        self.goal_progress_reward = float(goal_progress_reward)
        self._goal_distances: dict[int, int] | None = None
        if self.goal_progress_reward and not self._is_goal_grid:
            raise ValueError(f"GymTextEnv goal_progress_reward needs a grid with a goal G; {_env_id(env)} has none")
        words = [*self.action_names, *(str(i) for i in range(env.action_space.n))]
        alternatives = "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True))
        self._action_pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
        self._state = None

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """A new episode. `options` (the data row) is not passed on: gymnasium envs read their own option keys."""
        self._state, info = self.env.reset(seed=seed)
        text = self._render()
        if self.instructions:
            text = f"{self._description} Actions: {self._action_list()}. Reply with one action.\n{text}"
        return text, dict(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        index = self.parse_action(action)
        if index is None:
            text = f"Action not understood; reply with one of: {self._action_list()}.\n{self._render()}"
            return text, self.invalid_action_reward, False, False, {"invalid_action": True}
        before = self._state
        self._state, reward, terminated, truncated, info = self.env.step(self.env.action_space.start + index)
        info = {**info, "invalid_action": False}
        if self.goal_progress_reward:  # the potential of an ended episode is 0: a hole takes back the progress
            after = 1.0 if terminated else self._distance(self._state)
            reward = float(reward) + self.goal_progress_reward * (self._distance(before) - after)
        if self._is_goal_grid:
            info["success"] = bool(terminated and reward > 0)
        return self._render(), float(reward), bool(terminated), bool(truncated), info

    def parse_action(self, text: str) -> int | None:
        """The index of the last action name (case-insensitive) or action index in `text`; None if there is none."""
        matches = self._action_pattern.findall(text)
        if not matches:
            return None
        word = matches[-1].lower()
        return int(word) if word.isdigit() else self.action_names.index(word)

    def close(self) -> None:
        self.env.close()

    def _distance(self, state) -> float:
        """Moves from `state` to the goal along the shortest path around holes, as a fraction of the longest such
        path on the grid (1 where no path leads there)."""
        if self._goal_distances is None:
            self._goal_distances = _goal_distances(self._board)
        cell = int(state) - int(self.env.observation_space.start)
        longest = max(self._goal_distances.values())
        return self._goal_distances.get(cell, longest) / max(longest, 1)

    def _action_list(self) -> str:
        return ", ".join(self.action_names) if self.action_names else f"0-{self.env.action_space.n - 1}"

    def _render(self) -> str:
        state = int(self._state) - int(self.env.observation_space.start)
        if not self._render_board:
            return f"state: {state}"
        rows = [[cell.decode() for cell in row] for row in self._board]
        columns = len(rows[0])
        rows[state // columns][state % columns] = "P"
        return "\n".join("".join(row) for row in rows)


def _goal_distances(board) -> dict[int, int]:
    """Cell -> moves to the nearest G without stepping on a hole (breadth-first from the goals); holes are absent."""
    rows, columns = board.shape
    frontier = [int(r) * columns + int(c) for r, c in np.argwhere(board == b"G")]
    distances = dict.fromkeys(frontier, 0)
    while frontier:
        next_frontier = []
        for cell in frontier:
            row, column = divmod(cell, columns)
            for r, c in ((row + 1, column), (row - 1, column), (row, column + 1), (row, column - 1)):
                neighbour = r * columns + c
                if 0 <= r < rows and 0 <= c < columns and board[r, c] != b"H" and neighbour not in distances:
                    distances[neighbour] = distances[cell] + 1
                    next_frontier.append(neighbour)
        frontier = next_frontier
    return distances


def _board(env):
    """The grid of a toy-text env whose state is row * columns + column (FrozenLake), else None (Taxi's `desc` is a
    map with walls, not one cell per state)."""
    desc = getattr(env.unwrapped, "desc", None)
    if desc is None or getattr(desc, "ndim", 0) != 2 or desc.size != env.observation_space.n:
        return None
    return desc


def _env_id(env) -> str:
    return env.spec.id if env.spec is not None else type(env.unwrapped).__name__


def _text_kwargs_problems(where: str, kwargs: Mapping) -> list[str]:
    text_kwargs = kwargs.get(TEXT_KWARGS_KEY) or {}
    if not isinstance(text_kwargs, Mapping):
        return [f"{where}={text_kwargs!r} must be a mapping of GymTextEnv arguments"]
    known = [name for name in inspect.signature(GymTextEnv).parameters if name != "env"]
    unknown = sorted(set(text_kwargs) - set(known))
    return [f"{where} has unknown keys {unknown}; known: {', '.join(known)}"] if unknown else []
