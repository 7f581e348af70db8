"""DataProto, the batch every controller <-> worker call carries; `roll_backend.protocol` is its public import path.

data_proto.py holds the class, columns.py what a column may be, row_index.py which rows an op takes (indexes, padding,
chunks, groups, repeats, unfolding), merge.py how parts join (concat/union), shared.py the zero-copy pickling of
tensors, disk.py the pickle-free file format, tensordict_format.py the TensorDict form (verl's), errors.py the
errors (verl-catchable).
"""

from roll_backend.protocol.data_proto import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from roll_backend.protocol.errors import DataProtoError, NotADataProtoFileError
from roll_backend.protocol.shared import SharedReadOnlyTensor, SharedTensorWriteError

__all__ = [
    "DataProto",
    "DataProtoError",
    "DataProtoItem",
    "NotADataProtoFileError",
    "SharedReadOnlyTensor",
    "SharedTensorWriteError",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]
