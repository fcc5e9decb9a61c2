"""Copies from a store's memory map straight to a CUDA device.

A load to the GPU from a store on this machine would copy every byte twice
through the CPU: out of the LMDB map into a pinned buffer, then by DMA to
the device. The first copy is the slow one (about 6 GB/s on an H200 host,
against 53 GB/s for the DMA). Instead, the pages of the map that hold an
entry are registered with CUDA (``cudaHostRegister``, read-only: the map
is), and the device copies them by DMA itself. Registering costs about
60-75 ms a GiB there, paid while the device copies the pages registered
before; the pages are unregistered when the load ends. LMDB never rewrites
a committed value's pages while a read transaction that sees them is
open, so the reader stays open until the device has them.

Only entries of a few runs go this way (stored entries, and views of
whole boxes); a view of a run per row is gathered through pinned buffers
as before (:mod:`ptcfs.client.torchstate`).
"""

from __future__ import annotations

import bisect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ptcfs.store.base import Reader

__all__ = ["PINS", "MapPins", "copy_entry", "registered"]

PAGE = 4096
#: cudaHostRegisterReadOnly: the device only reads the pages (the map is read-only)
READ_ONLY = 8
#: an entry of more runs than this is gathered on the CPU instead
MOST_RUNS = 16


class MapPins:
    """Page ranges of this process registered with CUDA (disjoint, sorted),
    each counted by the loads that use it: a range is registered once and
    unregistered when the last load using it ends, so loads on several
    threads may share pages. One instance per process (:data:`PINS`)."""

    def __init__(self, register: Callable[[int, int], bool] | None = None,
                 unregister: Callable[[int], object] | None = None) -> None:
        """``register(addr, n)`` (True when done) and ``unregister(addr)``:
        the CUDA runtime's, unless given."""
        self._register = register or _cuda_register
        self._unregister = unregister or (lambda a: torch.cuda.cudart().cudaHostUnregister(a))
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._users: dict[int, int] = {}  # start -> loads using it
        self._lock = threading.Lock()
        self.failed = False

    def cover(self, addr: int, n: int, mine: set[int]) -> list[tuple[int, int]] | None:
        """Register what of the pages of ``[addr, addr + n)`` is not yet, count
        the load whose registrations are ``mine`` among their users, and give
        the range cut where registrations meet (a copy stays inside one);
        None if CUDA refused to register them (and from then on)."""
        lo, hi = addr - addr % PAGE, -(-(addr + n) // PAGE) * PAGE
        with self._lock:
            if self.failed:
                return None
            at, i = lo, bisect.bisect_right(self._ends, lo)
            while at < hi:  # the gaps between registrations, left to right
                nxt = self._starts[i] if i < len(self._starts) else hi
                if nxt > at:
                    end = min(nxt, hi)
                    if not self._register(at, end - at):
                        self.failed = True
                        return None
                    self._starts.insert(i, at)
                    self._ends.insert(i, end)
                    self._users[at] = 0
                else:
                    end = self._ends[i]
                if self._starts[i] not in mine:
                    mine.add(self._starts[i])
                    self._users[self._starts[i]] += 1
                at, i = end, i + 1
            cuts, j = [], bisect.bisect_right(self._ends, addr)
            at = addr
            while at < addr + n:
                end = min(self._ends[j], addr + n)
                cuts.append((at, end))
                at, j = end, j + 1
        return cuts

    def __len__(self) -> int:
        """Registrations held now."""
        return len(self._starts)

    def release(self, mine: set[int]) -> None:
        """The load of ``mine`` is done with them: unregister those no other
        load uses."""
        with self._lock:
            for start in mine:
                self._users[start] -= 1
                if self._users[start] == 0:
                    self._unregister(start)
                    i = bisect.bisect_left(self._starts, start)
                    del self._starts[i], self._ends[i], self._users[start]
            mine.clear()


def _cuda_register(addr: int, n: int) -> bool:
    """cudaHostRegister, read-only; a refusal's error is taken back from the
    thread's last CUDA error, so that the next kernel launch check does not
    raise it."""
    import ctypes

    if int(torch.cuda.cudart().cudaHostRegister(addr, n, READ_ONLY)) == 0:
        return True
    try:
        with open("/proc/self/maps") as f:
            lib = next((line.split()[-1] for line in f if "libcudart.so" in line), None)
        if lib is not None:
            ctypes.CDLL(lib).cudaGetLastError()
    except OSError:
        pass
    return False


PINS = MapPins()


@contextmanager
def registered() -> Iterator[set[int]]:
    """A load's registrations, released when the block ends (after every
    copy from them has finished: the caller synchronizes its streams inside
    it)."""
    mine: set[int] = set()
    try:
        yield mine
    finally:
        PINS.release(mine)


def copy_entry(r: Reader, key: tuple[str, int, str, str], dest: torch.Tensor,
               mine: set[int]) -> bool:
    """Enqueue on the current stream the copy of a whole entry into ``dest``
    (flat uint8 on a CUDA device) from the registered pages of the map;
    False, with nothing enqueued, where the entry has too many runs, bytes
    outside the map (a view's zeros), or CUDA refused the pages."""
    views: list[memoryview] = []
    for view in r.ranges(*key):
        views.append(view)
        if len(views) > MOST_RUNS or r.file_range(view) is None:
            return False
    plan: list[tuple[memoryview, int, int]] = []  # a run's bytes, where in dest, how many
    off = 0
    for view in views:
        if not len(view):
            continue
        base = np.frombuffer(view, dtype=np.uint8).ctypes.data
        cuts = PINS.cover(base, len(view), mine)
        if cuts is None:
            return False
        for a, b in cuts:
            plan.append((view[a - base:b - base], off + a - base, b - a))
        off += len(view)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the map is read-only; the device only reads it
        for src, at, n in plan:
            dest[at:at + n].copy_(torch.frombuffer(src, dtype=torch.uint8), non_blocking=True)
    return True
