"""Boxes of stored entries: which bytes a box is, and copying one out.

Used by the daemon (``read_box`` replies, staging) and the filesystem
(files assembled from sub-tensors): both read through a store
:class:`~ptcfs.store.base.Reader`, whose buffers may be zero-copy views.
"""

from __future__ import annotations

import math

import numpy as np

from ptcfs.boxes import Box
from ptcfs.errors import InvalidRequest
from ptcfs.store.base import Reader

__all__ = ["copy_box", "gather_box"]

Key = tuple[str, int, str, str]  # job, version, tensor, part

# A box whose range of the entry is at most GATHER_BYTES comes through
# Reader.gathered: one buffer when the range lies in many (a view merged row by
# row hands out a run per row), rather than halved until each half lies in one
# buffer: 768 rows of a column-merged view cost 768 lookups of the entry's runs
# that way, and a migration read its fetched bytes at 74 MB/s.
GATHER_BYTES = 64 << 20


def gather_box(r: Reader, key: Key, shape: tuple[int, ...], itemsize: int, box: Box,
               out: np.ndarray) -> None:
    """Copy the C-order bytes of ``box`` of a stored entry of ``shape`` into
    ``out`` (flat uint8, exactly the box's bytes)."""
    _check(key, shape, box)
    extents = tuple(b - a for a, b in box)
    word = np.dtype(f"u{itemsize}") if itemsize in (1, 2, 4, 8) else np.dtype(f"V{itemsize}")
    copy_box(r, key, shape, itemsize, box, out.view(word).reshape(extents))


def copy_box(r: Reader, key: Key, shape: tuple[int, ...], itemsize: int, box: Box,
             dest: np.ndarray) -> None:
    """Copy ``box`` of a stored entry of ``shape`` into ``dest``, an array of
    the box's extents with ``itemsize``-byte elements and any strides: one
    strided copy per stretch of the entry that lies in one store chunk,
    straight from the reader's views; a range of many views is gathered once
    (see GATHER_BYTES)."""
    _check(key, shape, box)
    extents = tuple(b - a for a, b in box)
    if math.prod(extents) == 0:
        return
    strides = [itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
    start = sum(a * s for (a, _), s in zip(box, strides))
    span = sum((b - 1 - a) * s for (a, b), s in zip(box, strides)) + itemsize
    if span == math.prod(extents) * itemsize and dest.flags.c_contiguous:
        r.read_into(*key, start, dest.reshape(-1).view(np.uint8))  # the box is one run
        return
    views = r.gathered(*key, start, span) if span <= GATHER_BYTES else \
        list(r.ranges(*key, start, span))
    if len(views) == 1:
        dest[...] = np.lib.stride_tricks.as_strided(np.frombuffer(views[0], dtype=dest.dtype),
                                                    extents, strides, writeable=False)
        return
    dim = next((i for i, n in enumerate(extents) if n > 1), None)
    if dim is None:  # one element across a chunk boundary
        dest.reshape(-1).view(np.uint8)[...] = np.frombuffer(b"".join(views), dtype=np.uint8)
        return
    a, b = box[dim]  # split the box in halves until each half lies in one chunk
    mid = (a + b) // 2
    index = (0,) * dim
    copy_box(r, key, shape, itemsize, box[:dim] + ((a, mid),) + box[dim + 1:],
             dest[index + (slice(0, mid - a),)].reshape(_with(extents, dim, mid - a)))
    copy_box(r, key, shape, itemsize, box[:dim] + ((mid, b),) + box[dim + 1:],
             dest[index + (slice(mid - a, b - a),)].reshape(_with(extents, dim, b - mid)))


def _check(key: Key, shape: tuple[int, ...], box: Box) -> None:
    if len(box) != len(shape) or not all(0 <= a <= b <= n for (a, b), n in zip(box, shape)):
        raise InvalidRequest(f"box {list(map(list, box))} is outside {key[2]} [{key[3]}] "
                             f"of shape {list(shape)}")


def _with(extents: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return extents[:dim] + (n,) + extents[dim + 1:]
