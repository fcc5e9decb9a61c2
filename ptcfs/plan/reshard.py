"""Moving tensor bytes by slices and boxes, in memory, with numpy.

These are the byte-level operations every executor uses: cut a logical
tensor into the sub-tensor a slice describes, put sub-tensors back
together, and carry out one transfer from a source array to a destination
array. They copy only the boxes named, through numpy views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from ptcfs.boxes import box_index
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidRequest
from ptcfs.types import Slice, TensorSpec, Transfer

__all__ = ["cut", "merge", "apply_transfers", "empty_subtensor"]


def empty_subtensor(spec: TensorSpec, sl: Slice) -> np.ndarray:
    """A zero-filled array of the sub-tensor's local shape and dtype."""
    return np.zeros(sl.local_shape(spec.shape), dtype=numpy_dtype(spec.dtype))


def cut(spec: TensorSpec, sl: Slice, logical: np.ndarray) -> np.ndarray:
    """The sub-tensor ``sl`` of a logical tensor (padding rows are zero)."""
    if tuple(logical.shape) != spec.shape:
        raise InvalidRequest(
            f"{spec.name}: logical tensor has shape {tuple(logical.shape)}, expected {spec.shape}"
        )
    if sl.is_full:
        return logical.copy(order="C")
    out = empty_subtensor(spec, sl)
    for lbox, local in sl.pieces(spec.shape):
        out[box_index(local)] = logical[box_index(lbox)]
    return out


def merge(spec: TensorSpec, parts: Iterable[tuple[Slice, np.ndarray]]) -> np.ndarray:
    """Put a logical tensor back together from sub-tensors that cover it."""
    out = np.empty(spec.shape, dtype=numpy_dtype(spec.dtype))
    covered = 0
    seen: set[Slice] = set()
    for sl, arr in parts:
        if sl in seen:
            continue
        seen.add(sl)
        for lbox, local in sl.pieces(spec.shape):
            out[box_index(lbox)] = arr[box_index(local)]
            covered += int(np.prod([b - a for a, b in lbox]))
    if covered != out.size:
        raise InvalidRequest(
            f"{spec.name}: the sub-tensors given cover {covered} of {out.size} elements"
        )
    return out


Lookup = Callable[[str, str, Slice], np.ndarray]


def apply_transfers(transfers: Iterable[Transfer], src: Lookup, dst: Lookup) -> int:
    """Carry out transfers between arrays; returns the bytes copied.

    ``src(host, tensor, slice)`` and ``dst(host, tensor, slice)`` return the
    arrays of sub-tensors (``dst`` arrays are written in place).
    """
    moved = 0
    for t in transfers:
        a = src(t.src.host, t.src.tensor, t.src.slice)[box_index(t.src.box)]
        b = dst(t.dst.host, t.dst.tensor, t.dst.slice)
        view = b[box_index(t.dst.box)]
        if view.shape != a.shape:
            raise InvalidRequest(
                f"transfer of {t.dst.tensor}: source box {t.src.box} and destination box "
                f"{t.dst.box} differ in shape"
            )
        view[...] = a
        moved += a.nbytes
    return moved
