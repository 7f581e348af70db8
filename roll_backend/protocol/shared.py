"""Zero-copy tensor <-> numpy conversion for pickling DataProto, and the read-only tensor for shared memory.

Ray hands numpy arrays pickled with protocol 5 back zero-copy, as read-only views of its shared object store;
`tensor_from_numpy` wraps such a view as a `SharedReadOnlyTensor`, whose in-place writes raise instead of
silently changing the batch under every other reader of the same object.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

# Dtypes numpy lacks travel as a same-width integer view and are viewed back on arrival.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# In-place operator dunders; every other in-place op is named `<op>_`.
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in "add sub mul truediv floordiv mod pow and or xor lshift rshift matmul".split()
) | {"__setitem__"}
# Trailing-underscore methods that change only the tensor object's metadata, never the shared bytes.
_METADATA_ONLY = frozenset(
    "requires_grad_ retain_grad detach_ rename_ share_memory_ squeeze_ unsqueeze_ t_ transpose_ swapdims_ swapaxes_ "
    "as_strided_".split()
)


class SharedTensorWriteError(RuntimeError):
    """An in-place write to a tensor whose memory other readers share (a zero-copy Ray object)."""


class SharedReadOnlyTensor(torch.Tensor):
    """A tensor viewing memory shared with other readers; in-place writes raise `SharedTensorWriteError`.

    Reads, autograd and out-of-place ops behave as on a plain tensor and return plain tensors, except views
    (slices, `.view`, `.detach`, `.T`), which share the memory and so stay read-only. `clone()` gives a
    private, writable copy; `DataProto.make_writable()` does that for whole columns. Writes that bypass torch's
    dispatch (native code handed the raw pointer, `.as_subclass(torch.Tensor)`, `untyped_storage()`) are not caught.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _writes_shared(name, args, kwargs):
            raise SharedTensorWriteError(
                f"in-place '{name}' on a read-only tensor: its memory is shared zero-copy with every other reader "
                "of the same Ray object, and writing it would change their data too. Call "
                "`data.make_writable([key])` on the DataProto first (copies that column once), use `t.clone()`, "
                "or use the out-of-place op."
            )
        if name == "__deepcopy__":
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            shared_ptrs = {a.untyped_storage().data_ptr() for a in _flat(args) if isinstance(a, SharedReadOnlyTensor)}
            return _keep_views_read_only(result, shared_ptrs)


def _flat(args):
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


def _writes_shared(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the op writes into a SharedReadOnlyTensor: as its in-place target, via `out=` or `inplace=True`."""
    out = kwargs.get("out")
    if out is not None and any(isinstance(o, SharedReadOnlyTensor) for o in _flat((out,))):
        return True
    in_place = name in _INPLACE_DUNDERS or kwargs.get("inplace") is True
    in_place |= name.endswith("_") and not name.endswith("__") and name not in _METADATA_ONLY
    return in_place and bool(args) and any(isinstance(a, SharedReadOnlyTensor) for a in _flat(args[:1]))


def _keep_views_read_only(result, shared_ptrs: set[int]):
    if isinstance(result, torch.Tensor):
        if (
            type(result) is torch.Tensor
            and result.layout == torch.strided
            and result.untyped_storage().data_ptr() in shared_ptrs
        ):
            return result.as_subclass(SharedReadOnlyTensor)
        return result
    if isinstance(result, np.ndarray) and shared_ptrs:  # .numpy() / np.asarray(t) views the shared bytes
        result.flags.writeable = False
        return result
    if type(result) in (tuple, list):  # unbind / split / chunk views
        return type(result)(_keep_views_read_only(r, shared_ptrs) for r in result)
    return result


def tensor_to_numpy(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    """(dtype name, array) viewing the tensor's bytes on CPU, with no copy for a contiguous CPU tensor."""
    tensor = tensor.detach().cpu().contiguous()
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    try:
        return dtype_name, tensor.numpy()
    except TypeError:  # bf16, fp8, complex32: no numpy dtype
        return dtype_name, tensor.view(_INT_OF_WIDTH[tensor.element_size()]).numpy()


def tensor_from_numpy(dtype_name: str, array: np.ndarray) -> torch.Tensor:
    """Inverse of `tensor_to_numpy`, sharing the array's memory; a read-only array gives a SharedReadOnlyTensor."""
    dtype = getattr(torch, dtype_name)
    if array.flags.writeable:
        tensor = torch.from_numpy(array)
    else:
        with warnings.catch_warnings():
            # torch warns that it cannot mark tensors read-only; SharedReadOnlyTensor does exactly that.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(array)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor if array.flags.writeable else tensor.as_subclass(SharedReadOnlyTensor)
