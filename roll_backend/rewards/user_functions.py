"""Reward functions users bring: loaded from a file or module (`reward.functions`) or given as a callable, and
called the way verl calls them, with a per-call deadline and errors that name the function and the row.

Per row (verl's signature, unchanged): `fn(data_source, solution_str, ground_truth, extra_info=None)`.
Batched (`batched: true`, verl's batch reward manager): `fn(data_sources, solution_strs, ground_truths,
extra_infos)` with lists, returning a list. A class (ROLL's reward workers are classes): built once per reward rank
with `kwargs`, then called per batch, `obj.compute_rewards(rows)` (a RewardRows: prompts, responses, answers,
data_sources, extra_infos) when it has that method, else the batched `obj(data_sources, ...)`. Ground truths arrive
as the data stored them (a list of tests stays a list). Each returns a number per row, or a dict whose `score` is the
reward and whose other numeric keys become metrics `reward/<label>/<key>`.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from roll_backend.errors import UserCodeError

ON_ERROR_CHOICES = ("raise", "zero")
SHOWN_CHARS = 120  # how much of a prompt / response an error message shows


@dataclass(frozen=True)
class RewardFunctionSpec:
    """One user reward: `path` (a .py file, relative to the working dir, or an importable module) and the
    function's `name` in it, or `fn`, a callable given directly from a driver script. `weight` scales it in the
    sum with the built-in rewards; `batched` says it takes lists and returns a list."""

    path: str | None = None
    name: str = "compute_score"
    weight: float = 1.0
    batched: bool = False
    fn: Any = field(default=None, compare=False)  # Python only (not from YAML): a callable, pickled to the workers
    # a class's constructor arguments, or keyword arguments a function gets on every call (verl's reward_kwargs)
    kwargs: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if (self.path is None) == (self.fn is None):
            raise ValueError(
                f"a reward function needs exactly one of `path` (a .py file or module name) or `fn` (a callable); "
                f"got path={self.path!r}, fn={self.fn!r}"
            )
        if self.fn is not None and not callable(self.fn):
            raise ValueError(f"reward function fn={self.fn!r} is not callable; pass the function itself")

    @property
    def label(self) -> str:
        """The name metrics and messages use: `file_stem.name`, `module.name`, or the callable's name."""
        if self.fn is not None:
            return getattr(self.fn, "__name__", type(self.fn).__name__)
        source = Path(self.path).stem if is_file_path(self.path) else self.path
        return f"{source}.{self.name}"


def is_file_path(path: str) -> bool:
    return path.endswith(".py") or "/" in path or os.sep in path


# ---- finding and loading the code ---------------------------------------------------------------------------


def source_file(path: str) -> Path | None:
    """The .py file behind `path` (a file, or a module found without running it); None when there is none."""
    if is_file_path(path):
        return Path(path) if Path(path).is_file() else None
    try:
        found = importlib.util.find_spec(path)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin and found.origin.endswith(".py") else None


# What a call passes a reward function (row by row, or batched), beside a spec's kwargs.
_CALL_ARGUMENTS = frozenset(
    {"data_source", "solution_str", "ground_truth", "extra_info", "data_sources", "solution_strs", "ground_truths",
     "extra_infos"}
)  # fmt: skip


def check_spec(spec: RewardFunctionSpec, where: str) -> list[str]:
    """Problems findable without running user code: the file or module exists and defines `name` at top level, and
    `kwargs` name none of the arguments every call passes."""
    passed = sorted(set(spec.kwargs) & _CALL_ARGUMENTS)
    if passed:
        return [f"{where}.kwargs names {passed}, which every call passes itself; rename them in the function"]
    if spec.fn is not None:
        return []
    source = source_file(spec.path)
    if source is None:
        kind = f"file (looked in {os.getcwd()})" if is_file_path(spec.path) else "importable module"
        return [
            f"{where}.path={spec.path!r} is no {kind}; give a .py file inside the working dir or a module on PYTHONPATH"
        ]
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError as exc:
        return [f"{where}.path={spec.path!r} does not parse: line {exc.lineno}: {exc.msg}"]
    defined = {
        node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    defined |= {
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    }
    defined |= {
        a.asname or a.name.split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for a in node.names
    }
    if spec.name not in defined:
        functions = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
        return [
            f"{where}.name={spec.name!r}: {spec.path} defines no such name; functions there: "
            f"{', '.join(functions) or 'none'}"
        ]
    return []


def load_function(spec: RewardFunctionSpec) -> Callable:
    """The callable `spec` names. Runs the user's module (in the reward worker); its errors become UserCodeError."""
    if spec.fn is not None:
        return spec.fn
    problems = check_spec(spec, "reward.functions[]")
    if problems:
        raise ValueError(problems[0])
    try:
        module = import_user_module(spec.path)
    except Exception as exc:
        raise UserCodeError(
            f"loading reward function {spec.label} from {spec.path!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, spec.name, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec.label}: {spec.path!r} has no callable named {spec.name!r}")
    return fn


# The modules this process imported for a user (import_user_module), even where that failed part-way: a rank process
# holding one is not reused for another group (rank_host.py), since the module would stay in it.
USER_MODULES: set[str] = set()


def import_user_module(path: str):
    """The module a user's `path` names (reward functions, environments, tools, agents): a .py file (imported under a
    name unique to the file, so two files may share a stem) or an importable module."""
    if not is_file_path(path):
        USER_MODULES.add(path)
        return importlib.import_module(path)
    resolved = Path(path).resolve()
    module_name = f"roll_backend_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    USER_MODULES.add(module_name)
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


# ---- calling it ---------------------------------------------------------------------------------------------


class DeadlineExceeded(Exception):
    """A user function's call ran past its deadline."""


class BadReturnValue(TypeError):
    """A user function returned something that is not a reward."""


def call_with_deadline(fn: Callable, timeout_s: float, **kwargs):
    """fn(**kwargs), failing with DeadlineExceeded after `timeout_s` seconds.

    On the main thread (a Ray actor's sync methods run there) a SIGALRM timer interrupts the call itself; on other
    threads the call runs in a helper thread that is abandoned at the deadline (Python cannot stop a thread).
    """
    if threading.current_thread() is threading.main_thread():

        def on_alarm(signum, frame):
            raise DeadlineExceeded()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn, **kwargs).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise DeadlineExceeded() from None
    finally:
        pool.shutdown(wait=False)


@dataclass
class RewardRows:
    """What a reward function sees of each row, as lists of equal length: the prompt's text (a conversation's last
    message), the response, the reference answer as the data stored it, the source, extra_info, and the whole
    conversation the model was prompted with ([] for a raw-text prompt)."""

    prompts: list[str]
    responses: list[str]
    answers: list[Any]
    data_sources: list[str]
    extra_infos: list[dict]
    messages: list[list[dict]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.responses)

    def describe(self, index: int) -> str:
        return f"row {index} (prompt {_shorten(self.prompts[index])}, response {_shorten(self.responses[index])})"


@dataclass
class FunctionScores:
    """One function's output on a batch: scores [B] float32 (0 where it failed), extra metrics, failures."""

    scores: np.ndarray
    extras: dict[str, list[float]] = field(default_factory=dict)
    error_count: int = 0


def as_score(value: Any) -> tuple[float, dict[str, float]]:
    """A function's return value -> (score, extra metrics). Raises BadReturnValue for anything but a finite
    number or a dict with a numeric `score`."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise BadReturnValue(f"returned a dict without a 'score' key (keys: {sorted(map(str, value))})")
        extras = {str(k): float(v) for k, v in value.items() if k != "score" and _is_number(v)}
        value = value["score"]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
        value = value.item()
    if not _is_number(value):
        raise BadReturnValue(f"returned {type(value).__name__} {_clip(repr(value))}")
    if not math.isfinite(float(value)):
        raise BadReturnValue(f"returned {value!r}; a reward must be a finite number")
    return float(value), extras


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


class FunctionScorer:
    """Runs one user function over rows: per row or batched, each call under `timeout_s`; failures raise a
    UserCodeError naming the function, the row and the problem, or (on_error="zero") score 0 and are counted."""

    def __init__(self, spec: RewardFunctionSpec, on_error: str = "raise", timeout_s: float = 60.0):
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"reward.on_function_error={on_error!r}; choose one of {', '.join(ON_ERROR_CHOICES)}")
        self.spec, self.on_error, self.timeout_s = spec, on_error, timeout_s
        self._fn: Callable | None = None
        self._built = False  # the spec named a class: self._fn is its instance, called per batch

    @property
    def fn(self) -> Callable:
        """The function, or a class's instance (built on first use, with the spec's kwargs)."""
        if self._fn is None:
            loaded = load_function(self.spec)
            self._built = isinstance(loaded, type)
            if not self._built and self.spec.kwargs:
                loaded = functools.partial(loaded, **self.spec.kwargs)
            if self._built:
                try:
                    loaded = loaded(**self.spec.kwargs)
                except Exception as exc:
                    built = f"{self.spec.label}({self.spec.kwargs})"
                    raise UserCodeError(f"building reward class {built} raised {type(exc).__name__}: {exc}") from exc
            self._fn = loaded
        return self._fn

    def score(self, rows: RewardRows) -> FunctionScores:
        out = FunctionScores(scores=np.zeros(len(rows), dtype=np.float32))
        if len(rows) == 0:
            return out
        if self.fn is not None and (self.spec.batched or self._built):  # (self.fn loads the code first)
            self._score_batch(rows, out)
        else:
            for index in range(len(rows)):
                self._score_row(rows, index, out)
        return out

    def _score_row(self, rows: RewardRows, index: int, out: FunctionScores) -> None:
        kwargs = dict(
            data_source=rows.data_sources[index],
            solution_str=rows.responses[index],
            ground_truth=rows.answers[index],
            extra_info=rows.extra_infos[index],
        )
        with self._failures_on(rows.describe(index), out, [index]):
            self._record(out, index, as_score(self._call(kwargs)))

    def _score_batch(self, rows: RewardRows, out: FunctionScores) -> None:
        kwargs = dict(
            data_sources=rows.data_sources,
            solution_strs=rows.responses,
            ground_truths=rows.answers,
            extra_infos=rows.extra_infos,
        )
        where = f"a batch of {len(rows)} rows (first: {rows.describe(0)})"
        values: list = []
        with self._failures_on(where, out, range(len(rows))):
            method = getattr(self.fn, "compute_rewards", None) if self._built else None
            returned = list(self._call({}, lambda: method(rows)) if method is not None else self._call(kwargs))
            if len(returned) != len(rows):
                raise BadReturnValue(
                    f"returned {len(returned)} scores for {len(rows)} rows; a batched function returns one per row"
                )
            values = returned
        for index, value in enumerate(values):
            with self._failures_on(rows.describe(index), out, [index]):
                self._record(out, index, as_score(value))

    def _call(self, kwargs: dict, fn: Callable | None = None):
        try:
            return call_with_deadline(fn or self.fn, self.timeout_s, **kwargs)
        except DeadlineExceeded:
            raise DeadlineExceeded(f"did not return within reward.function_timeout_s={self.timeout_s:g}s") from None

    @staticmethod
    def _record(out: FunctionScores, index: int, result: tuple[float, dict[str, float]]) -> None:
        score, extras = result
        out.scores[index] = score
        for key, value in extras.items():
            out.extras.setdefault(key, []).append(value)

    @contextlib.contextmanager
    def _failures_on(self, where: str, out: FunctionScores, indices):
        try:
            yield
        except UserCodeError:
            raise
        except Exception as exc:
            if self.on_error == "zero":
                out.scores[list(indices)] = 0.0
                out.error_count += len(indices)
                return
            problem = (
                str(exc)
                if isinstance(exc, (BadReturnValue, DeadlineExceeded))
                else f"raised {type(exc).__name__}: {exc}"
            )
            hint = (
                " (a reward is a finite number, or a dict with a numeric 'score')"
                if isinstance(exc, BadReturnValue)
                else ""
            )
            raise UserCodeError(
                f"reward function {self.spec.label} {problem} on {where}{hint}. Fix the function, or set "
                f"reward.on_function_error=zero to score such rows 0 (counted in reward/{self.spec.label}/error_count)"
            ) from exc


def _shorten(text: Any) -> str:
    return repr(_clip(str(text)))


def _clip(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
