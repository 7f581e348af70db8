"""patches/megatron_cpu.py: in a CPU rank process megatron-core's cuda requests land on the CPU, and only the
calls that make tensors are wrapped (every other torch op runs unhooked)."""

from __future__ import annotations

import json
import subprocess
import sys

_CHECKS = """
import json, torch
plain_add = torch.add
from roll_backend.patches import megatron_cpu
megatron_cpu.apply()
x = torch.ones(3)
print(json.dumps({
    "factory": torch.zeros(2, device="cuda").device.type,
    "device_object": torch.empty(2, device=torch.device("cuda", 0)).device.type,
    "pinned": torch.tensor([0, 1], device="cpu", pin_memory=True).tolist(),
    "new": x.new_zeros(2, device="cuda").device.type,
    "to": x.to("cuda").device.type,
    "to_dtype": str(x.to(torch.float64).dtype),
    "cuda_is_self": x.cuda() is x,
    "type": [x.type(), torch.ones(1, dtype=torch.long).type(), str(x.type(torch.float64).dtype)],
    "current_device": torch.cuda.current_device(),
    "ops_unwrapped": torch.add is plain_add,
}))
"""


def test_cuda_requests_land_on_the_cpu_and_ops_stay_unhooked():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHECKS], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "factory": "cpu",
        "device_object": "cpu",
        "pinned": [0, 1],
        "new": "cpu",
        "to": "cpu",
        "to_dtype": "torch.float64",
        "cuda_is_self": True,
        "type": ["torch.cuda.FloatTensor", "torch.cuda.LongTensor", "torch.float64"],
        "current_device": "cpu",
        "ops_unwrapped": True,
    }
