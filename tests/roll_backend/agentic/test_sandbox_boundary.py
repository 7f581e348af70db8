"""The operating-system boundary holds against code that gets past the audit hook: each attack runs in a second,
unhooked interpreter started inside the sandbox (processes allowed), with ctypes for raw system calls, and against
the hook's own logic. Host state the code aims at (files, sockets, processes, memory) is checked from outside."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from roll_backend.agentic.sandbox import SandboxLimits, SandboxSettings, SandboxUnavailable, make_sandbox, run_python

UNHOOKED = SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512, max_processes=4, output_bytes=65536, disk_mb=16)
HELPERS = textwrap.dedent(
    """
    import ctypes, errno, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    results = {}
    def attempt(name, call):
        try:
            value = call()
            results[name] = "ok" if value is None or (isinstance(value, int) and value >= 0) else f"failed {value}"
            if isinstance(value, int) and value < 0:
                results[name] = errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
        except OSError as exc:
            results[name] = errno.errorcode.get(exc.errno, str(exc.errno))
        except Exception as exc:
            results[name] = type(exc).__name__
    def syscall(number, *args):
        return libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
    """
)
# System call numbers (the attacks use the raw calls, as native code would), for the machines the suite runs on.
SYSCALLS = {
    "x86_64": {
        "pidfd_open": 434,
        "pidfd_send_signal": 424,
        "ptrace": 101,
        "keyctl": 250,
        "io_uring_setup": 425,
        "bpf": 321,
        "setns": 308,
        "unshare": 272,
        "ioctl": 16,
        "mq_open": 240,
    },
    "aarch64": {
        "pidfd_open": 434,
        "pidfd_send_signal": 424,
        "ptrace": 117,
        "keyctl": 219,
        "io_uring_setup": 425,
        "bpf": 280,
        "setns": 268,
        "unshare": 97,
        "ioctl": 29,
        "mq_open": 180,
    },
}
NR = SYSCALLS[os.uname().machine]  # a KeyError names a machine to add here


def unhooked(attack: str, limits: SandboxLimits = UNHOOKED) -> dict:
    """Run `attack` (with HELPERS) in an interpreter the sandboxed code starts itself (no prelude, no audit hook:
    what native code sees) and return its `results`."""
    script = HELPERS + textwrap.dedent(attack) + "\nprint(json.dumps(results))"
    inner = f"subprocess.run([sys.executable, '-c', {script!r}], capture_output=True, text=True)"
    outer = f"import subprocess, sys\nsys.stdout.write({inner}.stdout)"
    result = run_python(outer, limits)
    assert result.error is None, result.as_tool_message()
    return json.loads(result.stdout)


def test_the_hosts_files_are_not_there(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    sibling = Path("/tmp") / f"roll_sandbox_sibling_{uuid.uuid4().hex}"
    sibling.mkdir()
    (sibling / "main.py").write_text("print('another sandbox')")
    paths = [
        "/etc/passwd",
        "/etc/shadow",
        str(Path(__file__).resolve()),
        str(Path.home() / ".bashrc"),
        str(secret),
        str(sibling / "main.py"),
        "/tmp/ray",
        f"/proc/{os.getpid()}/environ",
        f"/proc/{os.getppid()}/cmdline",
    ]
    found = unhooked(f"for path in {paths!r}:\n    attempt(path, lambda: open(path, 'rb').read(1) and None)")
    assert set(found.values()) == {"ENOENT"}, found
    home = str(Path.home())
    code = (
        "import json, os\n"
        f"home = os.listdir({home!r}) if os.path.isdir({home!r}) else []\n"
        "print(json.dumps([os.listdir('/'), os.listdir('/proc'), home]))"
    )
    top, processes, home_entries = json.loads(run_python(code).stdout)
    assert "work" not in top and "home" not in top
    assert str(os.getpid()) not in processes and "1" in processes  # its own pid namespace only
    interpreter_path = Path(os.path.realpath(sys.executable)).parts
    assert all(name in interpreter_path for name in home_entries), home_entries  # only the way to python


def test_sockets_of_the_host_cannot_be_reached(tmp_path):
    path = str(tmp_path / "host.sock")
    abstract = f"\0roll-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as unix, socket.socket(socket.AF_UNIX) as hidden:
        with socket.create_server(("127.0.0.1", 0)) as tcp:
            for listener, address in ((unix, path), (hidden, abstract)):
                listener.bind(address)
                listener.listen()
            for listener in (unix, hidden, tcp):
                listener.setblocking(False)
            port = tcp.getsockname()[1]
            found = unhooked(
                f"""
                import socket
                for name, family, address in (("path", socket.AF_UNIX, {path!r}), ("abstract", socket.AF_UNIX,
                        {abstract!r}), ("tcp", socket.AF_INET, ("127.0.0.1", {port}))):
                    attempt(name, lambda: socket.socket(family).connect(address))
                """
            )
            # Its own network namespace: an empty loopback, no abstract sockets of the host, no host paths.
            assert found == {"path": "ENOENT", "abstract": "ECONNREFUSED", "tcp": "ECONNREFUSED"}, found
            for listener in (unix, hidden, tcp):
                with pytest.raises(BlockingIOError):
                    listener.accept()  # nothing arrived


def test_other_processes_cannot_be_signalled_or_changed():
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid = target.pid
        found = unhooked(
            f"""
            import os, signal
            attempt("kill", lambda: os.kill({pid}, signal.SIGKILL))
            attempt("pidfd", lambda: syscall({NR["pidfd_open"]}, {pid}, 0))
            attempt("pidfd_self", lambda: syscall({NR["pidfd_open"]}, os.getpid(), 0))
            attempt("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, {pid}, 19))
            attempt("affinity", lambda: os.sched_setaffinity({pid}, {{0}}))
            attempt("ptrace", lambda: syscall({NR["ptrace"]}, 16, {pid}, 0, 0))
            """
        )
        assert found["kill"] == found["setpriority"] == found["affinity"] == "ESRCH"  # not in its pid namespace
        assert found["pidfd"] == found["pidfd_self"] == found["ptrace"] == "EPERM"  # the seccomp filter
        assert target.poll() is None and os.getpriority(os.PRIO_PROCESS, pid) == 0
    finally:
        target.kill()
        target.wait()


def test_no_devices_fifos_shared_memory_or_namespaces():
    found = unhooked(
        f"""
        import mmap, os
        attempt("mkfifo", lambda: os.mkfifo("/sandbox/fifo"))
        attempt("mknod", lambda: os.mknod("/sandbox/null", 0o600 | 0o020000, os.makedev(1, 3)))
        attempt("shm_file", lambda: open("/dev/shm/segment", "wb").write(b"x"))
        attempt("memfd", lambda: os.memfd_create("hog"))
        attempt("sysv_shm", lambda: libc.shmget(0, 1 << 30, 0o1000 | 0o600))
        attempt("unshare_user", lambda: syscall({NR["unshare"]}, 0x10000000))  # CLONE_NEWUSER
        attempt("unshare_net", lambda: syscall({NR["unshare"]}, 0x40000000))  # CLONE_NEWNET
        attempt("setns", lambda: syscall({NR["setns"]}, os.open("/proc/self/ns/net", os.O_RDONLY), 0))
        attempt("mount", lambda: libc.mount(b"none", b"/sandbox", b"tmpfs", 0, None))
        attempt("keyctl", lambda: syscall({NR["keyctl"]}, 0, 0, 0))
        attempt("io_uring", lambda: syscall({NR["io_uring_setup"]}, 8, 0))
        attempt("bpf", lambda: syscall({NR["bpf"]}, 0, 0, 0))
        attempt("chroot", lambda: os.chroot("/sandbox"))
        name = ctypes.create_string_buffer(b"queue")
        attempt("posix_mqueue", lambda: syscall({NR["mq_open"]}, ctypes.addressof(name), 0o100 | 2, 0o600, 0))
        # TIOCSTI with bits above the 32 the kernel reads (a filter comparing all 64 would let it through), TIOCLINUX
        byte = ctypes.c_char(b"x")
        for request in (0x5412, 0x1_0000_5412, 0x541C):
            attempt(f"ioctl_{{request:x}}", lambda: syscall({NR["ioctl"]}, 0, request, ctypes.addressof(byte)))
        """
    )
    assert found.pop("shm_file") == "EROFS"
    assert set(found.values()) == {"EPERM"}, found


def test_writes_stay_inside_the_capped_tmpfs():
    found = unhooked(
        """
        for path in ("/planted", "/etc/planted", "/usr/planted", "/opt/roll_sandbox/planted", "/dev/planted"):
            attempt(path, lambda: open(path, "wb").write(b"x"))
        attempt("disk", lambda: open("/sandbox/big", "wb").write(b"x" * (32 << 20)))
        attempt("tmp_disk", lambda: open("/tmp/big2", "wb").write(b"x" * (32 << 20)))
        """
    )
    assert found.pop("disk") == found.pop("tmp_disk") == "ENOSPC"  # disk_mb=16, /tmp is the same tmpfs
    assert set(found.values()) == {"EROFS"}, found
    assert not any(Path(p).exists() for p in ("/planted", "/etc/planted", "/usr/planted"))


def test_memory_is_bounded_for_native_code_too():
    found = unhooked(
        """
        import mmap
        attempt("bytearray", lambda: bytearray(1536 << 20) and None)
        attempt("mmap", lambda: mmap.mmap(-1, 1536 << 20) and None)
        """
    )
    assert found == {"bytearray": "MemoryError", "mmap": "ENOMEM"}, found


def test_the_hooks_own_logic_defeated_still_cannot_write_the_host(tmp_path):
    """Code that fools the audit hook (a str subclass, a monkeypatched os.path) writes nowhere on the host."""
    target = tmp_path / "fooled.txt"
    attacks = [
        f"import os.path\nos.path.realpath = lambda p, **k: '/sandbox/x'\nopen({str(target)!r}, 'w').write('x')",
        f"class P(str):\n    def __fspath__(self):\n        return {str(target)!r}\nopen(P('/sandbox/x'), 'w')",
        "import os\nos.getpgrp = lambda: 1\nos.kill(1, 9)\nprint('alive')",
    ]
    for code in attacks:
        run_python(code)
        assert not target.exists()
    assert run_python("print('next')").stdout == "next\n"


def test_clean_up_survives_what_the_code_leaves_behind():
    """3000 nested folders and a process that left the session: the run ends, nothing of either stays on the host."""
    marker = f"{41 + uuid.uuid4().int % 1000 / 1000:.3f}"
    found = unhooked(
        f"""
        import os, subprocess
        def nest():
            fd = os.open(".", os.O_RDONLY)
            for _ in range(3000):
                os.mkdir("d", dir_fd=fd)
                fd = os.open("d", os.O_RDONLY, dir_fd=fd)
        attempt("nest", nest)
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        attempt("daemon", lambda: subprocess.Popen(["sleep", "{marker}"], start_new_session=True, **quiet) and None)
        """
    )
    assert found == {"nest": "ok", "daemon": "ok"}
    leftovers = [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]
    assert leftovers == []


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_without_user_namespaces_tools_refuse_unless_the_weak_mode_is_named():
    """In a user namespace whose limit allows no nested ones (what a machine without unprivileged user namespaces
    gives), the bubblewrap sandbox refuses to start and names the ways out; `backend: process` runs."""
    check = textwrap.dedent(
        """
        from roll_backend.agentic.sandbox import SandboxSettings, SandboxUnavailable, make_sandbox, SandboxLimits
        try:
            make_sandbox(SandboxSettings())
            print("STARTED")
        except SandboxUnavailable as exc:
            print("REFUSED", exc)
        weak = make_sandbox(SandboxSettings(backend="process"))
        print("PROCESS", weak.run_python("print(6*7)", SandboxLimits()).stdout)
        """
    )
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c '{check}'"
    done = subprocess.run(["unshare", "-U", "-r", "--fork", "sh", "-c", script], capture_output=True, text=True)
    assert "REFUSED bubblewrap cannot make the sandbox's namespaces here" in done.stdout, done.stdout + done.stderr
    assert "agentic.sandbox.backend: remote" in done.stdout and "agentic.sandbox.backend: process" in done.stdout
    assert "PROCESS 42" in done.stdout


def test_a_missing_library_or_backend_is_named():
    with pytest.raises(SandboxUnavailable, match="sandbox.libraries names 'no_such_module_xyz'"):
        run_python("print(1)", SandboxLimits(libraries=["no_such_module_xyz"]))
    with pytest.raises(ValueError, match="backend='docker'; choose one of bubblewrap, remote, process"):
        SandboxSettings(backend="docker")
    with pytest.raises(ValueError, match="needs agentic.sandbox.url"):
        make_sandbox(SandboxSettings(backend="remote"))


def test_processes_allowed_by_the_limits_are_counted():
    """With max_processes > 0 a fork bomb stops at the cap (threads count too: the allowance beside it), under root
    through a pids cgroup (RLIMIT_NPROC does not bind root), which is gone afterwards."""
    from roll_backend.agentic.sandbox.local import THREAD_ALLOWANCE

    code = textwrap.dedent(
        """
        import subprocess
        started = 0
        try:
            for _ in range(500):
                subprocess.Popen(["sleep", "30"])
                started += 1
        except OSError as exc:
            print("refused", exc.errno)
        print(started)
        """
    )
    result = run_python(code, UNHOOKED)
    refused, started = result.stdout.split("\n")[:2]
    assert refused == "refused 11" and 0 < int(started) <= UNHOOKED.max_processes + THREAD_ALLOWANCE
    if os.geteuid() == 0:
        from roll_backend.agentic.sandbox.cgroups import _own_pids_cgroup

        assert not list(_own_pids_cgroup().glob(f"roll_sandbox_{os.getpid()}_*"))
