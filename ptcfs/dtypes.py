"""Mapping between ptcfs dtype names and numpy dtypes.

numpy has no bfloat16: bf16 tensors are held as little-endian uint16 bit
patterns (``torch.Tensor.view(torch.bfloat16)`` turns them back).
"""

from __future__ import annotations

import numpy as np

from ptcfs.errors import InvalidRequest
from ptcfs.types import DTYPE_SIZES

__all__ = ["numpy_dtype", "dtype_name"]

_NUMPY: dict[str, str] = {
    "fp32": "<f4",
    "fp16": "<f2",
    "bf16": "<u2",
    "fp64": "<f8",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "uint8": "|u1",
    "int8": "|i1",
    "bool": "|b1",
}
_BACK: dict[str, str] = {np.dtype(v).str: k for k, v in _NUMPY.items() if k != "bf16"}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds a tensor of dtype ``name``."""
    try:
        return np.dtype(_NUMPY[name])
    except KeyError:
        known = ", ".join(sorted(DTYPE_SIZES))
        raise InvalidRequest(f"unknown dtype {name!r} (known: {known})") from None


def dtype_name(dtype: np.dtype) -> str:
    """The ptcfs name of a numpy dtype."""
    try:
        return _BACK[np.dtype(dtype).newbyteorder("<").str if np.dtype(dtype).itemsize > 1
                     else np.dtype(dtype).str]
    except KeyError:
        raise InvalidRequest(f"numpy dtype {dtype} has no ptcfs equivalent") from None
