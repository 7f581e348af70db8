"""Measured memory of a phase: the peak of the bytes a phase allocated on top of what it started with.

On a GPU that is the caching allocator's own statistic (`torch.cuda.max_memory_allocated` after a reset, less the
bytes allocated at the start), free to read on every step. A CPU has no allocator statistics, so there the tensors
are counted: a TorchDispatchMode sees every tensor an operator returns (autograd's backward included, which runs on
the calling thread for CPU tensors) and adds each new storage's bytes until the storage is freed (a weak reference
to it fires), keeping the peak. It costs a Python call per operator, so the CPU count runs when asked (the first step,
a test), not on every step. Both count what the phase allocates (activations saved for backward, logits and log-prob
buffers, transient gradients), not the model state it started with.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Live bytes of the storages created inside the mode, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._tracked: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live -= nbytes

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        ref = self._tracked.get(key)
        if key in inputs or (ref is not None and ref() is storage):
            return  # a view or an in-place result of an input (a parameter's `.t()` is no new memory), or counted
        nbytes = storage.nbytes()
        self._tracked[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, inputs)
        return out


class PhasePeaks:
    """The peak bytes each phase allocated (`measure(phase)` around it), the largest over its calls, and what the
    caller said about the call that set it (`shape`: e.g. its largest micro-batch)."""

    def __init__(self, device: str):
        self.device = device
        self.peaks: dict[str, int] = {}
        self.shapes: dict[str, Any] = {}

    @contextlib.contextmanager
    def measure(self, phase: str, enabled: bool = True, shape: Any = None) -> Iterator[None]:
        """Around one call of `phase`: on a GPU always (allocator statistics), on a CPU only when `enabled`."""
        if self.device.startswith("cuda"):
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            yield
            self._record(phase, torch.cuda.max_memory_allocated() - start, shape)
        elif enabled:
            counter = LiveTensorBytes()
            with counter:
                yield
            self._record(phase, counter.peak, shape)
        else:
            yield

    def _record(self, phase: str, nbytes: int, shape: Any) -> None:
        if int(nbytes) >= self.peaks.get(phase, 0):
            self.peaks[phase], self.shapes[phase] = int(nbytes), shape
