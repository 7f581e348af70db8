"""Where model-written code runs: one interface (`Sandbox.run_python(code, limits) -> SandboxResult`) over an
operating-system boundary on this machine (bubblewrap, the default), a remote SandboxFusion service, or, only when
named, a plain subprocess. Code a model writes never runs in a rank's or a tool worker's own process.
"""

from __future__ import annotations

from typing import Protocol

from roll_backend.agentic.sandbox.limits import SandboxLimits, SandboxResult, SandboxSettings, SandboxUnavailable

__all__ = [
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSettings",
    "SandboxUnavailable",
    "make_sandbox",
    "run_python",
]


class Sandbox(Protocol):
    """Runs one program; never raises for what the program does (that is the result's `error`), only
    SandboxUnavailable when the sandbox itself cannot run."""

    def run_python(self, code: str, limits: SandboxLimits, stdin: str = "") -> SandboxResult: ...


class LocalSandbox:
    """A fresh process on this machine per run: inside bubblewrap, or (backend: process) a plain subprocess."""

    def __init__(self, backend: str = "bubblewrap"):
        from roll_backend.agentic.sandbox import bubblewrap, seccomp

        self.backend = backend
        if backend == "bubblewrap":  # refuse now, not at the first call: tools that cannot be contained do not start
            bubblewrap.check_available()
            bubblewrap.interpreter()
            seccomp.filter_program(processes=False)

    def run_python(self, code: str, limits: SandboxLimits, stdin: str = "") -> SandboxResult:
        from roll_backend.agentic.sandbox.local import run_python as run_local

        return run_local(code, limits, self.backend, stdin)


def make_sandbox(settings: SandboxSettings = SandboxSettings()) -> Sandbox:
    """The sandbox `settings` name; SandboxUnavailable (saying why and what to set) when it cannot run here."""
    if settings.backend == "remote":
        from roll_backend.agentic.sandbox.remote import RemoteSandbox

        return RemoteSandbox(settings)
    return LocalSandbox(settings.backend)


def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), settings: SandboxSettings = SandboxSettings(), stdin: str = ""
) -> SandboxResult:
    """Run `code` once (reading `stdin`) in the sandbox `settings` name (for your own environments and tools)."""
    return make_sandbox(settings).run_python(code, limits, stdin)
