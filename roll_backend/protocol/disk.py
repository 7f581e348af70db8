"""DataProto's file format: one uncompressed zip holding safetensors, .npy and JSON; loading never unpickles.

Members: `dataproto.json` (layout, object columns and meta_info as tagged JSON), `batch.safetensors` (the tensor
columns, bf16 included) and `non_tensor/<i>.npy` (numeric and fixed-width string columns, `allow_pickle=False`).
Object columns and meta_info may hold None, bool, int, float, str, list, tuple, dict with str keys, numpy scalars
and numpy arrays of those; anything else is refused at save time rather than pickled.
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from roll_backend.protocol.errors import DataProtoError, NotADataProtoFileError

FORMAT_NAME = "roll_backend.DataProto"
FORMAT_VERSION = 1
_LAYOUT = "dataproto.json"
_BATCH = "batch.safetensors"
_TAGS = ("__tuple__", "__ndarray__", "__npscalar__")


def save_parts(
    path,
    batch: dict[str, torch.Tensor] | None,
    batch_size: int | None,
    non_tensor: dict[str, np.ndarray],
    meta_info: dict,
) -> None:
    """Write a DataProto's parts to `path` (one file)."""
    layout = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "batch_size": batch_size,
        "batch_keys": list(batch or {}),
        "non_tensor": {},
        "meta_info": _encode(meta_info, "meta_info"),
    }
    members: dict[str, bytes] = {}
    if batch is not None:
        members[_BATCH] = save_safetensors(_private_contiguous(batch))
    for i, (key, array) in enumerate(non_tensor.items()):
        if array.dtype.kind == "O":
            layout["non_tensor"][key] = {
                "kind": "json",
                "shape": list(array.shape),
                "values": [_encode(v, f"non_tensor_batch[{key!r}]") for v in array.ravel()],
            }
        elif array.dtype.kind in "biufcUmM":
            buffer = io.BytesIO()
            np.save(buffer, array, allow_pickle=False)
            layout["non_tensor"][key] = {"kind": "npy", "member": f"non_tensor/{i}.npy"}
            members[f"non_tensor/{i}.npy"] = buffer.getvalue()
        else:
            raise DataProtoError(
                f"cannot save non_tensor_batch[{key!r}] of dtype {array.dtype}: only numeric, fixed-width str "
                "and object columns are saved; convert it to one of those."
            )
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(_LAYOUT, json.dumps(layout))
        for name, payload in members.items():
            archive.writestr(name, payload)


def load_parts(path) -> tuple[dict[str, torch.Tensor] | None, int | None, dict[str, np.ndarray], dict]:
    """Read what `save_parts` wrote: (batch tensors or None, batch size, non-tensor columns, meta_info)."""
    with _open_archive(path) as archive:
        layout = json.loads(archive.read(_LAYOUT))
        if layout.get("format") != FORMAT_NAME or layout.get("version") != FORMAT_VERSION:
            raise NotADataProtoFileError(
                f"{path} is not a {FORMAT_NAME} v{FORMAT_VERSION} file (found format={layout.get('format')!r}, "
                f"version={layout.get('version')!r}); save it again with DataProto.save_to_disk."
            )
        batch = None
        if layout["batch_size"] is not None:
            tensors = load_safetensors(archive.read(_BATCH)) if layout["batch_keys"] else {}
            batch = {key: tensors[key] for key in layout["batch_keys"]}
        non_tensor = {}
        for key, spec in layout["non_tensor"].items():
            if spec["kind"] == "npy":
                non_tensor[key] = np.load(io.BytesIO(archive.read(spec["member"])), allow_pickle=False)
            else:
                non_tensor[key] = _object_array(spec["values"]).reshape(spec["shape"])
    return batch, layout["batch_size"], non_tensor, _decode(layout["meta_info"])


def _open_archive(path) -> zipfile.ZipFile:
    """The file as our zip, or NotADataProtoFileError naming what it seems to be (verl pickles, torch.save zips)."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        with open(path, "rb") as file:
            head = file.read(2)
        is_pickle = head[:1] == b"\x80"
        looks_like = "a pickle (verl's DataProto.save_to_disk writes those)" if is_pickle else "not a zip file"
        raise NotADataProtoFileError(_not_ours(path, looks_like)) from None
    if _LAYOUT not in archive.namelist():
        names = archive.namelist()
        torch_save = any(name.endswith("data.pkl") for name in names)
        archive.close()
        looks_like = "a torch.save file" if torch_save else f"a zip without {_LAYOUT} (members: {names[:5]})"
        raise NotADataProtoFileError(_not_ours(path, looks_like))
    return archive


def _not_ours(path, looks_like: str) -> str:
    return (
        f"{path} is not a roll-backend DataProto file: it is {looks_like}. DataProto.load_from_disk reads only files "
        "written by DataProto.save_to_disk, and never unpickles; load a foreign file with the tool that wrote it "
        "(after checking you trust it) and build the DataProto with DataProto.from_dict."
    )


def _private_contiguous(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain contiguous CPU tensors with no two sharing memory, which safetensors requires."""
    out, seen = {}, set()
    for key, tensor in batch.items():
        tensor = tensor.detach().cpu().contiguous().as_subclass(torch.Tensor)
        if tensor.numel() and tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _encode(value, where: str):
    """Tagged JSON for a value, exact on decode; refuses (ValueError) what JSON cannot carry."""
    if isinstance(value, np.generic) and value.dtype.kind in "biufU":
        return {"__npscalar__": value.dtype.str, "value": value.item()}
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, where) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and not set(_TAGS) & set(value):
        return {k: _encode(v, where) for k, v in value.items()}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufUO":
        flat = [_encode(v, where) for v in value.ravel()] if value.dtype.kind == "O" else value.ravel().tolist()
        return {"__ndarray__": {"dtype": value.dtype.str, "shape": list(value.shape), "values": flat}}
    raise DataProtoError(
        f"cannot save {where}: a value of type {type(value).__name__} has no exact JSON form, and DataProto files "
        "never pickle. Convert it to str/int/float/bool/None, lists, tuples, str-keyed dicts or numeric numpy arrays."
    )


def _object_array(encoded: list) -> np.ndarray:
    """A 1-D object array of the decoded values; np.array would nest equal-length lists into more dims."""
    return np.fromiter((_decode(v) for v in encoded), dtype=object, count=len(encoded))


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__npscalar__" in value:
        return np.array(value["value"], dtype=value["__npscalar__"])[()]
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__ndarray__" in value:
        spec = value["__ndarray__"]
        if spec["dtype"] == "|O":
            return _object_array(spec["values"]).reshape(spec["shape"])
        return np.array(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])
    return {k: _decode(v) for k, v in value.items()}
