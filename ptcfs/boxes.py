"""Box arithmetic: the one place where boxes of tensors are computed.

A :data:`Box` is a hyper-rectangle of a tensor, one ``(start, stop)`` pair
per dimension. The planner, the store's readers, the filesystem and the
clients all cut, intersect and move boxes with these functions.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from types import EllipsisType
from typing import Generic, TypeVar

__all__ = [
    "Box",
    "BoxIndex",
    "box_index",
    "box_intersect",
    "box_subtract",
    "box_volume",
    "contiguous_range",
    "full_box",
    "linear_boxes",
    "translate",
]

Box = tuple[tuple[int, int], ...]
T = TypeVar("T")


def full_box(shape: tuple[int, ...]) -> Box:
    """The box that covers a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_volume(box: Box) -> int:
    """Number of elements in ``box`` (0 for an empty box)."""
    v = 1
    for a, b in box:
        if b <= a:
            return 0
        v *= b - a
    return v


def box_intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def translate(box: Box, frm: Box, to: Box) -> Box:
    """``box``, a part of ``frm``, moved to the same place in ``to`` (a box of
    the same extents as ``frm`` in other coordinates)."""
    return tuple((a - f + t, b - f + t) for (a, b), (f, _), (t, _) in zip(box, frm, to))


def box_subtract(box: Box, cuts: list[Box]) -> list[Box]:
    """``box`` minus the union of ``cuts``, as disjoint boxes."""
    out = [box]
    for c in cuts:
        nxt: list[Box] = []
        for b in out:
            nxt.extend(_minus(b, c))
        out = nxt
    return out


def _minus(b: Box, c: Box) -> list[Box]:
    inter = box_intersect(b, c)
    if inter is None:
        return [b]
    out: list[Box] = []
    rest = list(b)
    for d, ((lo, hi), (ilo, ihi)) in enumerate(zip(b, inter)):
        if lo < ilo:
            out.append(tuple(rest[:d]) + ((lo, ilo),) + tuple(rest[d + 1:]))
        if ihi < hi:
            out.append(tuple(rest[:d]) + ((ihi, hi),) + tuple(rest[d + 1:]))
        rest[d] = (ilo, ihi)
    return out


def box_index(box: Box) -> tuple[slice | EllipsisType, ...]:
    """A numpy (or torch) index for a box: always a view, a 0-d one too."""
    return (*(slice(a, b) for a, b in box), ...)


class BoxIndex(Generic[T]):
    """Boxes (with a payload each) that can be asked which of them meet a
    box, without looking at all of them: sorted by their first dimension.

    Boxes that are identical or disjoint along the first dimension (every
    layout of :mod:`ptcfs.sharding` makes such boxes) are found in
    logarithmic time plus the number of hits.
    """

    def __init__(self, items: Sequence[tuple[Box, T]]):
        self._items = sorted(items, key=lambda it: it[0][0] if it[0] else (0, 0))
        self._starts = [it[0][0][0] if it[0] else 0 for it in self._items]
        ends, top = [], -1
        for box, _ in self._items:
            top = max(top, box[0][1] if box else 1)
            ends.append(top)
        self._ends = ends  # running maximum of the ends: sorted

    def meeting(self, box: Box) -> Iterator[tuple[Box, Box, T]]:
        """``(intersection, stored box, payload)`` of every stored box that meets ``box``."""
        lo, hi = box[0] if box else (0, 1)
        first = bisect.bisect_right(self._ends, lo)
        last = bisect.bisect_left(self._starts, hi)
        for i in range(first, last):
            stored, payload = self._items[i]
            inter = box_intersect(box, stored)
            if inter is not None:
                yield inter, stored, payload


def contiguous_range(box: Box, shape: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """``(byte offset, byte length)`` of ``box`` in a C-order tensor of
    ``shape`` when its elements are one contiguous run, else None."""
    if len(box) != len(shape) or not all(0 <= a <= b <= n for (a, b), n in zip(box, shape)):
        return None
    inner = len(box)  # dims from `inner` on must be whole
    while inner > 0 and box[inner - 1] == (0, shape[inner - 1]):
        inner -= 1
    if any(b - a != 1 for a, b in box[:max(inner - 1, 0)]):
        return None
    offset, stride = 0, itemsize
    for (a, _), n in zip(reversed(box), reversed(shape)):
        offset += a * stride
        stride *= n
    return offset, itemsize * math.prod(b - a for a, b in box)


def linear_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a C-order array of ``shape`` as
    boxes, in order; each box is one contiguous run of the array."""
    if not shape:
        return [()] if start < stop else []
    out: list[Box] = []

    def walk(prefix: Box, dims: tuple[int, ...], lo: int, hi: int) -> None:
        if lo >= hi:
            return
        inner = math.prod(dims[1:])
        rest = tuple((0, n) for n in dims[1:])
        if lo % inner == 0 and hi % inner == 0:
            out.append(prefix + ((lo // inner, hi // inner),) + rest)
            return
        first, last = lo // inner, (hi - 1) // inner
        if first == last:
            walk(prefix + ((first, first + 1),), dims[1:], lo - first * inner, hi - first * inner)
            return
        whole_lo, whole_hi = first, last + 1
        if lo % inner:
            walk(prefix + ((first, first + 1),), dims[1:], lo - first * inner, inner)
            whole_lo = first + 1
        if hi % inner:
            whole_hi = last
        if whole_lo < whole_hi:
            out.append(prefix + ((whole_lo, whole_hi),) + rest)
        if hi % inner:
            walk(prefix + ((last, last + 1),), dims[1:], 0, hi - last * inner)

    walk((), shape, start, stop)
    return out
