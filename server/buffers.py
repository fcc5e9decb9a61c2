"""Staging buffers a daemon keeps from one reconfiguration to the next.

A stage builds each new sub-tensor in a buffer before it goes into the
store. Memory the process has not touched yet costs a page fault and a
zeroed page per 4 KiB (and on VMs whose host takes back the memory a guest
frees, a fault in the host as well), which ran slower than the copies that
fill the buffer. So the daemon keeps the buffers its stages used, up to
``PTC_STAGE_KEEP_BYTES`` in all (default: an eighth of the host's memory,
at most 2 GiB; 0 keeps none), and the next stage takes them again.

Call order: :meth:`BufferPool.take` for a buffer of at least ``n`` bytes
(the smallest kept one that fits, else a new one), :meth:`BufferPool.give`
to hand it back when its bytes are in the store. Between stages the daemon
calls :meth:`BufferPool.prepare` with the sizes the next stage will likely
want (the biggest whole tensors of its jobs' models, :func:`whole_sizes`,
and its own biggest sub-tensors, one per staging thread), so that even the
first reconfiguration finds its buffers touched. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ptcfs import settings
from ptcfs.errors import PtcError
from ptcfs.jobstate import JobState

__all__ = ["BufferPool", "keep_bytes", "whole_sizes"]


def keep_bytes() -> int:
    """``PTC_STAGE_KEEP_BYTES`` (:mod:`ptcfs.settings`)."""
    return int(settings.get("PTC_STAGE_KEEP_BYTES"))


def whole_sizes(meta: dict[str, object]) -> list[int]:
    """Bytes of each whole tensor of the model a version's metadata names,
    padded as for tp=1: the biggest a sub-tensor of that job can be. Empty
    when the metadata names no model (a dataset's version)."""
    try:
        state = JobState.from_meta(meta)
        tensors = state.model_spec().tensors_for(state.config.pp)
    except (PtcError, KeyError, TypeError, ValueError):
        return []
    sizes = []
    for t in tensors:
        n, r = t.nbytes, t.rule
        if r.pad_multiple and r.split_dim is not None and t.shape[r.split_dim]:
            length = t.shape[r.split_dim]
            n = n // length * (-(-length // r.pad_multiple) * r.pad_multiple)
        sizes.append(n)
    return sizes


class BufferPool:
    """Byte buffers (``numpy.uint8`` arrays) kept up to ``keep_bytes`` in all."""

    def __init__(self, keep: int | None = None):
        self.keep_bytes = keep_bytes() if keep is None else max(0, keep)
        self._lock = threading.Lock()
        self._kept: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` bytes (contents undefined)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._kept) if b.nbytes >= nbytes]
            if fits:  # the smallest that fits (by position: arrays compare by value)
                return self._kept.pop(min(fits, key=lambda i: self._kept[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Hand ``buf`` back. It is kept if it fits under ``keep_bytes``
        (dropping smaller kept buffers to make room for a bigger one)."""
        with self._lock:
            if buf.nbytes > self.keep_bytes:
                return
            self._kept.append(buf)
            self._kept.sort(key=lambda b: -b.nbytes)
            total = 0
            keep = []
            for b in self._kept:
                if total + b.nbytes <= self.keep_bytes:
                    keep.append(b)
                    total += b.nbytes
            self._kept = keep

    def prepare(self, sizes: list[int], stop: Callable[[], bool] | None = None) -> int:
        """Have buffers of ``sizes`` bytes kept and touched, ahead of a stage
        (those that fit under ``keep_bytes``, biggest first); the bytes of
        new buffers made. Stops early when ``stop()`` says so."""
        with self._lock:
            have = sorted((b.nbytes for b in self._kept), reverse=True)
        made = 0
        budget = self.keep_bytes
        for n in sorted(sizes, reverse=True):
            if n > budget or (stop is not None and stop()):
                break
            budget -= n
            if have and have[0] >= n:
                have.pop(0)
                continue
            buf = np.empty(n, dtype=np.uint8)
            buf.fill(0)  # touch every page now, not during the stage
            self.give(buf)
            made += n
        return made

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._kept)

    @property
    def largest(self) -> int:
        """Bytes of the biggest buffer kept (0: none)."""
        with self._lock:
            return max((b.nbytes for b in self._kept), default=0)
