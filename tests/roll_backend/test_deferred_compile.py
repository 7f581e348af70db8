"""patches/deferred_compile.py: importing roll_backend's batch and a Megatron rank's libraries leaves torch's
compiler unimported, and what tensordict and megatron-core asked of it still happens, when it is needed."""

from __future__ import annotations

import json
import subprocess
import sys

# tensordict's Dynamo marks, as Dynamo sees them once imported: which of tensordict.utils' functions are allowed in
# graphs and which are marked constant.
_MARKS = """
import torch._dynamo
from torch._dynamo import trace_rules
import tensordict.utils as utils

functions = {name: value for name, value in vars(utils).items() if callable(value)}
marks = {
    "allowed": sorted(n for n, f in functions.items() if id(f) in trace_rules._allowed_callable_ids),
    "constant": sorted(n for n, f in functions.items() if getattr(f, "_dynamo_marked_constant", False)),
}
"""

_THROUGH_ROLL_BACKEND = f"""
import json, sys
import roll_backend.protocol
from roll_backend.patches import megatron_cpu
megatron_cpu.apply()
from megatron.core.models.gpt import GPTModel
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
import megatron.core.jit
import torch
before = [name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules]

compiled = []
real_compile = torch.compile
def recording_compile(fn, **options):
    compiled.append(fn.__name__)
    return real_compile(fn, backend="eager", **options)
torch.compile = recording_compile
x, bias = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8)
fused = bias_swiglu_impl(x, bias)
first, second = (x + bias).chunk(2, -1)
{_MARKS}
print(json.dumps({{
    "loaded_before_use": before,
    "jit_fuser": megatron.core.jit.jit_fuser.__name__,
    "compiled_at_first_call": compiled,
    "swiglu_error": (fused - torch.nn.functional.silu(first) * second).abs().max().item(),
    **marks,
}}))
"""

_PLAIN = f"""
import json
import tensordict
{_MARKS}
print(json.dumps(marks))
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_compiler_waits_for_use_and_every_mark_is_made():
    deferred, plain = _run(_THROUGH_ROLL_BACKEND), _run(_PLAIN)
    assert deferred["loaded_before_use"] == []
    assert deferred["jit_fuser"] == "compile_on_first_call"
    # megatron's fused SwiGLU went through torch.compile at its first call, with the eager math's result
    assert deferred["compiled_at_first_call"] and deferred["swiglu_error"] < 1e-6
    assert plain["allowed"] and plain["constant"]  # (tensordict does mark something: the comparison can fail)
    assert {key: deferred[key] for key in ("allowed", "constant")} == plain
