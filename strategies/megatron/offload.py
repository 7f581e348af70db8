"""Model-state offload for the hybrid engine: a Megatron strategy's parameters, gradients and optimizer state go to
host memory while the rollout engine holds the device, and come back before the strategy runs again.

A part moves storage by storage: every distinct storage behind its tensors (DDP's contiguous grad buffer, the
parameters viewing a distributed optimizer's param buffer, Adam's moments, fp32 main copies) is copied to host memory
(pinned on a GPU) and its device storage resized to nothing; on the way back it is resized and refilled. The tensors
keep their identity (views stay views, the optimizer keeps its references), so nothing has to be rebuilt, as in verl's
and ROLL's offload of Megatron buffers. On a CPU rank the device is the host: the same moves run (so the suite checks
them), the copies staying in host memory, and the hybrid worker says so once in the log.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

PARTS = ("params", "grads", "optimizer")


def _storages(tensors: Iterable[torch.Tensor | None], skip: set[int]) -> list[torch.UntypedStorage]:
    """The distinct untyped storages behind `tensors`, leaving out those whose data pointer is in `skip`."""
    seen, out = set(skip), []
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out.append(storage)
    return out


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (a ChainedOptimizer holds several)."""
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        yield inner.optimizer


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            yield from group["params"]  # fp32 main copies under mixed precision (the model's own params otherwise)
        for state in torch_optimizer.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value) and value.dim() > 0)


class ModelStateOffload:
    """The storages of one strategy's params, grads and optimizer state, and where each part is now."""

    def __init__(self, chunks: list, optimizer=None):
        self.chunks, self.optimizer = chunks, optimizer
        self.on_host: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    def part_tensors(self, part: str) -> Iterator[torch.Tensor]:
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        if part == "params":
            yield from params
        elif part == "grads":
            for param in params:
                yield getattr(param, "main_grad", None)  # DDP's contiguous grad buffer
                yield param.grad
        elif self.optimizer is not None:
            yield from _optimizer_tensors(self.optimizer)

    def storages(self, part: str) -> list[torch.UntypedStorage]:
        """The part's storages, each counted once over all parts (an fp32 model's optimizer steps the params
        themselves: they belong to "params")."""
        earlier = PARTS[: PARTS.index(part)]
        skip = {s.data_ptr() for other in earlier for s in _storages(self.part_tensors(other), set())}
        return _storages(self.part_tensors(part), skip)

    def device_bytes(self) -> dict[str, int]:
        """Bytes of each part now on the device (0 for a part on the host)."""
        return {part: 0 if part in self.on_host else sum(s.nbytes() for s in self.storages(part)) for part in PARTS}

    def sizes(self) -> dict[str, int]:
        """Bytes of each part wherever it is (what it takes on the device when there)."""
        on_device = self.device_bytes()
        return {
            part: sum(copy.nbytes for _, copy in self.on_host[part]) if part in self.on_host else on_device[part]
            for part in PARTS
        }

    def to_host(self, parts: Iterable[str]) -> int:
        moved = 0
        for part in parts:
            if part in self.on_host:
                continue
            kept = []
            for storage in self.storages(part):
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                host.untyped_storage().copy_(storage, non_blocking=True)
                kept.append((storage, host))
            if kept and kept[0][0].device.type == "cuda":
                torch.cuda.synchronize()  # the copies must land before the device storage goes
            for storage, host in kept:
                storage.resize_(0)
                moved += host.numel()
            self.on_host[part] = kept
        return moved

    def to_device(self, parts: Iterable[str]) -> int:
        moved = 0
        for part in parts:
            for storage, host in self.on_host.pop(part, []):
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage(), non_blocking=True)
                moved += host.numel()
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()
        return moved
