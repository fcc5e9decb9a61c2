"""Argument checks every store backend applies the same way, and tunables.

Each returns the checked value (normalised) or raises InvalidRequest naming
what is wrong, so two backends cannot drift apart on what they accept.
Tunables are layered (:mod:`ptcfs.settings`): an explicit argument wins over
a ``PTC_*`` environment variable, which wins over the default.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import msgpack
import numpy as np

from ptcfs import settings
from ptcfs.errors import InvalidRequest, JobBusy, VersionImmutable
from ptcfs.store.base import Buffer
from ptcfs.types import DTYPE_SIZES

__all__ = [
    "check_writable",
    "check_data",
    "check_name",
    "check_range",
    "check_shape",
    "check_version",
    "copy_meta",
    "not_committed",
    "tunable",
]


def check_name(kind: str, value: object) -> str:
    """``value`` if it is a usable job, tensor or part name."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise InvalidRequest(f"bad {kind} name {value!r}: must be non-empty text without NUL")
    return value


def check_version(version: object) -> int:
    """``version`` if it is a whole number in ``[0, 2**63)``."""
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 1 << 63:
        raise InvalidRequest(f"bad version {version!r}: must be a whole number >= 0")
    return version


def check_shape(what: str, shape: tuple[int, ...], dtype: str) -> tuple[tuple[int, ...], int]:
    """``shape`` as ints and the bytes it takes of ``dtype``."""
    if dtype not in DTYPE_SIZES:
        raise InvalidRequest(f"{what}: unknown dtype {dtype!r} (known: {sorted(DTYPE_SIZES)})")
    try:
        shape = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise InvalidRequest(f"{what}: shape {shape!r} is not a tuple of integers") from None
    if any(n < 0 for n in shape):
        raise InvalidRequest(f"{what}: shape {shape} has a negative dimension")
    return shape, math.prod(shape) * DTYPE_SIZES[dtype]


def check_data(what: str, data: Buffer, shape: tuple[int, ...], dtype: str
               ) -> tuple[memoryview, tuple[int, ...]]:
    """``data`` as a flat C-order byte view and ``shape`` as ints, after
    checking that ``data`` holds exactly ``shape`` of ``dtype``."""
    shape, nbytes = check_shape(what, shape, dtype)
    try:
        if isinstance(data, np.ndarray):
            view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        else:
            view = memoryview(data).cast("B")
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{what}: data must be a contiguous buffer ({e})") from None
    if view.nbytes != nbytes:
        raise InvalidRequest(f"{what}: got {view.nbytes} bytes, but shape {shape} of {dtype} "
                             f"needs {nbytes}")
    return view, shape


def check_range(what: str, nbytes: int, offset: int, length: int | None) -> int:
    """The end of ``[offset, offset+length)`` if it lies within ``nbytes`` bytes."""
    if not isinstance(offset, int) or not isinstance(length, int | None):
        raise InvalidRequest(f"range of {what}: offset and length must be integers")
    end = nbytes if length is None else offset + length
    if offset < 0 or end < offset or end > nbytes:
        raise InvalidRequest(f"range offset={offset} length={length} is outside {what} "
                             f"of {nbytes} bytes")
    return end


def check_writable(job: str, version: int, state: str, meta: dict[str, Any],
                   mark: str | None) -> None:
    """A put into ``version`` (in ``state``, with ``meta``) may go on: it is
    staging, and with ``mark``, its metadata has that key set (a version
    opened for saving; JobBusy once a reconfiguration took its number)."""
    if state == "committed":
        raise VersionImmutable(f"job {job!r} version {version} is committed; "
                               "begin a new version to write")
    if mark is not None and not meta.get(mark):
        raise JobBusy(f"job {job!r} version {version} is no longer open for saving (a "
                      "reconfiguration dropped the save): write the state again")


def not_committed(job: str, version: int, state: str) -> str:
    """Why a read of a version that is not committed is refused."""
    return (f"job {job!r} version {version} is {state} here, not committed: it cannot be "
            "read until it is")


def copy_meta(meta: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy of version metadata as a store gives it back (msgpack
    types: tuples become lists), or InvalidRequest if it cannot be stored."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidRequest(f"version metadata must be a dict, not {type(meta).__name__}")
    try:
        out: dict[str, Any] = msgpack.unpackb(msgpack.packb(meta), strict_map_key=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequest(f"version metadata cannot be stored: {e}") from e
    return out


def tunable(arg: int | None, env: str) -> int:
    """A positive size: the explicit argument, else setting ``env``
    (:mod:`ptcfs.settings`: the environment, else its default)."""
    value = settings.get(env, arg)
    if not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{env.removeprefix('PTC_STORE_').lower()}={value!r} "
                             "must be a positive whole number of bytes")
    return int(value)
