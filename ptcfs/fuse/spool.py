"""What the mount's save folders share (``dcp/step-<N>/``, ``hf-save/``):
files spooled to the host's disk while a save is written, and the cut of
whole tensors (or chunks of them) into the sub-tensors of the job's
current configuration, put into the job's open save.

Nothing is stored while the files arrive: a save's folder module
(:mod:`ptcfs.fuse.dcpwrite`, :mod:`ptcfs.fuse.hfwrite`) checks the whole
save first, then calls :func:`put_layout` for each tensor, then commits.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.boxes import box_intersect
from ptcfs.dtypes import numpy_dtype
from ptcfs.sharding import layout_of
from ptcfs.types import Box, ParallelConfig, Slice, TensorSpec

__all__ = ["SpoolFile", "Chunks", "put_layout", "put_array", "cut", "close_maps"]

#: pieces of a logical tensor: ``(box of the tensor, its values)``
Chunks = list[tuple[Box, np.ndarray]]


class SpoolFile:
    """One file of a save being written (the interface of a write session):
    its bytes go to an unlinked file in ``spool`` (nothing is left behind)."""

    def __init__(self, spool: Path, what: str, uid: int):
        spool.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="save.", dir=spool)
        os.unlink(path)
        self.fd, self.what, self.uid = fd, what, uid
        self.name: str | None = what.rsplit("/", 1)[-1]  # None: a temporary file
        self.size = 0
        self.closed = False
        self.lock = threading.Lock()

    def write(self, data: bytes, offset: int) -> int:
        with self.lock:
            n = os.pwrite(self.fd, data, offset)
            self.size = max(self.size, offset + n)
            self.closed = False
            return n

    def truncate(self, length: int) -> None:
        with self.lock:
            os.ftruncate(self.fd, length)
            self.size = length
            self.closed = False

    def finish(self, put: Any) -> None:
        """Nothing is stored when one file is closed (the folder's module decides)."""

    def close(self) -> None:
        self.closed = True  # written whole; its bytes stay spooled for the commit

    def drop(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def map(self, maps: dict[str, mmap.mmap]) -> mmap.mmap:
        """The file's bytes, mapped once per commit (``maps``: by path)."""
        if self.what not in maps:
            maps[self.what] = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
        return maps[self.what]


def close_maps(maps: dict[str, mmap.mmap]) -> None:
    """Close a commit's maps (their views must be gone first)."""
    for m in maps.values():
        try:
            m.close()
        except BufferError:  # a view an error's traceback holds: closed when it goes
            pass


def cut(spec: TensorSpec, sl: Slice, chunks: Chunks) -> np.ndarray:
    """The sub-tensor ``sl`` of ``spec`` from ``chunks`` that cover it
    (padding rows zero)."""
    out = np.zeros(sl.local_shape(spec.shape), numpy_dtype(spec.dtype))
    for lbox, local in sl.pieces(spec.shape):
        _fill(out, local, lbox, chunks)
    return out


def put_layout(put: Callable[..., None], job: str, spec: TensorSpec, config: ParallelConfig,
               chunks: Chunks, uid: int) -> None:
    """Put every sub-tensor of ``spec`` under ``config``, cut from
    ``chunks``, into ``job``'s open save."""
    for sl in layout_of(spec, config).slices():
        put_array(put, job, spec, sl, cut(spec, sl, chunks), uid)


def put_array(put: Callable[..., None], job: str, spec: TensorSpec, sl: Slice,
              arr: np.ndarray, uid: int) -> None:
    """Put the sub-tensor ``sl`` of ``spec`` (``arr``) into ``job``'s open save."""
    arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # 0-d stays 0-d
    put(job, spec.name, sl.key(), arr.reshape(-1).view(np.uint8).data, arr.shape, spec.dtype,
        rank=-1, uid=uid)


def _fill(out: np.ndarray, local: Box, lbox: Box, chunks: Chunks) -> None:
    """Copy the part ``lbox`` of the logical tensor into ``out[local]``."""
    for box, arr in chunks:
        inter = box_intersect(box, lbox) if lbox else ()
        if inter is None:
            continue
        src = tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(inter, box))
        dst = tuple(slice(l0 + a - p0, l0 + b - p0)
                    for (a, b), (p0, _), (l0, _) in zip(inter, lbox, local))
        out[dst] = arr[src]
