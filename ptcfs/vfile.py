"""Virtual files: a file under the mount described as a list of byte segments.

A file's bytes are never materialised whole: a :class:`VFile` says which
literal bytes (a header) and which byte ranges of stored entries, on which
hosts, make up the file, in order. The filesystem serves any ``(offset,
size)`` read from the segments it overlaps (:meth:`VFile.spans`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Literal", "StoreRange", "Segment", "VFile"]


@dataclass(frozen=True)
class Literal:
    """Bytes held in memory (headers, small generated files)."""

    data: bytes

    @property
    def length(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class StoreRange:
    """``length`` bytes from ``offset`` of one stored entry (C-order bytes of
    ``tensor``/``part`` in ``job`` version ``version``), held by ``hosts``
    (any of them will do; local first)."""

    job: str
    version: int
    tensor: str
    part: str
    offset: int
    length: int
    hosts: tuple[str, ...]


Segment = Literal | StoreRange


@dataclass(frozen=True)
class VFile:
    """A read-only file made of ``segments`` in order."""

    segments: tuple[Segment, ...]
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts, pos = [], 0
        for s in self.segments:
            starts.append(pos)
            pos += s.length
        object.__setattr__(self, "_starts", tuple(starts))

    @classmethod
    def of_bytes(cls, data: bytes) -> VFile:
        return cls((Literal(data),))

    @property
    def size(self) -> int:
        if not self.segments:
            return 0
        return self._starts[-1] + self.segments[-1].length

    def spans(self, offset: int, size: int) -> Iterator[tuple[Segment, int, int]]:
        """``(segment, offset in segment, length)`` covering ``[offset,
        offset + size)`` clipped to the file, in order."""
        end = min(offset + size, self.size)
        if offset >= end:
            return
        i = bisect.bisect_right(self._starts, offset) - 1
        while i < len(self.segments) and self._starts[i] < end:
            seg, start = self.segments[i], self._starts[i]
            lo, hi = max(offset, start), min(end, start + seg.length)
            if hi > lo:
                yield seg, lo - start, hi - lo
            i += 1
