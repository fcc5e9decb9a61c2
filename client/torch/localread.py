"""Reading a host's store directly, when it is on this machine.

A rank's state usually lives on the rank's own host, in the LMDB store its
daemon writes. LMDB serves several processes at once, so a loader on that
host can open the store read-only and copy sub-tensors straight out of its
memory map, instead of asking the daemon to send them over a socket. The
daemon stays the only writer. Anything that stops the direct path (another
machine, a store already open in this process, a store this user may not
read, ``PTC_CLIENT_LOCAL_STORE=0``) falls back to the daemon.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ptcfs import settings
from ptcfs.client.control.conn import Cluster
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import PtcError
from ptcfs.store.boxes import gather_box
from ptcfs.store.lmdb_store import LmdbStore
from ptcfs.types import Box

__all__ = ["ByteSource", "LocalStore", "source_for"]


class ByteSource(Protocol):
    """Where a loader reads sub-tensor bytes from (a daemon or a local store)."""

    def read_into(self, job: str, version: int, tensor: str, part: str, offset: int = 0,
                  length: int | None = None, out: Any = None, *,
                  progress: Callable[[int], None] | None = None) -> Any: ...

    def read_box(self, job: str, version: int, tensor: str, part: str, box: Box,
                 itemsize: int | None = None, out: Any = None, *,
                 progress: Callable[[int], None] | None = None) -> Any: ...


class LocalStore:
    """A host's store opened read-only in this process."""

    def __init__(self, store: LmdbStore):
        self.store = store

    def read_into(self, job: str, version: int, tensor: str, part: str, offset: int = 0,
                  length: int | None = None, out: Any = None, *,
                  progress: Callable[[int], None] | None = None) -> Any:
        with self.store.reader() as r:
            r.check_committed(job, version)
            if length is None:
                length = r.info(job, version, tensor, part).nbytes - offset
            dst = np.frombuffer(out, dtype=np.uint8) if out is not None else \
                np.empty(length, dtype=np.uint8)
            r.read_into(job, version, tensor, part, offset, dst[:length])
            if progress is not None:
                progress(length)
        return dst

    def read_many(self, job: str, version: int, reads: Iterable[tuple[str, str, Any]], *,
                  progress: Callable[[int], None] | None = None) -> None:
        """Each ``(tensor, part, out)`` of ``reads``: the entry's first
        ``len(out)`` bytes into ``out``, all from one snapshot (one reader,
        the version's state looked up once)."""
        with self.store.reader() as r:
            r.check_committed(job, version)
            for tensor, part, out in reads:
                dst = np.frombuffer(out, dtype=np.uint8)
                r.read_into(job, version, tensor, part, 0, dst)
                if progress is not None:
                    progress(dst.size)

    def read_box(self, job: str, version: int, tensor: str, part: str, box: Box,
                 itemsize: int | None = None, out: Any = None, *,
                 progress: Callable[[int], None] | None = None) -> Any:
        with self.store.reader() as r:
            r.check_committed(job, version)
            info = r.info(job, version, tensor, part)
            size = itemsize or numpy_dtype(info.dtype).itemsize
            nbytes = size * math.prod(b - a for a, b in box)
            dst = np.frombuffer(out, dtype=np.uint8) if out is not None else \
                np.empty(nbytes, dtype=np.uint8)
            gather_box(r, (job, version, tensor, part), info.shape, size, box, dst)
        if progress is not None:
            progress(nbytes)
        return dst


_OPEN: dict[str, LocalStore | None] = {}
_LOCK = threading.Lock()


def _may_read(path: Path) -> bool:
    """Whether this process's user may open the store at ``path`` read-only:
    LMDB's readers need the folder, the data file and the lock file (where
    they take a reader slot). A store is its daemon user's only (0700): any
    other user reads through the daemon."""
    return (os.access(path, os.R_OK | os.X_OK)
            and os.access(path / "data.mdb", os.R_OK)
            and os.access(path / "lock.mdb", os.R_OK | os.W_OK))


def source_for(cluster: Cluster, host: str) -> ByteSource:
    """The fastest way to read ``host``'s store from here."""
    peer = cluster.client(host).peer
    if not settings.get("PTC_CLIENT_LOCAL_STORE"):
        return peer
    path = str(Path(cluster.spec.host(host).store).resolve())
    with _LOCK:
        if path not in _OPEN:
            local: LocalStore | None = None
            if _may_read(Path(path)):
                try:
                    local = LocalStore(LmdbStore(path, readonly=True))
                except PtcError:
                    local = None  # open here already (a daemon in this process), or unreadable
            _OPEN[path] = local
        found = _OPEN[path]
    return found if found is not None else peer
