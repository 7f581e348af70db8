"""The seccomp filter bubblewrap installs on sandboxed code, compiled by libseccomp (through pyseccomp, a ctypes
binding of the system's libseccomp.so.2, the compiler Docker, systemd and Flatpak use).

A deny list in Flatpak's manner: everything else a Python program does stays allowed. Refused with EPERM: tracing and
reading other processes, signals through pidfds, making device nodes and fifos, new namespaces and mounts, kernel
keyrings, BPF, perf, userfaultfd, io_uring (its operations would bypass this filter), memfd, System V shared
memory and POSIX message queues (memory that no rlimit here counts), pushing input into a terminal (TIOCSTI,
TIOCLINUX: compared on the low 32 bits, as the kernel reads the request), module and kexec loading, clock and swap
changes. clone3 answers ENOSYS so that the C library falls back to clone, whose flags the filter can read; without
processes allowed, clone without CLONE_THREAD, fork and vfork are refused too (threads stay allowed). libseccomp
adds the architecture check (x32 and i386 system calls are killed).
"""

from __future__ import annotations

import errno
import functools
import logging
import tempfile

from roll_backend.agentic.sandbox.limits import SandboxUnavailable

logger = logging.getLogger(__name__)

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_open",
    "pidfd_send_signal",
    "pidfd_getfd",
    "mknod",
    "mknodat",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "memfd_create",
    "memfd_secret",
    "shmget",
    "shmat",
    "msgget",
    "semget",
    "mq_open",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "ioperm",
    "iopl",
    "personality",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "lookup_dcookie",
    "vhangup",
)
PROCESS_CREATION = ("fork", "vfork")
CLONE_THREAD = 0x00010000
CLONE_NAMESPACES = (0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x02000000)
TERMINAL_INJECTION = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX: pushing input into a terminal
LOW_32_BITS = 0xFFFFFFFF  # ioctl's request is an unsigned int: 0x1_0000_5412 reaches the kernel as TIOCSTI


@functools.cache
def filter_program(processes: bool) -> bytes:
    """The compiled BPF program (bytes for bubblewrap's --seccomp FD); built once per process and setting."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, RuntimeError) as exc:  # the binding, or the system's libseccomp.so.2, is missing
        raise SandboxUnavailable(
            f"the sandbox's seccomp filter needs libseccomp (pyseccomp over libseccomp.so.2): {exc}; install the "
            "system package libseccomp2 (Debian/Ubuntu) or libseccomp (RHEL)"
        ) from exc
    refuse = seccomp.ERRNO(errno.EPERM)
    program = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED + (() if processes else PROCESS_CREATION):
        _add(program, refuse, name)
    _add(program, seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NAMESPACES:
        program.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    if not processes:
        program.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    for request in TERMINAL_INJECTION:
        program.add_rule(refuse, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, LOW_32_BITS, request))
    with tempfile.TemporaryFile() as file:
        program.export_bpf(file)
        file.seek(0)
        return file.read()


def _add(program, action, name: str) -> None:
    try:
        program.add_rule(action, name)
    except (ValueError, RuntimeError, OSError) as exc:  # a call this architecture does not have
        logger.debug("seccomp: %s not filtered here: %s", name, exc)
