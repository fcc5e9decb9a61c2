"""Entries as views: a new entry made of boxes of entries of earlier versions.

A reconfiguration builds each new sub-tensor mostly from regions that the
host holds already. Instead of copying them, a store keeps the new entry as
*pieces* in its byte order; each piece is ``(size, count, stride, blob,
offset)``: ``count`` runs of ``size`` bytes, run ``i`` being the bytes
``[offset + i*stride, offset + i*stride + size)`` of *blob* ``blob`` (the
bytes one entry stored for itself, under its id), or zeros where ``blob`` is
:data:`ZEROS`. A box of a C-order tensor is such a strided run of bytes
once the dimensions that it spans whole are folded together (a row split is
one run, a column split of a 2-D tensor one strided piece), so a view of a
plain entry takes a piece or a few. Pieces always name blobs, never views:
a view of a view is resolved when it is made, so that reading never chains.

What the backends share lives here: turning :class:`ViewRef` boxes into
runs of blobs (:func:`view_runs`), filling the rest with the entry's own
bytes or zeros and packing runs into pieces (:func:`pack`), and walking
pieces to read a byte range (:func:`spans`). A reshard that moves nothing
across hosts makes hundreds of entries, each one ref of one stored entry
taken whole or cut along one dimension: :func:`one_ref_pieces` gives their
pieces with plain arithmetic (the same pieces, in a tenth of the time), and
:func:`merge_pieces` those of shards merged side by side.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ptcfs.boxes import Box
from ptcfs.errors import InvalidRequest

__all__ = ["ViewRef", "ViewEntry", "Piece", "ZEROS", "view_runs", "pack", "one_ref_pieces",
           "merge_pieces", "spans", "starts", "blobs_of"]

#: The blob id of zeros (padding).
ZEROS = -1

#: size, count, stride, blob, offset
Piece = tuple[int, int, int, int, int]

#: runs sorted by position: (position in the entry, blob, offset in the blob, size)
Runs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class ViewRef:
    """Box ``dst`` of a new entry is box ``box`` of entry ``(version, tensor,
    part)`` of the same job (an earlier version), whose extents are the same."""

    dst: Box
    version: int
    tensor: str
    part: str
    box: Box


@dataclass(frozen=True)
class ViewEntry:
    """One entry of :meth:`~ptcfs.store.base.TensorStore.put_views`: the
    arguments of a ``put_view``."""

    tensor: str
    part: Any  # a Slice or its key
    shape: tuple[int, ...]
    dtype: str
    refs: tuple[ViewRef, ...]
    data: Any = None  # a Buffer, or None


def _strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    return [itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]


def box_runs(shape_a: tuple[int, ...], box_a: Box, shape_b: tuple[int, ...], box_b: Box,
             itemsize: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The byte runs that a box of extents common to ``box_a`` (of a tensor
    of ``shape_a``) and ``box_b`` (of ``shape_b``) takes in each: the runs'
    offsets in a and in b, in C order, and their common size."""
    extents = [b - a for a, b in box_a]
    if math.prod(extents) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    k = len(extents)  # fold the trailing dimensions that both boxes span whole
    while k > 0 and box_a[k - 1] == (0, shape_a[k - 1]) and box_b[k - 1] == (0, shape_b[k - 1]):
        k -= 1
    k = max(k - 1, 0)  # dimension k is taken partly, in one run
    run = itemsize * math.prod(extents[k:])
    out = []
    for shape, box in ((shape_a, box_a), (shape_b, box_b)):
        st = _strides(shape, itemsize)
        off = np.array([sum(a * s for (a, _), s in zip(box, st))], dtype=np.int64)
        for j in range(k):
            off = np.add.outer(off, np.arange(extents[j], dtype=np.int64) * st[j]).ravel()
        out.append(off)
    return out[0], out[1], run


def _expand(pieces: Sequence[Piece]) -> Runs:
    """Every run of ``pieces``, with its position in the entry."""
    if len(pieces) == 0:
        e = np.zeros(0, np.int64)
        return e, e, e, e
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 5)
    size, count, stride, blob, off = p.T
    first = np.concatenate([[0], np.cumsum(size * count)[:-1]])
    which = np.repeat(np.arange(len(p)), count)
    i = np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
    return (first[which] + i * size[which], blob[which], off[which] + i * stride[which],
            size[which])


def _resolve(source: Runs, offs: np.ndarray, size: int) -> Runs:
    """Runs of blobs for bytes ``[o, o+size)`` of a source entry, for each
    ``o`` in ``offs``; positions are each run's place in the concatenation."""
    spos, sblob, soff, ssize = source
    idx = np.searchsorted(spos, offs, side="right") - 1
    whole = (idx >= 0) & (offs + size <= spos[idx] + ssize[idx])
    if whole.all():
        pos = np.arange(len(offs), dtype=np.int64) * size
        return pos, sblob[idx], soff[idx] + (offs - spos[idx]), np.full(len(offs), size)
    out: list[tuple[int, int, int, int]] = []
    for n, o in enumerate(offs.tolist()):  # runs that cross the source's pieces
        i, at, end = int(idx[n]), o, o + size
        while at < end:
            take = min(end, int(spos[i] + ssize[i])) - at
            out.append((n * size + at - o, int(sblob[i]), int(soff[i] + at - spos[i]), take))
            at += take
            i += 1
    a = np.array(out, dtype=np.int64).reshape(-1, 4).T
    return a[0], a[1], a[2], a[3]


def view_runs(shape: tuple[int, ...], itemsize: int, refs: Sequence[ViewRef],
              source: Callable[[ViewRef], tuple[tuple[int, ...], int, Sequence[Piece]]],
              what: str) -> Runs:
    """The runs of blobs that ``refs`` put into an entry of ``shape``, sorted
    by position. ``source(ref)`` gives the shape, itemsize and pieces of the
    entry a ref names. InvalidRequest when refs overlap or do not fit."""
    parts: list[Runs] = []
    for ref in refs:
        sshape, sitem, spieces = source(ref)
        if sitem != itemsize:
            raise InvalidRequest(f"{what}: a view of {ref.tensor} [{ref.part}] must have its "
                                 f"element size ({sitem} bytes, not {itemsize})")
        for box, sh, name in ((ref.dst, shape, what), (ref.box, sshape, ref.tensor)):
            if len(box) != len(sh) or not all(0 <= a <= b <= n for (a, b), n in zip(box, sh)):
                raise InvalidRequest(f"{what}: box {[list(b) for b in box]} is outside "
                                     f"{name} of shape {list(sh)}")
        if [b - a for a, b in ref.dst] != [b - a for a, b in ref.box]:
            raise InvalidRequest(f"{what}: boxes {[list(b) for b in ref.dst]} and "
                                 f"{[list(b) for b in ref.box]} differ in extents")
        dst, src, run = box_runs(shape, ref.dst, sshape, ref.box, itemsize)
        if run == 0:
            continue
        pos, blob, off, size = _resolve(_expand(spieces), src, run)
        # pos counts within the concatenated runs of this ref: place each on dst
        parts.append((dst[pos // run] + pos % run, blob, off, size))
    if not parts:
        e = np.zeros(0, np.int64)
        return e, e, e, e
    pos, blob, off, size = (np.concatenate(c) for c in zip(*parts))
    order = np.argsort(pos, kind="stable")
    pos, blob, off, size = pos[order], blob[order], off[order], size[order]
    if len(pos) > 1 and (pos[1:] < pos[:-1] + size[:-1]).any():
        raise InvalidRequest(f"{what}: the boxes of a view overlap")
    return pos, blob, off, size


def one_ref_pieces(shape: tuple[int, ...], itemsize: int, ref: ViewRef,
                   source: tuple[tuple[int, ...], int, Sequence[Piece]]) -> list[Piece] | None:
    """The pieces of an entry of ``shape`` that ``ref`` fills whole, whose
    source (its shape, itemsize and pieces, as ``view_runs``'s ``source``
    gives them) is one stretch of one blob, when the ref's box of it is one
    run or one strided run: what :func:`view_runs` and :func:`pack` give.
    None in every other case (and for anything they would refuse)."""
    sshape, sitem, spieces = source
    box = ref.box
    n = len(shape)
    if (sitem != itemsize or len(spieces) != 1 or len(ref.dst) != n or len(box) != n
            or len(sshape) != n):
        return None
    size, count, _, blob, off = spieces[0]
    if count != 1 or blob == ZEROS or size != itemsize * math.prod(sshape):
        return None
    for (da, db), d, (a, b), m in zip(ref.dst, shape, box, sshape):
        if da != 0 or db != d or not 0 <= a <= b <= m or b - a != d:
            return None
    if math.prod(shape) == 0:
        return None
    k = n  # as box_runs: fold the trailing dimensions the source box spans whole
    while k > 0 and box[k - 1] == (0, sshape[k - 1]):
        k -= 1
    k = max(k - 1, 0)
    if k > 1:
        return None
    strides = _strides(sshape, itemsize)
    start = off + sum(a * st for (a, _), st in zip(box, strides))
    run = itemsize * math.prod(shape[k:])
    if k == 0 or shape[0] == 1:
        return [(run, 1, run, blob, start)]
    return [(run, shape[0], strides[0], blob, start)]


def merge_pieces(shape: tuple[int, ...], itemsize: int, refs: Sequence[ViewRef],
                 sources: Sequence[tuple[tuple[int, ...], int, Sequence[Piece]]]
                 ) -> list[Piece] | None:
    """The pieces of an entry of ``shape`` that ``refs`` (two or more) fill
    whole as blocks side by side along one dimension, each from the whole
    extent of its source in every other dimension, the sources (``sources[i]``
    of ``refs[i]``, as ``view_runs``'s ``source`` gives them) each one
    stretch of its own blob: a merge of shards, such as tp=2 rows made of
    tp=4 rows. One run per block per row, as :func:`view_runs` and
    :func:`pack` give them, with plain arithmetic (a merge along a later
    dimension has as many pieces as rows times blocks). None in every other
    case (and for anything they would refuse)."""
    n = len(shape)
    if len(refs) < 2 or len(sources) != len(refs) or math.prod(shape) == 0:
        return None
    ks = {next((d for d in range(n) if len(r.dst) == n and r.dst[d] != (0, shape[d])), 0)
          for r in refs}
    if len(ks) != 1:
        return None
    k = ks.pop()
    inner = math.prod(shape[k + 1:]) * itemsize
    blocks = []
    for ref, (sshape, sitem, spieces) in zip(refs, sources):
        if sitem != itemsize or len(spieces) != 1 or len(sshape) != n or len(ref.box) != n \
                or len(ref.dst) != n:
            return None
        size, count, _, blob, off = spieces[0]
        if count != 1 or blob == ZEROS or size != itemsize * math.prod(sshape):
            return None
        for d in range(n):
            if d != k and (ref.dst[d] != (0, shape[d]) or ref.box[d] != (0, sshape[d])
                           or sshape[d] != shape[d]):
                return None
        (da, db), (a, b) = ref.dst[k], ref.box[k]
        if not (0 <= da < db <= shape[k] and 0 <= a < b <= sshape[k] and b - a == db - da):
            return None
        blocks.append((da, db, blob, off + a * inner, sshape[k] * inner))
    blocks.sort()
    if blocks[0][0] != 0 or blocks[-1][1] != shape[k] or \
            any(x[1] != y[0] for x, y in zip(blocks, blocks[1:])) or \
            len({x[2] for x in blocks}) != len(blocks):  # a blob twice: its runs may join
        return None
    rows = math.prod(shape[:k])
    arr = np.array(blocks, dtype=np.int64)
    out = np.empty((rows, len(blocks), 5), np.int64)
    out[:, :, 0] = out[:, :, 2] = (arr[:, 1] - arr[:, 0]) * inner
    out[:, :, 1] = 1
    out[:, :, 3] = arr[:, 2]
    out[:, :, 4] = arr[:, 3] + np.arange(rows, dtype=np.int64)[:, None] * arr[:, 4]
    return _as_pieces(out.reshape(-1, 5))


def pack(nbytes: int, runs: Runs, own: int | None) -> tuple[list[Piece], list[tuple[int, int]]]:
    """The pieces of an entry of ``nbytes`` made of ``runs``, the rest being
    the entry's own bytes, blob ``own`` (zeros when ``own`` is None); and the
    ``(position, size)`` stretches of the entry that its own bytes hold, in
    order (their offsets in blob ``own`` follow one another from 0)."""
    pos, blob, off, size = runs
    gaps: list[tuple[int, int]] = []
    ends = np.concatenate([[0], pos + size])
    starts_ = np.concatenate([pos, [nbytes]])
    for a, b in zip(ends[starts_ > ends].tolist(), starts_[starts_ > ends].tolist()):
        gaps.append((a, b - a))
    if gaps:
        g = np.array(gaps, dtype=np.int64).T
        gblob = np.full(len(gaps), ZEROS if own is None else own, dtype=np.int64)
        goff = np.zeros(len(gaps), np.int64) if own is None else np.cumsum(g[1]) - g[1]
        pos, blob, off, size = (np.concatenate(c) for c in
                                ((pos, g[0]), (blob, gblob), (off, goff), (size, g[1])))
        order = np.argsort(pos, kind="stable")
        blob, off, size = blob[order], off[order], size[order]
    if own is None:
        off = np.where(blob == ZEROS, 0, off)
    return _compress(blob, off, size), gaps if own is not None else []


def _compress(blob: np.ndarray, off: np.ndarray, size: np.ndarray) -> list[Piece]:
    """Runs in entry order (each following the last) as few pieces: runs
    that continue one another in the blob join; runs of one size and one
    stride in one blob make a strided piece."""
    if len(blob) == 0:
        return []
    # join runs contiguous in their blob too (zeros always join)
    join = np.zeros(len(blob), bool)
    join[1:] = (blob[1:] == blob[:-1]) & ((off[1:] == off[:-1] + size[:-1]) | (blob[1:] == ZEROS))
    head = np.flatnonzero(~join)
    size = np.add.reduceat(size, head)
    blob, off = blob[head], off[head]
    d = np.zeros(len(blob), np.int64)
    d[1:] = off[1:] - off[:-1]
    brk = np.ones(len(blob), bool)
    brk[1:] = (blob[1:] != blob[:-1]) | (size[1:] != size[:-1]) | (blob[1:] == ZEROS)
    brk[2:] |= d[2:] != d[1:-1]
    heads = np.flatnonzero(brk)
    counts = np.diff(np.concatenate([heads, [len(blob)]]))
    # a strided piece's stride is its second run's step; one run's is its size
    stride = np.where(counts > 1, d[np.minimum(heads + 1, len(blob) - 1)], size[heads])
    rows = np.stack([size[heads], counts, stride, blob[heads], off[heads]], axis=1)
    return _as_pieces(rows)


def _as_pieces(rows: np.ndarray) -> list[Piece]:
    """An ``(n, 5)`` integer array as n pieces of Python ints (a column at a
    time: faster than a row at a time for the thousands of a merge)."""
    return list(zip(*rows.T.tolist()))


def starts(pieces: Sequence[Piece]) -> list[int]:
    """Where each piece begins in the entry, and its total size last."""
    out = [0]
    for size, count, _, _, _ in pieces:
        out.append(out[-1] + size * count)
    return out


def spans(pieces: Sequence[Piece], first: Sequence[int], offset: int, end: int
          ) -> Iterator[tuple[int, int, int]]:
    """``(blob, offset in blob, size)`` for bytes ``[offset, end)`` of an
    entry of ``pieces`` whose starts are ``first`` (:func:`starts`)."""
    i = bisect.bisect_right(first, offset) - 1
    pos = offset
    while pos < end:
        size, count, stride, blob, off = pieces[i]
        k, within = divmod(pos - first[i], size)
        while k < count and pos < end:
            take = min(size - within, end - pos)
            yield blob, off + k * stride + within, take
            pos += take
            k, within = k + 1, 0
        i += 1


def blobs_of(pieces: Sequence[Piece]) -> set[int]:
    """The blobs that pieces refer to (not zeros)."""
    return {p[3] for p in pieces if p[3] != ZEROS}
