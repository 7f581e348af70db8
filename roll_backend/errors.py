"""Errors the whole package shares. `NotRestartableError`: raise it (or a subclass) for a problem that an automatic
restart cannot fix (bad config or data, a user function raising, a failed weight-sync probe); the restart
supervisor (pipelines/services/recovery.py) then stops the run with its message instead of restarting."""

from __future__ import annotations


class NotRestartableError(RuntimeError):
    """A run-stopping error: restarting from the last checkpoint would hit it again.

    Raised on the driver or inside a rank (the rank's wrapper keeps the class, so the driver still sees it)."""


class UserCodeError(NotRestartableError):
    """Code the user brought (a reward function) raised, returned something that is not a reward, or ran past its
    deadline. The message names the function, the row and the problem; the driver sees this type."""


class WeightSyncFailed(RuntimeError):
    """A weight sync that failed part-way; the message says which version the engine serves now. `restored`: the
    engine reloaded what it had changed and serves its old version again, whole (False: its weights are mixed)."""

    def __init__(self, message: str, restored: bool):
        super().__init__(message)
        self.restored = restored

    def __reduce__(self):  # (pickled across processes with both arguments)
        return type(self), (str(self), self.restored)
