"""Megatron-LM's indexed dataset (``.bin`` + ``.idx``), read and written
from the format's byte layout (no dependency on Megatron).

``.bin`` holds the tokens of every sequence, back to back. ``.idx``,
little-endian::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        token dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
              6 float64, 7 float32, 8 uint16)
    u64       S, the number of sequences
    u64       D, the number of document indices (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into .bin
    int64[D]  document indices: document k is sequences [doc[k], doc[k+1])

A *sample* is a document (a document split into sentences keeps its
sequences together). Its stored bytes are its sequences' tokens, in order.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptcfs.data.source import Source, SourceInfo
from ptcfs.errors import BadDataset

__all__ = ["MAGIC", "DTYPE_CODES", "MegatronIndex", "read_index", "index_bytes",
           "write_dataset", "MegatronSource", "paths_of"]

MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2")}
_CODE_OF = {v.str: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True, eq=False)
class MegatronIndex:
    """The arrays of an ``.idx`` file."""

    dtype: np.dtype
    sizes: np.ndarray  # int32 [S]
    pointers: np.ndarray  # int64 [S]
    doc_idx: np.ndarray  # int64 [D]


def paths_of(prefix: str | Path) -> tuple[Path, Path]:
    """``(.bin, .idx)`` of a dataset given as its prefix or either file."""
    p = Path(prefix)
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    return Path(f"{p}.bin"), Path(f"{p}.idx")


def read_index(path: str | Path, bin_size: int | None = None) -> MegatronIndex:
    """Parse and check an ``.idx`` file (against its ``.bin`` of ``bin_size`` bytes)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise BadDataset(f"{path}: cannot read it: {e.strerror or e}") from e
    if len(raw) < _HEAD.size:
        raise BadDataset(f"{path}: truncated: {len(raw)} bytes, shorter than the "
                         f"{_HEAD.size}-byte header")
    magic, version, code, s, d = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise BadDataset(f"{path}: not a Megatron index (magic {magic!r}, expected {MAGIC!r})")
    if version != 1:
        raise BadDataset(f"{path}: index version {version}; only version 1 is known")
    if code not in DTYPE_CODES:
        raise BadDataset(f"{path}: unknown token dtype code {code}")
    need = _HEAD.size + 4 * s + 8 * s + 8 * d
    if len(raw) < need:
        at = _HEAD.size
        for what, n in (("sequence lengths", 4 * s), ("sequence pointers", 8 * s),
                        ("document indices", 8 * d)):
            if len(raw) < at + n:
                item = 4 if what == "sequence lengths" else 8
                raise BadDataset(f"{path}: truncated in the {what}: record "
                                 f"{(len(raw) - at) // item} of {n // item} is cut off "
                                 f"({len(raw)} bytes, {need} expected)")
            at += n
    if len(raw) != need:
        raise BadDataset(f"{path}: {len(raw) - need} bytes after the document indices "
                         "(a multimodal index?); only token datasets are read")
    sizes = np.frombuffer(raw, "<i4", s, _HEAD.size)
    pointers = np.frombuffer(raw, "<i8", s, _HEAD.size + 4 * s)
    doc_idx = np.frombuffer(raw, "<i8", d, _HEAD.size + 12 * s)
    dtype = DTYPE_CODES[code]
    _check(path, sizes, pointers, doc_idx, dtype.itemsize, bin_size)
    return MegatronIndex(dtype, sizes, pointers, doc_idx)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check(path: Path, sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray,
           itemsize: int, bin_size: int | None) -> None:
    if (sizes < 0).any():
        raise BadDataset(f"{path}: sequence {_first(sizes < 0)} has a negative length")
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(sizes):
        raise BadDataset(f"{path}: document indices must run from 0 to the {len(sizes)} "
                         "sequences")
    if (np.diff(doc_idx) < 0).any():
        raise BadDataset(f"{path}: document {_first(np.diff(doc_idx) < 0)} ends before it "
                         "starts (document indices decrease)")
    if bin_size is not None and len(sizes):
        ends = pointers + sizes.astype(np.int64) * itemsize
        bad = (pointers < 0) | (ends > bin_size)
        if bad.any():
            i = _first(bad)
            raise BadDataset(f"{path}: sequence {i} (bytes {int(pointers[i])}.."
                             f"{int(ends[i])}) lies outside the .bin of {bin_size} bytes")


def index_bytes(dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> bytes:
    """An ``.idx`` file for sequences of ``sizes`` tokens stored back to back."""
    sizes32 = np.ascontiguousarray(sizes, dtype="<i4")
    pointers = np.zeros(len(sizes32), dtype="<i8")
    if len(sizes32) > 1:
        np.cumsum(sizes32[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    head = _HEAD.pack(MAGIC, 1, _CODE_OF[np.dtype(dtype).str], len(sizes32), len(doc_idx))
    return head + sizes32.tobytes() + pointers.tobytes() + \
        np.ascontiguousarray(doc_idx, dtype="<i8").tobytes()


def write_dataset(prefix: str | Path, documents: list[np.ndarray]) -> tuple[Path, Path]:
    """Write ``prefix.bin`` and ``prefix.idx``, one sequence per document
    (all of one dtype); returns their paths."""
    bin_path, idx_path = paths_of(prefix)
    dtype = np.dtype(documents[0].dtype) if documents else np.dtype("<u2")
    with open(bin_path, "wb") as f:
        for doc in documents:
            f.write(np.ascontiguousarray(doc, dtype=dtype).tobytes())
    sizes = np.array([len(d) for d in documents], dtype=np.int64)
    idx_path.write_bytes(index_bytes(dtype, sizes, np.arange(len(documents) + 1)))
    return bin_path, idx_path


class MegatronSource(Source):
    """The documents of a Megatron dataset."""

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths_of(prefix)
        try:
            self._file = open(self.bin_path, "rb")
        except OSError as e:
            raise BadDataset(f"{self.bin_path}: cannot open it: {e.strerror or e}") from e
        try:
            size = self.bin_path.stat().st_size
            self.index = read_index(self.idx_path, size)
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size \
                else None
        except BaseException:
            self._file.close()
            raise
        ix = self.index
        isz = ix.dtype.itemsize
        seq_bytes = ix.sizes.astype(np.int64) * isz
        per_doc = np.add.reduceat(seq_bytes, ix.doc_idx[:-1]) if len(ix.sizes) else \
            np.zeros(len(ix.doc_idx) - 1, dtype=np.int64)
        empty = ix.doc_idx[1:] == ix.doc_idx[:-1]  # reduceat gives a value there, not 0
        per_doc = np.where(empty, 0, per_doc).astype(np.int64)
        if len(per_doc) == 0:
            raise BadDataset(f"{self.idx_path}: no documents in it")
        self._seq_bytes = seq_bytes
        self.info = SourceInfo(
            "megatron", str(self.bin_path.with_suffix("")), per_doc, tokens=per_doc // isz,
            dtype=ix.dtype.str,
            extra={"seq_sizes": ix.sizes.astype(np.int32),
                   "doc_idx": ix.doc_idx.astype(np.int64)})

    def read(self, first: int, stop: int) -> bytes | memoryview:
        ix = self.index
        a, b = int(ix.doc_idx[first]), int(ix.doc_idx[stop])
        if a == b or self._map is None:
            return b""
        ptr, nbytes = ix.pointers[a:b], self._seq_bytes[a:b]
        if (ptr[1:] == ptr[:-1] + nbytes[:-1]).all():  # back to back, as Megatron writes them
            return memoryview(self._map)[int(ptr[0]):int(ptr[-1] + nbytes[-1])]
        return b"".join(self._map[int(p):int(p + n)] for p, n in zip(ptr, nbytes))

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()  # type: ignore[union-attr]
            except BufferError:  # a view of it is still referenced: the GC closes it
                pass
            self._map = None
        self._file.close()


def open_source(path: str | Path, length_key: str | None = None,
                need_lengths: bool = False) -> MegatronSource:
    """The ``megatron`` row of :data:`ptcfs.data.formats.FORMATS`."""
    return MegatronSource(path)
