"""What a minimal weight sync sends, and the two copies that make it exact: the trainer's record of the weights the
engine holds (`SentWeights`) and the engine's own (`HeldWeights`).

Per tensor, only what changed since the engine's version travels, whichever costs fewer bytes: nothing (no bit
changed), the changed elements (flat positions + values), or the whole tensor. Changes are found bit by bit (a
float's bits, so -0.0 / NaN payloads count), and the engine rebuilds each tensor from its held copy, so after a delta
sync its weights are exactly a full sync's. Each tensor rebuilt from changed elements is checked against the
trainer's checksum of the new tensor before anything reaches the engine (a whole tensor travels as it is).

The engine loads a version only once every bucket of it has landed and been rebuilt and checked (`HeldWeights.stage`
raises before any load otherwise), and `commit`s it only after the engine loaded all of it: a sync that fails
midway leaves the held copy on the old version, from which the engine restores what it had loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

# Same-size integer dtypes: a tensor's bits, compared and summed exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class WeightDeltaError(RuntimeError):
    """A delta that does not apply to the engine's held weights (another base version, a tensor it does not hold, a
    checksum that disagrees): the engine keeps its version."""


def tensor_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer tensor of the same element size."""
    flat = tensor.detach().contiguous().reshape(-1)
    if tensor.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat if not (flat.is_floating_point() or flat.is_complex()) else flat.view(_BITS[flat.element_size()])


def checksum(tensor: torch.Tensor) -> int:
    """A sum of the tensor's bytes taken 8 at a time as int64 (wrapping, so exact and order-free), plus the sum of
    every other word (so a swap of two words shows): cheap, exact."""
    raw = tensor_bits(tensor).view(torch.uint8)
    if raw.data_ptr() % 8:  # (a view into another tensor, e.g. one half of a fused weight: int64 words need alignment)
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    tail = int(raw[whole:].sum(dtype=torch.int64))
    return (int(words.sum()) * 31 + int(words[1::2].sum()) + tail * 7) % (1 << 64)


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclass
class TensorDelta:
    """One tensor's change: `full` (the whole new tensor) or `indices` / `values` (flat positions that changed and
    their new values, with `checksum` the new tensor's: the engine checks its rebuild; a whole tensor travels as it
    is, through a transport that keeps it intact)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: int | None = None
    full: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.full) + nbytes(self.indices) + nbytes(self.values)


@dataclass
class WeightDeltaBucket:
    """One bucket of a sync to `version`, relative to the engine's `base_version` (None: whole tensors, no base)."""

    base_version: int | None
    version: int | None
    deltas: list[TensorDelta] = field(default_factory=list)
    full_bytes: int = 0  # what these tensors weigh whole: a full sync's bytes
    unchanged: int = 0  # tensors of the bucket not sent (no bit changed)

    @property
    def nbytes(self) -> int:
        return sum(delta.nbytes for delta in self.deltas)


def encode(name: str, new: torch.Tensor, old: torch.Tensor | None) -> TensorDelta | None:
    """What travels for `new` when the engine holds `old` (None: it holds nothing of it): None if no bit changed,
    else the changed elements or the whole tensor, whichever is fewer bytes."""
    delta = TensorDelta(name, tuple(new.shape), new.dtype)
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        delta.full = new
        return delta
    changed = tensor_bits(new) != tensor_bits(old)
    count = int(torch.count_nonzero(changed))
    if count == 0:
        return None
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    sparse_bytes = count * (torch.tensor([], dtype=index_dtype).element_size() + new.element_size())
    if sparse_bytes >= nbytes(new):
        delta.full = new
        return delta
    positions = changed.nonzero().reshape(-1)
    delta.indices = positions.to(index_dtype)
    delta.values = new.reshape(-1)[positions].clone()
    delta.checksum = checksum(new)
    return delta


def changed_tensors(
    bucket: Iterable[tuple[str, torch.Tensor]], held: HeldWeights | None, version: int | None
) -> WeightDeltaBucket:
    """`bucket`'s tensors whose bits differ from the held copy's, whole, as host copies (every tensor when `held` is
    None): what an engine in the trainer's own process loads (the hybrid engine's sync: nothing travels, so there
    is no element form and no checksum). Relative to no base version: the copy compared with is the engine's own."""
    out = WeightDeltaBucket(None, version)
    for name, tensor in bucket:
        new = tensor.detach().to("cpu", copy=True)
        out.full_bytes += nbytes(new)
        old = held.tensors.get(name) if held is not None else None
        if old is not None and old.shape == new.shape and old.dtype == new.dtype:
            if torch.equal(tensor_bits(old), tensor_bits(new)):
                out.unchanged += 1
                continue
        out.deltas.append(TensorDelta(name, tuple(new.shape), new.dtype, full=new))
    return out


def apply(delta: TensorDelta, held: torch.Tensor | None) -> torch.Tensor:
    """The new tensor from the engine's held copy and the delta; WeightDeltaError when a rebuilt one is not the
    trainer's."""
    if delta.full is not None:
        return delta.full
    if held is None or tuple(held.shape) != delta.shape or held.dtype != delta.dtype:
        raise WeightDeltaError(
            f"{delta.name}: a sparse delta for a {list(delta.shape)} {delta.dtype} tensor, but the engine holds "
            f"{'nothing of it' if held is None else f'{list(held.shape)} {held.dtype}'}"
        )
    new = _with_values(held, delta)
    if checksum(new) != delta.checksum:
        raise WeightDeltaError(f"{delta.name}: the rebuilt tensor's checksum differs from the trainer's (damaged)")
    return new


def _with_values(held: torch.Tensor, delta: TensorDelta) -> torch.Tensor:
    """A copy of `held` with the delta's values at its flat positions."""
    new = held.clone()
    new.view(-1)[delta.indices.long()] = delta.values
    return new


class SentWeights:
    """Trainer side (the rank that publishes): host copies of the weights the engine was last sent, and their
    version: `begin` a sync, `encode` each bucket (what changed since the engines' version), then `sent`."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    def begin(self, engine_version: int | None) -> int | None:
        """Start a sync for engines holding `engine_version`: the base its deltas are relative to, None (whole
        tensors) unless the copies are that version. Until `sent`, the copies are of no version (a sync that stops
        part-way leaves some tensors new: the next one sends whole tensors)."""
        base = self.version if self.version is not None and self.version == engine_version else None
        self.version = None
        return base

    def encode(self, bucket: Iterable[tuple[str, torch.Tensor]], base_version: int | None, version: int | None):
        """A WeightDeltaBucket of `bucket`'s tensors relative to `base_version` (whole when it is None); the copies
        are updated to the new tensors. Call `sent(version)` once the whole sync is published."""
        out = WeightDeltaBucket(base_version, version)
        for name, tensor in bucket:
            old = self.tensors.get(name) if base_version is not None else None
            out.full_bytes += nbytes(tensor)
            delta = self._encode_one(name, tensor.detach(), old)
            if delta is None:
                out.unchanged += 1
            else:
                out.deltas.append(delta)
        return out

    def _encode_one(self, name: str, tensor: torch.Tensor, old: torch.Tensor | None) -> TensorDelta | None:
        """On the CPU: compared with the host copy, which is replaced. On a device (GPU path): the host copy goes up
        and the comparison runs there; only the delta comes down, and the host copy takes it in place."""
        if tensor.device.type == "cpu" or old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            new = tensor.to("cpu", copy=True)
            self.tensors[name] = new
            return encode(name, new, old)
        delta = encode(name, tensor, old.to(tensor.device, non_blocking=True))
        if delta is None:
            return None
        if delta.full is not None:
            delta.full = delta.full.to("cpu", copy=True)
            old.copy_(delta.full)
        else:
            delta.indices, delta.values = delta.indices.cpu(), delta.values.cpu()
            old.view(-1)[delta.indices.long()] = delta.values
        return delta

    def sent(self, version: int | None) -> None:
        self.version = version


class HeldWeights:
    """Engine side: a host copy of the weights the engine serves (HF names, as sent) and their version."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        # How to go back from the last committed sync: (the version before it, {name: reverse delta}); None: nothing
        # to undo (no sync yet, or the one before it filled an empty copy). Staged with a sync, kept by its commit.
        self.undo: tuple[int | None, dict[str, TensorDelta]] | None = None
        self._staged_undo: dict[str, TensorDelta] | None = None

    @property
    def complete(self) -> bool:
        """Whether the copy holds a whole model (it does after the first whole sync)."""
        return bool(self.tensors)

    def stage(self, buckets: Iterable[WeightDeltaBucket]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Every bucket of a sync rebuilt and checked, nothing loaded: ({name: new tensor of those that changed},
        {"bytes": received, "full_bytes": a full sync's, "tensors": sent, "unchanged": not sent}). Raises
        WeightDeltaError (the engine keeps its version) when a bucket is relative to another version."""
        staged: dict[str, torch.Tensor] = {}
        undo: dict[str, TensorDelta] | None = {} if self.complete else None
        counts = dict.fromkeys(("bytes", "full_bytes", "tensors", "unchanged"), 0)
        for bucket in buckets:
            if bucket.base_version is not None and (bucket.base_version != self.version or not self.complete):
                raise WeightDeltaError(
                    f"a weight delta relative to version {bucket.base_version} reached an engine holding version "
                    f"{self.version}; the trainer must send whole tensors (its next sync does)"
                )
            for delta in bucket.deltas:
                held = self.tensors.get(delta.name)
                staged[delta.name] = apply(delta, held)
                if undo is not None and held is not None:
                    undo[delta.name] = reverse(delta, held)
            counts["bytes"] += bucket.nbytes
            counts["full_bytes"] += bucket.full_bytes
            counts["tensors"] += len(bucket.deltas)
            counts["unchanged"] += bucket.unchanged
        self._staged_undo = undo
        return staged, counts

    def with_whole_groups(
        self, staged: dict[str, torch.Tensor], group_of: Callable[[str], str]
    ) -> list[tuple[str, torch.Tensor]]:
        """The staged tensors together with every held tensor of the same load group (`group_of(name)`: the engine
        loads a fused layer whole), in held order then staged-only names."""
        groups = {group_of(name) for name in staged}
        named = [(n, staged.get(n, t)) for n, t in self.tensors.items() if group_of(n) in groups]
        return named + [(n, t) for n, t in staged.items() if n not in self.tensors]

    def commit(self, staged: dict[str, torch.Tensor], version: int | None) -> None:
        """The engine loaded every staged tensor: they are the held copy of `version`, and the sync can be undone."""
        self.undo = (self.version, self._staged_undo) if self._staged_undo is not None else None
        self._staged_undo = None
        self.tensors.update(staged)
        self.version = version

    def revert(self) -> dict[str, torch.Tensor]:
        """Undo the last committed sync: the copy is the version before it again; returns {name: restored tensor}
        of what that sync changed (for the engine to load). WeightDeltaError when there is nothing to undo."""
        if self.undo is None:
            raise WeightDeltaError(
                "no weight sync to undo: the engine's first sync filled an empty copy, or it was undone already"
            )
        version, undo = self.undo
        # (the old values come from this copy itself: nothing travelled, so there is no checksum to check)
        restored = {
            name: back.full if back.full is not None else _with_values(self.tensors[name], back)
            for name, back in undo.items()
        }
        self.tensors.update(restored)
        self.version, self.undo = version, None
        return restored


def reverse(delta: TensorDelta, held: torch.Tensor) -> TensorDelta:
    """The delta that takes the tensor `delta` builds back to `held`: the old values at the same positions, or
    `held` whole (no checksum: it never leaves the engine's process, and a sync's hot path need not read the whole
    tensor once more for an undo that rarely runs)."""
    back = TensorDelta(delta.name, tuple(held.shape), held.dtype)
    if delta.indices is None:
        back.full = held
        return back
    back.indices = delta.indices
    back.values = held.reshape(-1)[delta.indices.long()].clone()
    return back
