"""Small real datasets for the dataset tests, and reading views back.

Every sample carries its own index, so a test can tell from the bytes
alone which sample it read.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.data.formats.megatron import write_dataset
from ptcfs.store.base import TensorStore
from ptcfs.vfile import Literal, VFile

L = 4  # tokens per npy row


def make_npy(path: Path, n: int) -> np.ndarray:
    """Row i is ``[i*L, i*L+1, ...]`` (int32)."""
    arr = np.arange(n * L, dtype=np.int32).reshape(n, L)
    np.save(path, arr)
    return arr


def jsonl_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Skewed lengths: most short, a few very long."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.1, rng.integers(200, 400, n), rng.integers(1, 20, n))
    return [{"id": i, "length": int(k), "text": "é" * (i % 3)} for i, k in enumerate(lengths)]


def make_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")


def png_bytes(width: int, height: int, value: int) -> bytes:
    """A grey PNG image (8-bit, one channel) of ``value``."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\0" + bytes([value % 256]) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                                0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def make_images(root: Path, n: int, classes: tuple[str, ...] = ("cat", "dog", "emu")
                ) -> dict[str, bytes]:
    """An ImageFolder tree ``<class>/img<i>.png``; returns path → bytes."""
    out = {}
    for i in range(n):
        rel = f"{classes[i % len(classes)]}/img{i:03d}.png"
        data = png_bytes(2 + i % 5, 3, i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def megatron_docs(n: int, seed: int = 0) -> list[np.ndarray]:
    """Document i: ``len`` tokens all equal to i (int32), skewed lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.1, rng.integers(100, 300, n), rng.integers(1, 12, n))
    return [np.full(int(k), i, dtype=np.int32) for i, k in enumerate(lengths)]


def make_megatron(prefix: Path, docs: list[np.ndarray]) -> None:
    write_dataset(prefix, docs)


def read_megatron_index(data: bytes) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """An independent reader of the ``.idx`` layout: dtype, sizes, pointers, doc_idx."""
    magic, version, code, s, d = struct.unpack_from("<9sQBQQ", data)
    assert magic == b"MMIDIDX\x00\x00" and version == 1
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}[code]
    at = 34
    sizes = np.frombuffer(data, np.int32, s, at)
    pointers = np.frombuffer(data, np.int64, s, at + 4 * s)
    doc_idx = np.frombuffer(data, np.int64, d, at + 12 * s)
    assert len(data) == at + 12 * s + 8 * d
    return np.dtype(dtype), sizes, pointers, doc_idx


class StoreSink:
    """An ingest into local stores, one per host name (no daemons)."""

    def __init__(self, stores: dict[str, TensorStore], job: str, replicas: int = 1):
        self.stores = stores
        self.job = job + "@data"
        self.ring = list(stores)
        self.replicas = replicas

    def next_version(self) -> int:
        return max((v.version for s in self.stores.values() for v in s.versions(self.job)),
                   default=0) + 1

    def begin(self, version: int, meta: dict[str, Any]) -> None:
        for s in self.stores.values():
            s.begin_at(self.job, version, meta)

    def put(self, hosts: tuple[str, ...], version: int, tensor: str, part: str,
            data: np.ndarray) -> None:
        name = {np.dtype(np.int64): "int64", np.dtype(np.int32): "int32"}.get(data.dtype,
                                                                             "uint8")
        for h in hosts:
            self.stores[h].put(self.job, version, tensor, part, data, data.shape, name)

    def commit(self, version: int, meta: dict[str, Any]) -> None:
        for s in self.stores.values():
            s.commit(self.job, version, meta)

    def abort(self, version: int) -> None:
        for s in self.stores.values():
            s.abort(self.job, version)


def read_vfile(f: VFile, stores: dict[str, TensorStore], offset: int = 0,
               size: int | None = None) -> bytes:
    """The bytes of a view file, each stored range read from a store of one
    of its holders."""
    out = bytearray()
    for seg, at, n in f.spans(offset, f.size if size is None else size):
        if isinstance(seg, Literal):
            out += seg.data[at:at + n]
            continue
        holder = next(h for h in seg.hosts if h in stores)
        with stores[holder].reader() as r:
            out += r.read(seg.job, seg.version, seg.tensor, seg.part, seg.offset + at, n)
    return bytes(out)
