"""``.npy`` headers for arrays of any numpy dtype (views of ``npy`` datasets
and small generated files)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

__all__ = ["npy_header", "npy_bytes"]

_MAGIC = b"\x93NUMPY"
#: The data of a view's ``.npy`` file starts at a multiple of this many bytes.
_ALIGN = 64


def npy_header(descr: str, shape: Sequence[int]) -> bytes:
    """A version 1.0 header for a C-order array; its length is a multiple of 64."""
    dims = tuple(int(n) for n in shape)
    text = f"{{'descr': {np.dtype(descr).str!r}, 'fortran_order': False, 'shape': {dims!r}, }}"
    pad = -(len(_MAGIC) + 4 + len(text) + 1) % _ALIGN
    body = (text + " " * pad + "\n").encode("latin1")
    return _MAGIC + b"\x01\x00" + struct.pack("<H", len(body)) + body


def npy_bytes(array: np.ndarray) -> bytes:
    """A whole small ``.npy`` file."""
    a = np.ascontiguousarray(array).reshape(np.shape(array))  # 0-d stays 0-d
    return npy_header(a.dtype.str, a.shape) + a.tobytes()
