"""DCP's ``.metadata`` pickle, written and read without torch.

``torch.distributed.checkpoint`` keeps a checkpoint's metadata as the pickle
of its ``Metadata`` dataclass. The mount builds that pickle for its views
and reads the one ``dcp.save`` writes into it, in a process that has no
torch: :func:`dump` emits the opcodes by hand (torch's classes named by
module and name, never imported), and :func:`load` reads them with an
unpickler that knows only the globals a DCP metadata file names (a
``.metadata`` written by a user runs no code in the mount).

The shapes written are those ``pickle.dump(metadata)`` gives under torch
2.x (checked against DCP's own reader by the tests): dataclasses as
``NEWOBJ`` + ``BUILD`` of their ``__dict__``, ``TensorProperties`` with its
tuple state, ``torch.Size`` as a ``REDUCE`` of a tuple.
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from ptcfs.errors import InvalidRequest

__all__ = ["Global", "Obj", "Call", "PersId", "Pairs", "dump", "load", "Loaded", "TORCH_SIZE",
           "dtype_global", "DCP_DTYPES", "tensor_properties"]

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


@dataclass(frozen=True)
class Global:
    """A module-level name, pickled by reference (``GLOBAL module name``)."""

    module: str
    name: str


@dataclass(frozen=True)
class Obj:
    """An instance of ``cls`` rebuilt from ``state`` (``NEWOBJ`` + ``BUILD``)."""

    cls: Global
    state: Any = None


@dataclass(frozen=True)
class Call:
    """``fn(*args)`` at load time (``REDUCE``)."""

    fn: Global
    args: tuple[Any, ...] = field(default=())


@dataclass(frozen=True)
class Pairs:
    """A dict whose keys are not hashable here (DCP's ``MetadataIndex`` objects)."""

    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class PersId:
    """A persistent id (``BINPERSID`` of its tuple): how torch.save names a storage."""

    items: tuple[Any, ...]


TORCH_SIZE = Global("torch", "Size")
#: ptcfs dtype → torch dtype name
DCP_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
              "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8",
              "uint8": "uint8", "bool": "bool"}
_FROM_TORCH = {v: k for k, v in DCP_DTYPES.items()}


def dtype_global(dtype: str) -> Global:
    return Global("torch", DCP_DTYPES[dtype])


def tensor_properties(dtype: str) -> Obj:
    """DCP's ``TensorProperties`` of a strided, contiguous tensor of ``dtype``."""
    layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    fmt = Call(Global(_META, "_MEM_FORMAT_ENCODING"), (0,))
    return Obj(Global(_META, "TensorProperties"),
               (dtype_global(dtype), layout, False, fmt, False))


def dump(obj: Any, protocol: int = 3) -> bytes:
    """Pickle (``protocol`` 2 or 3) of ``obj`` built from dicts, lists, tuples, str,
    bytes, int, float, bool, None and :class:`Global`/:class:`Obj`/:class:`Call`."""
    out = io.BytesIO()
    out.write(bytes([0x80, protocol]))
    _emit(out, obj)
    out.write(b".")
    return out.getvalue()


def _emit(out: io.BytesIO, x: Any) -> None:  # noqa: C901 - one branch per opcode family
    w = out.write
    if x is None:
        w(b"N")
    elif x is True:
        w(b"\x88")
    elif x is False:
        w(b"\x89")
    elif isinstance(x, int):
        if -(1 << 31) <= x < (1 << 31):
            w(b"J" + struct.pack("<i", x))
        else:
            n = (x.bit_length() + 8) // 8
            w(b"\x8a" + bytes([n]) + x.to_bytes(n, "little", signed=True))
    elif isinstance(x, float):
        w(b"G" + struct.pack(">d", x))
    elif isinstance(x, str):
        b = x.encode("utf-8")
        w(b"X" + struct.pack("<I", len(b)) + b)
    elif isinstance(x, bytes | bytearray):
        w(b"B" + struct.pack("<I", len(x)) + bytes(x))
    elif isinstance(x, tuple):
        w(b"(")
        for v in x:
            _emit(out, v)
        w(b"t")
    elif isinstance(x, list):
        w(b"](")
        for v in x:
            _emit(out, v)
        w(b"e")
    elif isinstance(x, dict):
        w(b"}(")
        for k, v in x.items():
            _emit(out, k)
            _emit(out, v)
        w(b"u")
    elif isinstance(x, Global):
        w(b"c" + x.module.encode() + b"\n" + x.name.encode() + b"\n")
    elif isinstance(x, Obj):
        _emit(out, x.cls)
        w(b")\x81")
        if x.state is not None:
            _emit(out, x.state)
            w(b"b")
    elif isinstance(x, Pairs):
        w(b"}(")
        for k, v in x.items:
            _emit(out, k)
            _emit(out, v)
        w(b"u")
    elif isinstance(x, PersId):
        _emit(out, tuple(x.items))
        w(b"Q")
    elif isinstance(x, Call):
        _emit(out, x.fn)
        _emit(out, tuple(x.args))
        w(b"R")
    else:
        raise TypeError(f"cannot pickle {type(x).__name__} for DCP metadata")


# --- reading ---------------------------------------------------------------------

class Loaded:
    """An object of a DCP class, as read: ``kind`` is its class name and its
    fields are attributes (``TensorProperties``: ``state`` holds its tuple)."""

    kind = ""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def __repr__(self) -> str:
        return f"{self.kind}({self.__dict__})"


_CLASSES = {(_META, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                 "StorageMeta")} | {(_FS, "_StorageInfo")}
_KINDS: dict[tuple[str, str], type] = {}


def _kind(module: str, name: str) -> type:
    key = (module, name)
    if key not in _KINDS:
        _KINDS[key] = type(name, (Loaded,), {"kind": name})
    return _KINDS[key]


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _kind(module, name)
        if module == "torch" and name == "Size":
            return lambda dims: tuple(int(d) for d in dims)
        if module == "torch" and name in _FROM_TORCH:
            return _FROM_TORCH[name]
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda text: text
        if (module, name) == (_META, "_MEM_FORMAT_ENCODING"):
            return lambda n: n
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # checkpoint_id
            return lambda *parts: "/".join(map(str, parts))
        raise pickle.UnpicklingError(f"{module}.{name} has no place in DCP metadata")


def load(data: bytes, what: str) -> Loaded:
    """The ``Metadata`` of a ``.metadata`` file's bytes (InvalidRequest when
    they are not one, or name anything but DCP's own classes)."""
    try:
        md = _Restricted(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any malformed pickle is the same error
        raise InvalidRequest(f"{what}: not a DCP metadata file ({e})") from None
    if not isinstance(md, Loaded) or md.kind != "Metadata":
        raise InvalidRequest(f"{what}: not a DCP Metadata object")
    return md
