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
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Set to a number N to have each measured CPU phase also keep the N largest storages alive at its peak (the
# operator that made each, its shape and dtype): what a planned-vs-measured miss is made of. Costs a copy of the
# live set at every new peak, so it is for investigating, not for runs.
TRACE_ENV = "ROLL_BACKEND_MEMORY_TRACE"


class LiveTensorBytes(TorchDispatchMode):
    """Live bytes of the storages created inside the mode, and their peak; with `trace`, also the storages alive
    at the peak (`peak_tensors`: the `trace` largest, as (bytes, operator, shape, dtype))."""

    def __init__(self, trace: int = 0):
        super().__init__()
        self.live = self.peak = 0
        self.trace = trace
        self.peak_tensors: list[tuple[int, str, tuple, str]] = []
        self._tracked: dict[int, weakref.ref] = {}
        self._made_by: dict[int, tuple[int, str, tuple, str]] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live -= nbytes
            self._made_by.pop(key, None)

    def _track(self, tensor: torch.Tensor, inputs: set[int], func) -> None:
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
        if self.trace:
            self._made_by[key] = (nbytes, str(func), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        if self.live > self.peak and self.trace:
            self.peak_tensors = sorted(self._made_by.values(), reverse=True)[: self.trace]
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, inputs, func)
        return out


class PhasePeaks:
    """The peak bytes each phase allocated (`measure(phase)` around it), the largest over its calls, and what the
    caller said about the call that set it (`shape`: e.g. its largest micro-batch)."""

    def __init__(self, device: str):
        self.device = device
        self.peaks: dict[str, int] = {}
        self.shapes: dict[str, Any] = {}
        self.peak_tensors: dict[str, list] = {}  # with TRACE_ENV set: each phase's largest storages at its peak

    @contextlib.contextmanager
    def measure(self, phase: str, enabled: bool = True, shape: Any = None) -> Iterator[None]:
        """Around one call of `phase`: on a GPU always (allocator statistics), on a CPU only when `enabled`."""
        if self.device.startswith("cuda"):
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            yield
            self._record(phase, torch.cuda.max_memory_allocated() - start, shape)
        elif enabled:
            counter = LiveTensorBytes(trace=int(os.environ.get(TRACE_ENV, "0") or 0))
            with counter:
                yield
            if self._record(phase, counter.peak, shape) and counter.trace:
                self.peak_tensors[phase] = counter.peak_tensors
        else:
            yield

    def measure_iteration(self, phase: str, items: Iterable, enabled: bool = True, shape: Any = None) -> Iterator:
        """`items`, each one made inside `phase`'s count and handed out of it: on a CPU the caller's work between
        items is not counted (a weight sync's consumer: its copies are host memory on a GPU); on a GPU the allocator's
        peak over the whole iteration."""
        if self.device.startswith("cuda") or not enabled:
            with self.measure(phase, enabled, shape):
                yield from items
            return
        counter, items, done = LiveTensorBytes(trace=int(os.environ.get(TRACE_ENV, "0") or 0)), iter(items), object()
        while True:
            with counter:
                item = next(items, done)
            if item is done:
                break
            yield item
            del item  # (what the caller let go of is not kept while the next one is made)
        if self._record(phase, counter.peak, shape) and counter.trace:
            self.peak_tensors[phase] = counter.peak_tensors

    def _record(self, phase: str, nbytes: int, shape: Any) -> bool:
        """Keep the call's peak when it is the phase's largest so far; whether it was."""
        if int(nbytes) < self.peaks.get(phase, 0):
            return False
        self.peaks[phase], self.shapes[phase] = int(nbytes), shape
        return True
