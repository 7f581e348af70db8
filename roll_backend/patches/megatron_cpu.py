"""CPU compatibility layer for megatron-core 0.16.x: lets Megatron run on CPU tensors with gloo.

Applied in each rank process only when the device is CPU (never on GPU machines), before megatron-core is
imported; idempotent. Process-wide, on a machine where every cuda device request could only raise:
- the CUDA-only calls Megatron makes (current_device, synchronize, the RNG state) answer for the CPU;
- `device="cuda"` given to a tensor factory (torch.zeros, torch.tensor, ..., Tensor.new_*, Tensor.to) becomes cpu,
  `pin_memory=True` is dropped (CPU torch has no pinned allocator; RoPE's CP slicing asks for it), and
  `Tensor.cuda()` returns the tensor: Megatron hard-codes cuda in schedules' token counts, the causal mask, grad
  clipping, the grad scaler, DDP's warm-up, the tied embedding's copy;
- `Tensor.type()` names CPU float tensors as cuda types: the distributed optimizer and grad clipping check
  `param.type() == "torch.cuda.FloatTensor"`.
Only the factories are wrapped, not every torch call: a TorchFunctionMode did this before, and its hook on every op
cost ~4 us of Python per op, most of a tiny model's forward and backward.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

TESTED_MEGATRON_VERSIONS = ("0.16",)
_applied = False

# torch functions (and Tensor methods) that take a device: Megatron's cuda requests go through these.
_FACTORIES = (
    "tensor", "as_tensor", "asarray", "scalar_tensor", "zeros", "ones", "empty", "full", "arange", "range",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "zeros_like",
    "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "tril_indices",
    "triu_indices",
)  # fmt: skip
_TENSOR_FACTORIES = ("new_tensor", "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _on_cpu(factory):
    @functools.wraps(factory)
    def on_cpu(*args, **kwargs):
        if kwargs:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return on_cpu


def _tensor_to(to):
    @functools.wraps(to)
    def to_on_cpu(self, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return to(self, *args, **kwargs)

    return to_on_cpu


def _tensor_type(type_):
    @functools.wraps(type_)
    def type_as_cuda(self, *args, **kwargs):
        name = type_(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or not name.startswith("torch.") or ".cuda." in name:
            return name
        return "torch.cuda." + name[len("torch.") :]

    return type_as_cuda


def _patch_device_requests() -> None:
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


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
    _patch_device_requests()  # (before megatron-core's modules are imported, whatever they bind)
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
