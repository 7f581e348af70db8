"""The errors DataProto raises for bad input, catchable the way both our callers and verl's catch them."""

from __future__ import annotations


class DataProtoError(ValueError, AssertionError):
    """Bad input to a DataProto method (wrong shape, conflicting meta_info, bad argument), with what to change.

    It is a ValueError for our callers and an AssertionError for code written against verl, whose DataProto
    asserts in the same places (`except AssertionError` keeps working unchanged).
    """


class NotADataProtoFileError(DataProtoError):
    """`DataProto.load_from_disk` was given a file that `DataProto.save_to_disk` did not write."""
