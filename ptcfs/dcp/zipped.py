"""``torch.save`` archives, framed and read without torch.

DCP stores each chunk of a tensor in a ``.distcp`` file as a ``torch.save``
archive: a zip of stored (uncompressed) records, ``data.pkl`` naming the
tensor's storage, size and strides, and the storage's bytes as ``data/0``.
The view frames a sub-tensor's stored bytes as such an archive without
copying them: :func:`tensor_archive` gives the bytes before and after the
data record, which the view serves around a byte range of the store.
torch's reader does not check a stored record's CRC (the data record's is
left 0; the others are right).

:func:`read_tensor` reads the archive ``dcp.save`` wrote back: where its
storage lies in the file, its offset, size and strides.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from ptcfs.dcp.pickles import DCP_DTYPES, Call, Global, PersId, dump
from ptcfs.errors import InvalidRequest

__all__ = ["tensor_archive", "tensor_archive_of", "object_archive", "read_tensor", "Stored",
           "STORAGES"]

_ROOT = "archive"
_ALIGN = 64
#: ptcfs dtype → torch's typed storage class named in data.pkl
STORAGES = {"fp32": "FloatStorage", "fp16": "HalfStorage", "bf16": "BFloat16Storage",
            "fp64": "DoubleStorage", "int64": "LongStorage", "int32": "IntStorage",
            "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
            "bool": "BoolStorage"}
_FROM_STORAGE = {v: k for k, v in STORAGES.items()}
_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")


class _Zip:
    """A zip of stored records written in order; a record's data may be left
    out (``size`` bytes to be placed by the caller)."""

    def __init__(self) -> None:
        self.parts: list[bytes | int] = []  # bytes, or a gap of that many bytes
        self.pos = 0
        self.central: list[bytes] = []

    def record(self, name: str, data: bytes | None, size: int = 0) -> None:
        full = f"{_ROOT}/{name}".encode()
        n = len(data) if data is not None else size
        if n >= 0xFFFFFFFF:
            raise InvalidRequest(f"a DCP chunk of {n} bytes is too big for one archive")
        crc = zlib.crc32(data) if data is not None else 0
        pad = -(self.pos + _LOCAL.size + len(full) + 4) % _ALIGN
        extra = struct.pack("<2H", 0x4246, pad) + b"Z" * pad
        head = _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, n, n, len(full), len(extra))
        self.central.append(_CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, n, n,
                                          len(full), 0, 0, 0, 0, 0, self.pos) + full)
        self._put(head + full + extra)
        if data is not None:
            self._put(data)
        else:
            self.parts.append(n)
            self.pos += n

    def _put(self, b: bytes) -> None:
        if self.parts and isinstance(self.parts[-1], bytes):
            self.parts[-1] += b
        else:
            self.parts.append(b)
        self.pos += len(b)

    def close(self) -> list[bytes | int]:
        cd = b"".join(self.central)
        start = self.pos
        self._put(cd + _END.pack(b"PK\x05\x06", 0, 0, len(self.central), len(self.central),
                                 len(cd), start, 0))
        return self.parts


def _tensor_pickle(dtype: str, numel: int, offset: int, size: tuple[int, ...],
                   stride: tuple[int, ...]) -> bytes:
    """data.pkl of ``torch._utils._rebuild_tensor_v2`` over storage ``0``."""
    storage = PersId(("storage", Global("torch", STORAGES[dtype]), "0", "cpu", numel))
    return dump(Call(Global("torch._utils", "_rebuild_tensor_v2"),
                     (storage, offset, tuple(size), tuple(stride), False,
                      Call(Global("collections", "OrderedDict")))), protocol=2)


def tensor_archive(dtype: str, size: tuple[int, ...], stride: tuple[int, ...],
                   offset: int, storage_bytes: int) -> tuple[bytes, bytes]:
    """The bytes before and after ``storage_bytes`` bytes of storage in a
    ``torch.save`` archive of a tensor of ``dtype`` viewing that storage
    (``offset``, ``size`` and ``stride`` in elements)."""
    itemsize = _itemsize(dtype)
    z = _Zip()
    z.record("data.pkl", _tensor_pickle(dtype, storage_bytes // itemsize, offset, size, stride))
    z.record("byteorder", b"little")
    z.record("data/0", None, storage_bytes)
    z.record("version", b"3\n")
    parts = z.close()
    if len(parts) != 3 or not isinstance(parts[0], bytes) or not isinstance(parts[2], bytes):
        raise AssertionError("an archive is its head, its data and its tail")
    return parts[0], parts[2]


def tensor_archive_of(dtype: str, shape: tuple[int, ...], data: bytes) -> bytes:
    """A whole ``torch.save`` archive of a contiguous tensor's bytes."""
    head, tail = tensor_archive(dtype, shape, _strides(shape), 0, len(data))
    return head + data + tail


def object_archive(obj: Any) -> bytes:
    """A ``torch.save`` archive of a plain Python object (no tensors)."""
    z = _Zip()
    z.record("data.pkl", pickle.dumps(obj, protocol=2))
    z.record("byteorder", b"little")
    z.record("version", b"3\n")
    parts = z.close()
    return b"".join(p for p in parts if isinstance(p, bytes))


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _itemsize(dtype: str) -> int:
    from ptcfs.dtypes import numpy_dtype

    if dtype not in DCP_DTYPES:
        raise InvalidRequest(f"dtype {dtype} has no DCP storage")
    return int(numpy_dtype(dtype).itemsize)


# --- reading what dcp.save wrote ------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """A tensor in a ``torch.save`` archive: its storage's bytes are
    ``[start, start + nbytes)`` of the archive; ``offset``, ``size`` and
    ``stride`` in elements."""

    dtype: str
    start: int
    nbytes: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda st, off, size, stride, *_: (st, off, tuple(size), tuple(stride))
        if module == "torch" and name in _FROM_STORAGE:
            return _FROM_STORAGE[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor's")

    def persistent_load(self, pid: Any) -> Any:
        return tuple(pid)


def _records(blob: memoryview, what: str) -> dict[str, tuple[int, int]]:
    """name (without its folder) → (data start, size) of a zip's records."""
    b = bytes(blob[-(_END.size + 65536):]) if len(blob) > _END.size else bytes(blob)
    at = b.rfind(b"PK\x05\x06")
    if at < 0:
        raise InvalidRequest(f"{what}: not a torch.save archive (no zip directory)")
    _, _, _, _, count, _, cd_start, _ = _END.unpack(b[at:at + _END.size])
    if cd_start == 0xFFFFFFFF:
        raise InvalidRequest(f"{what}: zip64 archives are not read here")
    out: dict[str, tuple[int, int]] = {}
    pos = cd_start
    for _ in range(count):
        f = _CENTRAL.unpack(bytes(blob[pos:pos + _CENTRAL.size]))
        nlen, xlen, clen, local = f[10], f[11], f[12], f[16]
        name = bytes(blob[pos + _CENTRAL.size:pos + _CENTRAL.size + nlen]).decode()
        lf = _LOCAL.unpack(bytes(blob[local:local + _LOCAL.size]))
        if lf[3] != 0:
            raise InvalidRequest(f"{what}: {name} is compressed; DCP stores records")
        start = local + _LOCAL.size + lf[9] + lf[10]
        out[name.split("/", 1)[-1]] = (start, int(f[8]))
        pos += _CENTRAL.size + nlen + xlen + clen
    return out


def read_tensor(blob: memoryview, what: str) -> Stored:
    """Where the tensor of a ``torch.save`` archive (``blob``) lies."""
    recs = _records(blob, what)
    if "data.pkl" not in recs:
        raise InvalidRequest(f"{what}: no data.pkl in the archive")
    a, n = recs["data.pkl"]
    try:
        st, off, size, stride = _TensorUnpickler(io.BytesIO(bytes(blob[a:a + n]))).load()
        _, dtype, key, _, _ = st
    except Exception as e:  # noqa: BLE001
        raise InvalidRequest(f"{what}: not a tensor's archive ({e})") from None
    key = str(key)
    if f"data/{key}" not in recs:
        raise InvalidRequest(f"{what}: the archive has no storage {key}")
    start, nbytes = recs[f"data/{key}"]
    return Stored(str(dtype), start, nbytes, int(off), size, stride)
