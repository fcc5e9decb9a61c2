"""A virtual file of many stored byte runs, described by numpy arrays.

A rank's ``samples.npy`` of a shuffled dataset is one run per sample: a
million samples would be a million :class:`~ptcfs.vfile.StoreRange`
objects. :class:`RunFile` keeps the runs as three arrays (chunk, offset,
length) and makes a segment only when a read touches it, so building a
view costs a few numpy operations per sample, not Python objects. It is a
:class:`~ptcfs.vfile.VFile` (``size``, ``spans``); ``segments`` is built
on demand, for inspection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ptcfs.vfile import Literal, Segment, StoreRange, VFile

__all__ = ["RunFile", "merge_runs", "MIN_UNIT"]

#: Below this many bytes per sample, :meth:`RunFile.copy_out` declines (a
#: plain per-run copy is as fast).
MIN_UNIT = 64


def merge_runs(chunk: np.ndarray, offset: np.ndarray, length: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same bytes as fewer runs: a run that continues the previous one
    in the same chunk is joined to it; empty runs are dropped."""
    keep = length > 0
    chunk, offset, length = chunk[keep], offset[keep], length[keep]
    if len(chunk) == 0:
        return chunk, offset, length
    new = np.ones(len(chunk), dtype=bool)
    new[1:] = (chunk[1:] != chunk[:-1]) | (offset[1:] != offset[:-1] + length[:-1])
    starts = np.flatnonzero(new)
    return chunk[starts], offset[starts], np.add.reduceat(length, starts)


class RunFile(VFile):
    """``head`` bytes, then run ``i``: ``length[i]`` bytes from ``offset[i]``
    of the stored entry ``(job, version, tensor, parts[chunk[i]])`` held by
    ``hosts[chunk[i]]``."""

    def __init__(self, head: bytes, job: str, version: int, tensor: str,
                 parts: tuple[str, ...], hosts: tuple[tuple[str, ...], ...],
                 chunk: np.ndarray, offset: np.ndarray, length: np.ndarray):
        c, o, n = merge_runs(np.asarray(chunk, dtype=np.int64),
                             np.asarray(offset, dtype=np.int64),
                             np.asarray(length, dtype=np.int64))
        starts = np.empty(len(n) + 1, dtype=np.int64)
        starts[0] = len(head)
        np.cumsum(n, out=starts[1:])
        starts[1:] += len(head)
        for name, value in (("head", head), ("job", job), ("version", version),
                            ("tensor", tensor), ("parts", parts), ("hosts", hosts),
                            ("_chunk", c), ("_offset", o), ("_length", n),
                            ("_run_starts", starts)):
            object.__setattr__(self, name, value)

    head: bytes
    job: str
    version: int
    tensor: str
    parts: tuple[str, ...]
    hosts: tuple[tuple[str, ...], ...]
    _chunk: np.ndarray
    _offset: np.ndarray
    _length: np.ndarray
    _run_starts: np.ndarray

    @property
    def runs(self) -> int:
        return len(self._length)

    @property
    def size(self) -> int:
        return int(self._run_starts[-1])

    def _segment(self, i: int) -> StoreRange:
        c = int(self._chunk[i])
        return StoreRange(self.job, self.version, self.tensor, self.parts[c],
                          int(self._offset[i]), int(self._length[i]), self.hosts[c])

    @property
    def segments(self) -> tuple[Segment, ...]:  # type: ignore[override]
        head: tuple[Segment, ...] = (Literal(self.head),) if self.head else ()
        return head + tuple(self._segment(i) for i in range(self.runs))

    def spans(self, offset: int, size: int) -> Iterator[tuple[Segment, int, int]]:
        end = min(offset + size, self.size)
        if offset >= end:
            return
        head = len(self.head)
        if offset < head:
            yield Literal(self.head), offset, min(end, head) - offset
        starts = self._run_starts
        i = max(int(np.searchsorted(starts, offset, side="right")) - 1, 0)
        while i < self.runs and starts[i] < end:
            lo, hi = max(offset, int(starts[i])), min(end, int(starts[i + 1]))
            if hi > lo:
                yield self._segment(i), lo - int(starts[i]), hi - lo
            i += 1

    def copy_out(self, offset: int, size: int, out: np.ndarray,
                 source: Callable[[int, str, tuple[str, ...]], np.ndarray | None]) -> bool:
        """Copy ``[offset, offset + size)`` into ``out`` (uint8) with a few
        numpy operations instead of one per run, when every run it touches
        is in an entry that ``source(chunk, part, hosts)`` gives as a whole
        uint8 array here, and the whole runs share a unit of at least
        ``MIN_UNIT`` bytes (fixed-size samples); False (nothing done) if not."""
        end = min(offset + size, self.size)
        head = len(self.head)
        if end <= max(offset, head):
            return False
        starts = self._run_starts
        lo = max(offset, head)
        i0 = max(int(np.searchsorted(starts, lo, side="right")) - 1, 0)
        i1 = int(np.searchsorted(starts, end, side="left"))
        chunks = {int(c) for c in np.unique(self._chunk[i0:i1])}
        src: dict[int, np.ndarray] = {}
        for c in chunks:
            found = source(c, self.parts[c], self.hosts[c])
            if found is None:
                return False
            src[c] = found
        pos = 0
        if offset < head:
            out[:head - offset] = np.frombuffer(self.head, dtype=np.uint8)[offset:]
            pos = head - offset
        # a partial first and last run by slicing; the whole ones between, by units
        first_whole = i0 if starts[i0] >= lo else i0 + 1
        last_whole = i1 if starts[i1] <= end else i1 - 1
        for i in sorted({i0, i1 - 1} - set(range(first_whole, last_whole))):
            a, b = max(lo, int(starts[i])), min(end, int(starts[i + 1]))
            at = int(self._offset[i]) + a - int(starts[i])
            arr = src[int(self._chunk[i])]
            out[pos + a - lo:pos + b - lo] = arr[at:at + b - a]
        if last_whole <= first_whole:
            return True
        w = slice(first_whole, last_whole)
        off, length, chunk = self._offset[w], self._length[w], self._chunk[w]
        unit = int(np.gcd.reduce(np.concatenate([off, length])))
        if unit < MIN_UNIT:
            return False
        k = length // unit
        total = int(k.sum())
        at0 = pos + int(starts[first_whole]) - lo
        dst = out[at0:at0 + total * unit].reshape(total, unit)
        first_unit = np.repeat(off // unit - (np.cumsum(k) - k), k) + np.arange(total)
        for c, arr in src.items():
            rows = arr[: len(arr) // unit * unit].reshape(-1, unit)
            if len(src) == 1:
                np.take(rows, first_unit, axis=0, out=dst)
            else:
                mine = np.flatnonzero(np.repeat(chunk == c, k))
                dst[mine] = rows[first_unit[mine]]
        return True

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return (f"RunFile({self.job!r} v{self.version} {self.tensor!r}, head={len(self.head)} B, "
                f"{self.runs} runs, {self.size} B)")

    def __reduce__(self) -> Any:
        raise TypeError("a RunFile is not meant to be pickled; send its spans")
