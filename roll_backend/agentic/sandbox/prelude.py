"""What the sandboxed interpreter runs before the user's code: OS limits, then an audit hook, then `main.py`.

Started by `sandbox.local.run_python` as `python -I prelude.py '<config json>'` inside the sandbox directory.
Standard library only (it runs isolated and imports nothing from roll_backend). The audit hook is a Python-level
guard, a second layer with clear messages; the boundary is bubblewrap's (sandbox/bubblewrap.py).
"""

import builtins
import functools
import importlib.machinery
import json
import os
import resource
import signal
import sys
import traceback
import types

MAIN_FILE = "main.py"
# Modules that run native code on demand (ctypes, cffi), start interpreters without this hook, or poke at memory.
NATIVE_MODULES = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
NETWORK_EVENTS = {
    "socket.bind",
    "socket.connect",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
}
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen"}
CTYPES_EVENTS = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITABLE_DEVICES = {"/dev/null"}
AF_UNIX = 1  # Linux; a Unix socket pair is local (asyncio's self-pipe), and connecting one is still refused


class SandboxViolation(PermissionError):
    """An operation the sandbox blocks; the parent finds this name's line in a failed run's stderr."""


class SandboxBlockedImport(ImportError):
    """A module the sandbox does not offer (an ImportError, so `try: import x except ImportError` still works)."""


def apply_limits(limits: dict) -> None:
    """Set the rlimits the parent computed (soft, hard), before any user code runs."""
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    # Past RLIMIT_FSIZE a write then fails with EFBIG (an OSError the code sees) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def block_process_creation() -> None:
    """Close the one process-starting door that raises no audit event: `_posixsubprocess.fork_exec` (used by
    multiprocessing). It is imported now, before the hook, so a later fresh import is an event the hook refuses."""
    import _posixsubprocess

    def fork_exec(*args, **kwargs):
        raise SandboxViolation("starting processes is blocked in the sandbox: _posixsubprocess.fork_exec")

    _posixsubprocess.fork_exec = fork_exec


class Guard:
    """The audit hook: refuses network, process creation, native code and writes outside `root`."""

    def __init__(self, root: str, network: bool, processes: bool):
        self.root = os.path.realpath(root)
        self.processes = processes
        self.checks = {"import": self.check_import, "os.chdir": self.check_chdir, "open": self.check_open}
        for event in CTYPES_EVENTS:
            self.checks[event] = self.refuse_ctypes
        for event in ("resource.setrlimit", "resource.prlimit"):
            self.checks[event] = self.refuse_rlimit
        for event in ("os.kill", "os.killpg"):
            self.checks[event] = self.check_signal
        if not network:
            self.checks.update({event: functools.partial(self.refuse_network, event) for event in NETWORK_EVENTS})
            self.checks["socket.__new__"] = self.check_socket
        if not processes:
            self.checks.update(dict.fromkeys(PROCESS_EVENTS, self.refuse_process))
        self.checks.update(
            {
                "os.remove": self.writes_at(0, dir_fd=1),
                "os.rmdir": self.writes_at(0, dir_fd=1),
                "os.mkdir": self.writes_at(0, dir_fd=2),
                "os.rename": self.writes_at(0, 1, dir_fd=2, dst_dir_fd=3),
                "os.link": self.writes_at(0, 1, dir_fd=2, dst_dir_fd=3),
                "os.symlink": self.writes_at(1, dir_fd=2),
                "os.truncate": self.writes_at(0),
                "os.chmod": self.writes_at(0, dir_fd=2),
                "os.chown": self.writes_at(0, dir_fd=3),
                "os.utime": self.writes_at(0, dir_fd=3),
                "os.setxattr": self.writes_at(0),
                "os.removexattr": self.writes_at(0),
                "shutil.rmtree": self.writes_at(0, dir_fd=1),
            }
        )

    def __call__(self, event: str, args: tuple) -> None:
        check = self.checks.get(event)
        if check is not None:
            check(args)

    # -- paths ---------------------------------------------------------------------------------------------------

    def resolve(self, path, dir_fd=None) -> str | None:
        """The real path an event's `path` names (None for an fd: it was opened through a checked call)."""
        if isinstance(path, int) or path is None:
            return None
        base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
        return os.path.realpath(os.path.join(base, os.fsdecode(path)))

    def inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)

    def check_write(self, path, dir_fd=None) -> None:
        real = self.resolve(path, dir_fd)
        if real is not None and not self.inside(real) and real not in WRITABLE_DEVICES:
            raise SandboxViolation(f"writing outside the sandbox directory is blocked: {real}")

    def writes_at(self, *positions: int, dir_fd: int | None = None, dst_dir_fd: int | None = None):
        """A check for an event whose args at `positions` are paths written (dir_fd args at the given indices)."""

        def check(args: tuple) -> None:
            for number, position in enumerate(positions):
                fd_index = dir_fd if number == 0 else dst_dir_fd
                fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
                self.check_write(args[position], fd if isinstance(fd, int) and fd >= 0 else None)  # <0: the cwd

        return check

    def check_open(self, args: tuple) -> None:
        path, mode, flags = args
        writing = bool(flags & WRITE_FLAGS) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
        if writing:
            self.check_write(path)
            return
        real = self.resolve(path)
        # A directory fd outside would let `os.open(name, dir_fd=fd)` write past the path check (no dir_fd in "open").
        if real is not None and not self.inside(real) and os.path.isdir(real):
            raise SandboxViolation(f"opening directories outside the sandbox directory is blocked: {real}")

    def check_chdir(self, args: tuple) -> None:
        if self.resolve(args[0]) != self.root:
            raise SandboxViolation("changing directory is blocked in the sandbox (the code runs in its directory)")

    # -- everything else -----------------------------------------------------------------------------------------

    def check_import(self, args: tuple) -> None:
        name, filename = args[0], args[1]
        if name.split(".")[0] in NATIVE_MODULES or (name == "_posixsubprocess" and not self.processes):
            raise SandboxBlockedImport(f"module {name!r} is blocked in the sandbox (native code or processes)")
        native = isinstance(filename, str) and filename.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
        if native and self.inside(os.path.realpath(filename)):
            raise SandboxBlockedImport(f"loading native code from the sandbox directory is blocked: {filename}")

    def check_socket(self, args: tuple) -> None:
        family = args[1]
        if family not in (-1, AF_UNIX):
            raise SandboxViolation(f"network access is blocked in the sandbox: socket family {family}")

    def check_signal(self, args: tuple) -> None:
        target = args[0]
        if target not in (0, os.getpid(), os.getpgrp(), -os.getpgrp()):
            raise SandboxViolation(f"signalling other processes is blocked in the sandbox: {target}")

    def refuse_network(self, event: str, args: tuple) -> None:
        # socket.connect/bind/sendto/sendmsg pass (socket, address, ...); the name lookups pass (host, ...).
        target = args[1] if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg") else args[0]
        raise SandboxViolation(f"network access is blocked in the sandbox ({event} {target!r:.100})")

    def refuse_process(self, args: tuple) -> None:
        raise SandboxViolation("starting processes is blocked in the sandbox")

    def refuse_ctypes(self, args: tuple) -> None:
        raise SandboxViolation("native calls through ctypes are blocked in the sandbox")

    def refuse_rlimit(self, args: tuple) -> None:
        raise SandboxViolation("changing resource limits is blocked in the sandbox")


def run_main(guard: Guard) -> int:
    """Compile and run main.py as `__main__` (a fresh module) under the hook; returns the exit code."""
    with open(MAIN_FILE, encoding="utf-8") as file:
        source = file.read()
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = MAIN_FILE, builtins
    sys.modules["__main__"] = module
    sys.argv = [MAIN_FILE]
    sys.addaudithook(guard)
    try:
        exec(compile(source, MAIN_FILE, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # shown like Python shows it, without this prelude's frames
        shown = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        hide_prelude_frames(shown, set())
        sys.stderr.writelines(shown.format())
        return 1
    return 0


def hide_prelude_frames(shown: traceback.TracebackException, seen: set[int]) -> None:
    """Drop this file's frames (the exec call, the audit hook) from a traceback and the ones chained to it."""
    if id(shown) in seen:
        return
    seen.add(id(shown))
    kept = [frame for frame in shown.stack if frame.filename != __file__]
    shown.stack = traceback.StackSummary.from_list(kept)
    for chained in (shown.__cause__, shown.__context__):
        if chained is not None:
            hide_prelude_frames(chained, seen)


def main() -> None:
    config = json.loads(sys.argv[1])
    if config.get("stdin"):  # the run's input: what the code reads from standard input (fd 0, for native reads too)
        given = os.open(config["stdin"], os.O_RDONLY)
        os.dup2(given, 0)
        os.close(given)
    apply_limits(config["limits"])
    if not config["processes"]:
        block_process_creation()
    for stream in (sys.stdout, sys.stderr):  # what was printed before a kill still reaches the parent
        stream.reconfigure(line_buffering=True, errors="backslashreplace")
    guard = Guard(os.getcwd(), network=config["network"], processes=config["processes"])
    code = run_main(guard)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
