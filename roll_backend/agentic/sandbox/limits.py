"""What a sandboxed run may use (`SandboxLimits`), where it runs (`SandboxSettings`), and what came back
(`SandboxResult`): the types every sandbox backend shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("bubblewrap", "remote", "process")
STDERR_TAIL_CHARS = 2000  # how much of stderr a tool message shows


class SandboxUnavailable(RuntimeError):
    """The configured sandbox cannot be built on this machine (or reached): tools that run code do not start."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use. `max_processes=0`: the code may not start processes at all. `libraries`:
    the installed top-level modules (beyond the standard library) the code may import, e.g. [numpy, sympy, mpmath]."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512  # address space (RLIMIT_AS), so virtual memory: the interpreter itself takes ~30 MB
    max_processes: int = 0
    output_bytes: int = 8192  # per stream (stdout, stderr); past it the run is stopped
    network: bool = False
    file_mb: int = 64  # the largest file the code may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # all files the code writes together (its private tmpfs)
    libraries: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "libraries", tuple(self.libraries))
        problems = []
        for name, low in (("wall_s", 0.0), ("cpu_s", 0.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
                problems.append(f"sandbox.{name}={value!r} must be a positive number of seconds")
        for name, low, hint in (
            ("memory_mb", 64, "the interpreter alone needs ~30 MB of address space; give at least 64"),
            ("max_processes", 0, "0 forbids starting processes; give a count >= 0"),
            ("output_bytes", 1, "give the bytes of stdout/stderr a tool message may carry, >= 1"),
            ("file_mb", 0, "give the largest file size in MB, >= 0"),
            ("disk_mb", 1, "give the MB all the code's files may take together, >= 1"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"sandbox.{name}={value!r} is out of range; {hint}")
        if not isinstance(self.network, bool):
            problems.append(f"sandbox.network={self.network!r} must be true or false")
        bad = [name for name in self.libraries if not (isinstance(name, str) and name.isidentifier())]
        if bad:
            problems.append(f"sandbox.libraries has {bad!r}; give top-level module names such as numpy or sympy")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class SandboxSettings:
    """Where model-written code runs (`agentic.sandbox`).

    - bubblewrap (default): a local process in new user, pid, mount, network, ipc and uts namespaces with a read-only
      minimal root, a size-capped tmpfs, a seccomp filter and rlimits (sandbox/bubblewrap.py). Needs unprivileged
      user namespaces; without them tools refuse to start and say so.
    - remote: a SandboxFusion-compatible service at `url` (POST {url}/run_code), as verl uses.
    - process: a plain subprocess with rlimits and the audit hook only: NO operating-system boundary. For code you
      trust, on machines where namespaces are not allowed; it must be named to be used.
    """

    backend: str = "bubblewrap"  # bubblewrap (an OS boundary here) | remote (SandboxFusion) | process (no boundary)
    url: str | None = None  # remote: the service's base address, e.g. http://127.0.0.1:8080
    request_timeout_s: float = 30.0  # remote: past the run's wall_s, how long the request may take in all
    max_concurrent: int = 8  # remote: requests one process sends at once

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"agentic.sandbox.backend={self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.backend == "remote" and not self.url:
            raise ValueError(
                "agentic.sandbox.backend=remote needs agentic.sandbox.url (a SandboxFusion service, e.g. "
                "http://127.0.0.1:8080)"
            )
        if self.url is not None and not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"agentic.sandbox.url={self.url!r} must start with http:// or https://")
        if not self.request_timeout_s > 0 or self.max_concurrent < 1:
            raise ValueError(
                f"agentic.sandbox.request_timeout_s={self.request_timeout_s!r} must be > 0 and "
                f"max_concurrent={self.max_concurrent!r} >= 1"
            )


@dataclass
class SandboxResult:
    """One run: its (capped) output, exit code (negative: the signal that ended it; None: the supervisor stopped
    it), wall time, and `error`: None on success, else a short message for the model."""

    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_tool_message(self) -> str:
        """What the model sees: stdout, then the error and the tail of stderr. Bounded by the output cap."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.error is not None:
            parts.append(f"Error: {self.error}")
        stderr = self.stderr.rstrip("\n")
        if stderr:
            tail = stderr if len(stderr) <= STDERR_TAIL_CHARS else "..." + stderr[-STDERR_TAIL_CHARS:]
            parts.append(f"stderr:\n{tail}")
        return "\n".join(parts) if parts else "(no output)"
