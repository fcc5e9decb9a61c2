"""The order samples are consumed in: one seeded permutation per epoch.

Epoch ``e`` of ``n`` samples under seed ``s`` is the permutation that sorts
the samples by the key ``mix(mix(mix(s) + e) + i)`` (``mix`` is the
splitmix64 finaliser on 64-bit words; ties, practically absent, keep the
lower index first). It is spelled out here, not left to a random generator
whose stream may change between numpy releases: the same dataset gives the
same order on every host and every version, forever.

The *stream* is epoch 0's order, then epoch 1's, and so on: stream index
``t`` is sample ``order(t // n)[t % n]``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["epoch_order", "stream_samples"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=8)
def epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """Sample indices of epoch ``epoch`` in consumption order (read-only int64)."""
    base = _mix(np.array([seed], dtype=np.uint64))
    with np.errstate(over="ignore"):
        salt = _mix(base + np.uint64(epoch))
        keys = _mix(np.arange(count, dtype=np.uint64) + salt[0])
    order = np.argsort(keys, kind="stable").astype(np.int64)
    order.flags.writeable = False
    return order


def stream_samples(count: int, seed: int, start: int, stop: int) -> np.ndarray:
    """Sample indices at stream positions ``[start, stop)`` (int64)."""
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    first, last = start // count, (stop - 1) // count
    orders = [epoch_order(count, seed, e) for e in range(first, last + 1)]
    joined = orders[0] if len(orders) == 1 else np.concatenate(orders)
    base = first * count
    return np.array(joined[start - base:stop - base], dtype=np.int64)
