"""File formats under the mount: ``.npy`` and safetensors headers, built and parsed.

Both are a header followed by the C-order bytes of the tensors, so a file
is its header (:class:`~ptcfs.vfile.Literal`) plus byte ranges of stored
sub-tensors; nothing is materialised.
"""

from __future__ import annotations

import ast
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidRequest

__all__ = ["npy_header", "parse_npy_header", "safetensors_header", "parse_safetensors_header",
           "SAFETENSORS_DTYPES", "Declared"]

#: ptcfs dtype → safetensors dtype code.
SAFETENSORS_DTYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "fp64": "F64",
                      "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                      "uint8": "U8", "bool": "BOOL"}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_NPY_MAGIC = b"\x93NUMPY"
#: Data of .npy and safetensors files starts at a multiple of this many bytes.
ALIGN = 64


@dataclass(frozen=True)
class Declared:
    """A tensor a written file declares: name, dtype, shape, byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def npy_header(dtype: str, shape: Sequence[int]) -> bytes:
    """A version 1.0 ``.npy`` header whose length is a multiple of 64."""
    descr = numpy_dtype(dtype).str
    dims = tuple(int(n) for n in shape)
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims!r}, }}"
    pad = -(len(_NPY_MAGIC) + 4 + len(text) + 1) % ALIGN
    body = (text + " " * pad + "\n").encode("latin1")
    return _NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(body)) + body


def parse_npy_header(head: bytes, what: str) -> tuple[str, tuple[int, ...], int]:
    """``(numpy dtype str, shape, data offset)`` of a ``.npy`` file's first bytes."""
    if len(head) < 10 or head[:6] != _NPY_MAGIC:
        raise InvalidRequest(f"{what}: not a .npy file (no \\x93NUMPY magic)")
    major = head[6]
    if major == 1:
        n, start = struct.unpack("<H", head[8:10])[0], 10
    elif major in (2, 3):
        n, start = struct.unpack("<I", head[8:12])[0], 12
    else:
        raise InvalidRequest(f"{what}: .npy format version {major} is not supported")
    if len(head) < start + n:
        raise InvalidRequest(f"{what}: the .npy header is cut short")
    try:
        d = ast.literal_eval(head[start:start + n].decode("latin1"))
        descr, fortran, shape = d["descr"], d["fortran_order"], tuple(int(x) for x in d["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise InvalidRequest(f"{what}: malformed .npy header ({e})") from None
    if fortran:
        raise InvalidRequest(f"{what}: Fortran-order .npy files are not accepted; save a "
                             "C-order array (np.ascontiguousarray)")
    return str(descr), shape, start + n


def safetensors_header(tensors: Sequence[tuple[str, str, Sequence[int], int]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding
    ``(name, dtype, shape, nbytes)`` in order; padded so data starts at a
    multiple of 64."""
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        if dtype not in SAFETENSORS_DTYPES:
            raise InvalidRequest(f"{name}: dtype {dtype} has no safetensors code")
        doc[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                     "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def parse_safetensors_header(head: bytes, what: str) -> tuple[list[Declared], int]:
    """The tensors a safetensors file declares (byte ranges relative to the
    file's start) and where its data starts. ``head`` holds at least the
    header."""
    if len(head) < 8:
        raise InvalidRequest(f"{what}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > len(head) - 8:
        raise InvalidRequest(f"{what}: the safetensors header says {n} bytes; the file is "
                             "shorter")
    try:
        doc = json.loads(head[8:8 + n])
        if not isinstance(doc, dict):
            raise ValueError("the header is not a JSON object")
        out = []
        for name, t in doc.items():
            if name == "__metadata__":
                continue
            a, b = (int(x) for x in t["data_offsets"])
            out.append(Declared(name, _FROM_SAFETENSORS[t["dtype"]],
                                tuple(int(x) for x in t["shape"]), 8 + n + a, 8 + n + b))
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"{what}: malformed safetensors header ({e!r})") from None
    return out, 8 + n
