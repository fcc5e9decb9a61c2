"""safetensors files read and written a tensor at a time, by byte ranges.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``name → {"dtype", "shape", "data_offsets": [begin, end]}`` and an optional
``"__metadata__"``), then the tensors' bytes; offsets count from the end of
the header. :func:`read_dir` lists the tensors of a ``save_pretrained``
directory (``model.safetensors``, or the shards that
``model.safetensors.index.json`` names) from the headers alone;
:func:`read_tensor` reads one tensor's bytes. :func:`write_dir` writes tensors
in shards of at most ``max_bytes`` (a tensor larger than that gets a shard
of its own) as ``save_pretrained`` names them, with the index when there is
more than one, fetching each tensor only when its turn comes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import CheckpointError
from ptcfs.types import DTYPE_SIZES

__all__ = ["DTYPES", "SafeTensor", "read_dir", "read_file", "read_tensor",
           "write_dir", "INDEX", "SINGLE", "DEFAULT_SHARD_BYTES"]

#: safetensors dtype → ptcfs dtype.
DTYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_BACK = {v: k for k, v in DTYPES.items()}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: save_pretrained's default ``max_shard_size`` ("5GB").
DEFAULT_SHARD_BYTES = 5 * 10**9
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class SafeTensor:
    """One tensor of a file: where its bytes are."""

    name: str
    dtype: str  # ptcfs name
    shape: tuple[int, ...]
    path: Path
    offset: int  # from the start of the file
    nbytes: int


def read_file(path: Path) -> dict[str, SafeTensor]:
    """The tensors of one safetensors file, from its header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: header length {n} does not fit the file")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read its safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data = 8 + n
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = DTYPES[d["dtype"]], tuple(int(x) for x in d["shape"])
            begin, end = (int(x) for x in d["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: dtype {d.get('dtype')!r} or its "
                                   "shape or offsets cannot be read") from None
        want = DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        if end - begin != want or begin < 0 or data + end > size:
            raise CheckpointError(f"{path}: tensor {name}: offsets {begin}..{end} do not hold "
                                   f"{want} bytes of a {dtype} {list(shape)} inside the file")
        out[str(name)] = SafeTensor(str(name), dtype, shape, path, data + begin, want)
    return out


def read_dir(root: Path) -> dict[str, SafeTensor]:
    """Every tensor of a model directory (see the module docstring)."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
        out: dict[str, SafeTensor] = {}
        for name in files:
            if "/" in name or not (root / name).is_file():
                raise CheckpointError(f"{index} names {name}, which is not in {root}")
            found = read_file(root / name)
            for t in found:
                if weight_map.get(t) != name:
                    raise CheckpointError(f"{root / name} holds {t}, which {INDEX} puts "
                                           f"in {weight_map.get(t)}")
            out.update(found)
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"{index} lists {missing[0]}, which no shard holds")
        return out
    if (root / SINGLE).is_file():
        return read_file(root / SINGLE)
    others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    hint = (f" (found {', '.join(others[:3])}: save it with save_pretrained("
            "safe_serialization=True))" if others else "")
    raise CheckpointError(f"{root}: no {SINGLE} and no {INDEX}{hint}")


def read_tensor(t: SafeTensor) -> np.ndarray:
    """The tensor's values (bf16 as uint16 bit patterns), read from its bytes only."""
    dt = numpy_dtype(t.dtype)
    with open(t.path, "rb") as f:
        f.seek(t.offset)
        a = np.fromfile(f, dtype=dt, count=t.nbytes // dt.itemsize)
    if a.nbytes != t.nbytes:
        raise CheckpointError(f"{t.path}: tensor {t.name} ends past the end of the file")
    return a.reshape(t.shape)


def _shards(items: Sequence[tuple[str, str, tuple[int, ...]]], max_bytes: int
            ) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for it in items:
        n = DTYPE_SIZES[it[1]] * int(np.prod(it[2], dtype=np.int64))
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    return shards


def _write_file(path: Path, items: Sequence[tuple[str, str, tuple[int, ...]]],
                fetch: Callable[[str], np.ndarray]) -> int:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, dtype, shape in items:
        n = DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": _BACK[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, dtype, shape in items:
            a = np.ascontiguousarray(fetch(name))
            if a.shape != tuple(shape) or a.dtype != numpy_dtype(dtype):
                raise CheckpointError(f"{name}: got {a.dtype} {a.shape} to write, not "
                                       f"{dtype} {tuple(shape)}")
            f.write(a.reshape(-1).view(np.uint8).data)
    return at


def write_dir(root: Path, items: Sequence[tuple[str, str, tuple[int, ...]]],
              fetch: Callable[[str], np.ndarray], max_bytes: int = DEFAULT_SHARD_BYTES,
              prefix: str = "model") -> list[Path]:
    """Write ``items`` (name, ptcfs dtype, shape), in order, into ``root``;
    ``fetch(name)`` gives each tensor's values. Returns the files written."""
    root.mkdir(parents=True, exist_ok=True)
    shards = _shards(items, max_bytes)
    if len(shards) == 1:
        path = root / f"{prefix}.safetensors"
        _write_file(path, shards[0], fetch)
        return [path]
    names = [f"{prefix}-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    total = 0
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        total += _write_file(root / name, shard, fetch)
        weight_map.update({it[0]: name for it in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [root / n for n in names] + [root / f"{prefix}.safetensors.index.json"]
