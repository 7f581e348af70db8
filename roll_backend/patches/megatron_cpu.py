"""CPU compatibility layer for megatron-core 0.16.x: lets Megatron run on CPU tensors with gloo.

Applied in each rank process only when the device is CPU (never on GPU machines). Two parts:
- `apply()`: process-wide patches of the CUDA-only calls Megatron makes (idempotent);
- `cpu_device_mode()`: a per-thread TorchFunctionMode that rewrites cuda devices to cpu; enter it on the
  thread that runs Megatron (the Worker does so around every registered call).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

TESTED_MEGATRON_VERSIONS = ("0.16",)
_applied = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` to cpu, drops `pin_memory=True`, makes `.cuda()` a no-op, and reports CPU float
    tensors as cuda types.

    Megatron hard-codes `device="cuda"` (schedules' token counts, the causal mask, grad clipping) and checks
    `param.type() == "torch.cuda.FloatTensor"` (distributed optimizer, grad clipping).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # RoPE's CP slicing pins its index tensor; CPU torch has no pinned allocator
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return "torch.cuda." + name[len("torch.") :] if name.startswith("torch.") and ".cuda." not in name else name
        return func(*args, **kwargs)


def cpu_device_mode() -> contextlib.AbstractContextManager:
    """The per-thread half of the layer; a TorchFunctionMode only covers the thread that entered it."""
    return CudaToCpuMode()


def _cpu_rng_state(device=None, *args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def apply() -> None:
    """Patch the CUDA-only calls megatron-core makes so it runs on CPU. Call before building models."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the Megatron CPU compatibility layer must not be applied on a machine with CUDA")
    import megatron.core
    from megatron.core.tensor_parallel import random as mcore_random

    if not megatron.core.__version__.startswith(TESTED_MEGATRON_VERSIONS):
        logger.warning("Megatron CPU layer tested on %s, found %s", TESTED_MEGATRON_VERSIONS, megatron.core.__version__)
    # Used as a device argument everywhere (rotary inv_freq, p2p receive buffers, DDP buffers).
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # CUDA RNG state calls (model_parallel_cuda_manual_seed, the RNG tracker) go to the CPU generator.
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    _applied = True
