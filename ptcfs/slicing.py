"""numpy-style index text (``"0:1024,:"``, ``"3"``, ``"-2:,1"``) → a box.

One parser for the slice suffix of paths under ``/ptc`` (``w.npy[0:4,:]``)
and ``ptcctl tensor get --slice``. Like numpy, an integer drops its
dimension and missing trailing dimensions are whole. Unlike numpy, bounds
outside the dimension, stop before start, steps and ``...`` are refused
(``InvalidRequest``, EINVAL under the mount), so a typo never reads as an
empty or clipped array.
"""

from __future__ import annotations

import re

from ptcfs.errors import InvalidRequest
from ptcfs.types import Box

__all__ = ["parse_index", "parse_box"]

_INT = r"\s*(-?\d+)\s*"
_ITEM = re.compile(rf"{_INT}|\s*(-?\d+)?\s*:\s*(-?\d+)?\s*")


def parse_index(text: str, shape: tuple[int, ...]) -> tuple[Box, tuple[int, ...]]:
    """The box ``text`` selects in a tensor of ``shape``, and the shape of the
    result (integer indices drop their dimension)."""
    items = text.split(",") if text.strip() else []
    if len(items) > len(shape):
        raise InvalidRequest(f"slice [{text}] has {len(items)} dimensions; the tensor has "
                             f"{len(shape)} (shape {list(shape)})")
    box: list[tuple[int, int]] = []
    out: list[int] = []
    for dim, n in enumerate(shape):
        item = items[dim] if dim < len(items) else ":"
        m = _ITEM.fullmatch(item)
        if m is None:
            raise InvalidRequest(f"bad slice item {item.strip()!r} in [{text}]: use start:stop, "
                                 "start:, :stop, : or an index (no steps, no ...)")
        if m.group(1) is not None:
            i = _bound(int(m.group(1)), n, dim, text, index=True)
            box.append((i, i + 1))
            continue
        a = 0 if m.group(2) is None else _bound(int(m.group(2)), n, dim, text)
        b = n if m.group(3) is None else _bound(int(m.group(3)), n, dim, text)
        if b < a:
            raise InvalidRequest(f"slice [{text}]: stop {b} is before start {a} in dimension "
                                 f"{dim}")
        box.append((a, b))
        out.append(b - a)
    return tuple(box), tuple(out)


def parse_box(text: str, shape: tuple[int, ...]) -> Box:
    """The box of :func:`parse_index`, keeping every dimension."""
    return parse_index(text, shape)[0]


def _bound(v: int, n: int, dim: int, text: str, index: bool = False) -> int:
    w = v + n if v < 0 else v
    if not (0 <= w < n if index else 0 <= w <= n):
        what = "index" if index else "bound"
        raise InvalidRequest(f"slice [{text}]: {what} {v} is out of range for dimension {dim} "
                             f"of size {n}")
    return w
