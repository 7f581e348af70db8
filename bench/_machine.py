"""The machine a bench ran on, printed first by every bench, and the dtype it computes in: bf16 only where the CPU
has bf16 instructions (AVX512-BF16 or AMX), float32 elsewhere.

Without them bf16 GEMMs are emulated: on a 2-core AMD EPYC without AVX512, 1.1 GFLOP/s in bf16 against 183 in
float32 (the model's MLP shapes), so a bf16 bench that takes minutes on a bf16 CPU would take hours there.
A bench imports this as `from _machine import ...` (bench/ is the script's directory, hence on sys.path).
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass
from pathlib import Path

FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")  # /proc/cpuinfo names: AVX512 at all, bf16 dot products, AMX tiles
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class Machine:
    """The facts of this machine that move a CPU bench's figures."""

    cpu: str
    cpus: int  # os.cpu_count()
    usable_cpus: int  # the ones this process may run on (affinity, cgroup cpusets)
    flags: frozenset[str]  # the FLAGS this CPU has
    torch_capability: str  # the widest vector ISA torch's CPU kernels use, e.g. AVX2, AVX512

    @property
    def native_bf16(self) -> bool:
        return any(flag in self.flags for flag in BF16_FLAGS)

    def line(self) -> str:
        flags = ", ".join(f"{flag} {'yes' if flag in self.flags else 'no'}" for flag in FLAGS)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        return (
            f"machine: {self.cpu}, {self.cpus} CPUs ({self.usable_cpus} usable); {flags}; torch CPU kernels: "
            f"{self.torch_capability}; load average {load:.1f} at start"
        )


def this_machine() -> Machine:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flag_line = next((line.split(":", 1)[1] for line in lines if line.startswith("flags")), "")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Machine(
        cpu=cpu or platform.processor() or "unknown CPU",
        cpus=os.cpu_count() or 1,
        usable_cpus=usable,
        flags=frozenset(FLAGS) & frozenset(flag_line.split()),
        torch_capability=_torch_capability(),
    )


def _torch_capability() -> str:
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        return "unknown"


def compute_dtype(requested: str, machine: Machine) -> tuple[str, str]:
    """(dtype to run in, one line saying why). "auto": bfloat16 where the CPU has it natively, else float32."""
    if requested not in DTYPES:
        raise ValueError(f"dtype {requested!r}: choose one of {', '.join(DTYPES)}.")
    if requested == "auto":
        if machine.native_bf16:
            return "bfloat16", "dtype: bfloat16 (this CPU has native bf16)"
        return "float32", (
            "dtype: float32, not bfloat16: this CPU has neither avx512_bf16 nor amx_bf16, so bf16 would be emulated "
            "(many times slower); figures measured in bf16 elsewhere are not comparable (--dtype bfloat16 forces it)"
        )
    if requested == "bfloat16" and not machine.native_bf16:
        return (
            "bfloat16",
            "dtype: bfloat16 as asked, EMULATED on this CPU (no avx512_bf16/amx_bf16): expect a very long run",
        )
    return requested, f"dtype: {requested} as asked"


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="compute dtype (auto: bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32)",
    )


def announce(requested_dtype: str | None = None) -> str | None:
    """Print the machine line (and, for a bench that computes, the dtype line); return the dtype to use."""
    machine = this_machine()
    print(machine.line(), flush=True)
    if requested_dtype is None:
        return None
    dtype, why = compute_dtype(requested_dtype, machine)
    print(why, flush=True)
    return dtype
