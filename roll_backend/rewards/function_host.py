"""User reward functions run in a child process of the reward rank, never in the rank's own process.

The child is a session of session_host.SessionHost (a forkserver child, as environments get): it loads the user's
modules and runs each function under `reward.function_timeout_s` per call as before (user_functions.FunctionScorer).
What the rank's process could not do itself: a function stuck in native code (a C library's loop, a deadlock) is
killed at the batch's deadline with everything it started, and one that exits or crashes ends its child, not the
rank; either way the failure names the function, and the next batch gets a fresh child. The rank imports no user
code, so the rank pool can hand its process to the next group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from ray import cloudpickle  # a driver's callable (`fn=`) travels by value, as Ray sent it to the rank

from roll_backend.errors import UserCodeError
from roll_backend.rewards.user_functions import FunctionScorer, FunctionScores, RewardFunctionSpec, RewardRows
from roll_backend.session_host import SessionError, SessionHost

_SESSION = "reward functions"
LOAD_DEADLINE_S = 300.0  # importing a function's module and building its class (which may import torch, a model ...)
# A batch's deadline beyond its calls' own (`function_timeout_s` each): the rows and scores crossing the pipe.
_BATCH_MARGIN_S = 2.0


@dataclass(frozen=True)
class _Failure:
    """A UserCodeError inside the child, sent back as its message (the user's exception may not pickle)."""

    message: str


class _Scorers:
    """The child's side: one FunctionScorer per spec, each loading its code at its first call."""

    def __init__(self, pickled_specs: bytes, on_error: str, timeout_s: float):
        self.scorers = [FunctionScorer(spec, on_error, timeout_s) for spec in cloudpickle.loads(pickled_specs)]

    def load(self, index: int) -> _Failure | None:
        try:
            self.scorers[index].fn  # noqa: B018 (imports the module, builds a class)
        except UserCodeError as exc:
            return _Failure(str(exc))
        return None

    def score(self, index: int, rows: RewardRows) -> FunctionScores | _Failure:
        try:
            return self.scorers[index].score(rows)
        except UserCodeError as exc:
            return _Failure(str(exc))


class RewardFunctionProcess:
    """The rank's side: `score(index, rows)` runs `specs[index]` over `rows` in the child, started at the first call.
    `on_error` as FunctionScorer's; a child killed at its deadline or dead scores the batch's rows 0 under "zero"."""

    def __init__(self, specs: tuple[RewardFunctionSpec, ...], on_error: str, timeout_s: float):
        self.specs, self.on_error, self.timeout_s = tuple(specs), on_error, timeout_s
        self._host: SessionHost | None = None
        self._loaded: set[int] | None = None  # the functions loaded in the open session; None: no session

    def score(self, index: int, rows: RewardRows) -> FunctionScores:
        if len(rows) == 0:
            return FunctionScores(scores=np.zeros(0, dtype=np.float32))
        deadline_s = self.timeout_s * len(rows) + _BATCH_MARGIN_S  # (a batched function makes one call)
        try:
            if index not in self._session():
                self._answer(self._host.call(_SESSION, "load", index, timeout_s=LOAD_DEADLINE_S))
                self._loaded.add(index)
            return self._answer(self._host.call(_SESSION, "score", index, rows, timeout_s=deadline_s))
        except SessionError as exc:
            if index in (self._loaded or ()):
                what = f"did not finish a batch of {len(rows)} rows within {deadline_s:g}s (reward.function_timeout_s"
                what += f"={self.timeout_s:g} per call, stuck where Python cannot interrupt it)"
            else:
                what = f"was not loaded within {LOAD_DEADLINE_S:g}s"
            # Its child is gone (a fresh one takes its place) or the session is spoilt: the next batch opens another.
            if self._loaded is not None:  # (an open that failed left no session to close)
                self._host.close(_SESSION)
            self._loaded = None
            return self._lost(self.specs[index], rows, exc, what)

    def shutdown(self) -> None:
        """Stop the child (and what the user's code started in it)."""
        if self._host is not None:
            self._host.shutdown()
            self._host, self._loaded = None, None

    def _session(self) -> set[int]:
        """The indices of the functions loaded in the session, opened (and the child started) where there is none."""
        if self._host is None:
            factory = functools.partial(_Scorers, cloudpickle.dumps(self.specs), self.on_error, self.timeout_s)
            self._host = SessionHost(factory, num_workers=1, label="reward functions")
        if self._loaded is None:
            self._host.open(_SESSION).result()  # (builds the scorers; no user code runs before its first call)
            self._loaded = set()
        return self._loaded

    @staticmethod
    def _answer(future):
        result = future.result()
        if isinstance(result, _Failure):
            raise UserCodeError(result.message)
        return result

    def _lost(self, spec: RewardFunctionSpec, rows: RewardRows, error: SessionError, late: str):
        """Rows scored 0 under on_error="zero", else the UserCodeError; `late`: what a timeout means here."""
        if self.on_error == "zero":
            return FunctionScores(scores=np.zeros(len(rows), dtype=np.float32), error_count=len(rows))
        if error.kind == "timeout":
            problem = f"{late}, so its process was killed"
        elif error.kind == "raised":  # (what FunctionScorer does not catch: SystemExit, KeyboardInterrupt)
            problem = f"raised {error.cause.splitlines()[0]}"
        else:
            problem = f"ended its process ({error.cause})"
        raise UserCodeError(
            f"reward function {spec.label} {problem}; first row: {rows.describe(0)}. Fix the function, or set "
            f"reward.on_function_error=zero to score such rows 0 (counted in reward/{spec.label}/error_count)"
        ) from error
