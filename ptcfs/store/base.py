"""The tensor store contract: what every store backend provides.

A store holds sub-tensors under ``(job, version, tensor, part)`` where
``part`` is a :meth:`ptcfs.types.Slice.key` (or any short text naming a
piece of a tensor, such as a dataset chunk). Bytes are C-order.

Versions. The order of calls for one new version of a job:

1. ``begin(job, meta)`` creates a *staging* version and returns its number
   (one more than the highest the job ever had).
2. ``put(...)`` any number of times, from any thread, into that version.
3. ``commit(job, version, meta)`` atomically makes it *committed* and the
   job's current version; from then on it is immutable.
   Or ``abort(job, version)`` drops it and everything put into it.

A crash anywhere before ``commit`` returns leaves the previous current
version current and whole; the staging version stays listed (state
``"staging"``) until someone aborts it or commits it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ptcfs.store.views import ViewEntry, ViewRef
from ptcfs.types import DamagedEntry, Slice

__all__ = ["EntryInfo", "PutEntry", "VersionInfo", "TensorStore", "Reader", "part_key", "ZERO_FD"]

#: The ``fd`` of zeros in :meth:`Reader.file_ranges`.
ZERO_FD = -1

Buffer = bytes | bytearray | memoryview | np.ndarray


def part_key(part: Slice | str) -> str:
    """The text a store uses for a part."""
    return part.key() if isinstance(part, Slice) else part


@dataclass(frozen=True)
class EntryInfo:
    """What a store knows of one stored sub-tensor."""

    tensor: str
    part: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    #: when a ``put`` stored it whole (the store's wall clock, in seconds); None
    #: for a view (``put_view``: a copy or reshard of other entries)
    written: float | None = None


@dataclass(frozen=True)
class PutEntry:
    """One sub-tensor of :meth:`TensorStore.put_many`."""

    tensor: str
    part: Slice | str
    data: Buffer
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class VersionInfo:
    """One version of a job: its number, state and metadata."""

    job: str
    version: int
    state: str  # "staging" or "committed"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


class Reader(ABC):
    """A consistent snapshot of the store, open for reading.

    Buffers it returns are valid only until the reader is closed; they may
    be zero-copy views of the store's memory.
    """

    @abstractmethod
    def info(self, job: str, version: int, tensor: str, part: Slice | str) -> EntryInfo:
        """Metadata of one entry; TensorNotFound if absent."""

    @abstractmethod
    def check_committed(self, job: str, version: int) -> None:
        """Raise VersionNotCommitted unless ``version`` of ``job`` is
        committed in this snapshot (VersionNotFound where it is absent): a
        staging version (a stage, a save, a roll-forward under way) is not a
        version anyone may read yet."""

    @abstractmethod
    def ranges(
        self,
        job: str,
        version: int,
        tensor: str,
        part: Slice | str,
        offset: int = 0,
        length: int | None = None,
    ) -> Iterator[memoryview]:
        """The bytes ``[offset, offset+length)`` of an entry, as consecutive
        buffers (zero-copy where the backend allows). ``length=None`` reads
        to the end. Out-of-range requests raise InvalidRequest."""

    def gathered(self, job: str, version: int, tensor: str, part: Slice | str, offset: int,
                 length: int, most: int = 16) -> list[memoryview]:
        """The bytes ``[offset, offset+length)`` of an entry as at most
        ``most`` buffers: the zero-copy ones of :meth:`ranges` where they
        are that few, else one copy of them all (:meth:`read_into`, which
        copies a strided piece in one step). A view's range may be one run
        per row; handed on run by run, it costs the daemon more than the
        copy does (768 rows of a column-split weight: 6-16 ms against 0.6)."""
        views: list[memoryview] = []
        for view in self.ranges(job, version, tensor, part, offset, length):
            views.append(view)
            if len(views) > most:
                break
        else:
            return views
        out = np.empty(length, dtype=np.uint8)
        self.read_into(job, version, tensor, part, offset, out)
        return [out.data]

    def file_range(self, view: memoryview) -> tuple[int, int] | None:
        """Where a buffer returned by :meth:`ranges` lies in a file: ``(fd,
        offset)``, valid while this reader is open, so that the kernel can
        send those bytes on without a copy in this process (``splice``).
        None when the backend keeps no such file."""
        return None

    def file_ranges(self, job: str, version: int, tensor: str, part: Slice | str
                    ) -> list[tuple[int, int, int]] | None:
        """Where a whole entry's bytes lie in files, in order, as ``(fd,
        offset, size)`` (see :meth:`file_range`), ``fd`` :data:`ZERO_FD` for
        zeros that no file holds (a view's padding); None when some of them
        lie in no such file."""
        out = []
        for view in self.ranges(job, version, tensor, part):
            where = self.file_range(view)
            if where is None:
                return None
            out.append((where[0], where[1], len(view)))
        return out

    def placement(self, job: str, version: int, tensor: str, part: Slice | str) -> Hashable:
        """A token naming where an entry's bytes lie in the backend's files:
        two snapshots (of one open store) that give the same token hold the
        entry's bytes at the same :meth:`file_range`, so what was looked up in
        one is valid in the other while it is open. None when the backend
        promises nothing of the kind. TensorNotFound if absent."""
        return None

    def read(
        self,
        job: str,
        version: int,
        tensor: str,
        part: Slice | str,
        offset: int = 0,
        length: int | None = None,
    ) -> bytes:
        """The bytes of a range, copied into one ``bytes``."""
        return b"".join(bytes(m) for m in self.ranges(job, version, tensor, part, offset, length))

    def read_into(self, job: str, version: int, tensor: str, part: Slice | str, offset: int,
                  out: np.ndarray) -> None:
        """Copy the bytes ``[offset, offset + out.size)`` of an entry into
        ``out`` (flat, uint8, contiguous). Backends that keep views may copy
        a strided piece in one step instead of run by run."""
        pos = 0
        for m in self.ranges(job, version, tensor, part, offset, out.size):
            n = len(m)
            out[pos:pos + n] = np.frombuffer(m, dtype=np.uint8)
            pos += n

    def read_array(self, job: str, version: int, tensor: str, part: Slice | str) -> np.ndarray:
        """The whole entry as a new, writable numpy array of its shape."""
        from ptcfs.dtypes import numpy_dtype

        info = self.info(job, version, tensor, part)
        out = np.empty(info.nbytes, dtype=np.uint8)
        pos = 0
        for m in self.ranges(job, version, tensor, part):
            n = len(m)
            out[pos : pos + n] = np.frombuffer(m, dtype=np.uint8)
            pos += n
        return out.view(numpy_dtype(info.dtype)).reshape(info.shape)

    @abstractmethod
    def close(self) -> None:
        """End the snapshot; buffers handed out become invalid."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorStore(ABC):
    """A host's store of sub-tensors, versioned per job."""

    #: an id written when the store was made (None where a backend keeps none)
    store_id: str | None = None
    #: whether opening it made it: it held nothing before
    created: bool = False

    # --- versions -----------------------------------------------------
    @abstractmethod
    def begin(self, job: str, meta: dict[str, Any] | None = None) -> int:
        """Create a new staging version of ``job`` (creating the job if new)."""

    @abstractmethod
    def begin_at(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        """Create staging version ``version`` (a coordinator picks the number
        so that every host stages the same one). Idempotent for a staging
        version; VersionImmutable if it is committed."""

    @abstractmethod
    def commit(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        """Atomically make a staging version committed and current. ``meta``
        is merged into the version's metadata. Committing an already
        committed version is a no-op."""

    @abstractmethod
    def update_meta(self, job: str, changes: dict[str, Any]) -> int:
        """Merge ``changes`` into the metadata of every version of ``job``,
        staging or committed, in one transaction (who owns the job and may
        change it); returns how many versions there are."""

    @abstractmethod
    def abort(self, job: str, version: int) -> None:
        """Drop a staging version and its entries (no-op if absent)."""

    @abstractmethod
    def delete_version(self, job: str, version: int) -> None:
        """Drop a committed version that is not current."""

    @abstractmethod
    def delete_job(self, job: str) -> int:
        """Drop every version of ``job``, staging or committed, and the job
        itself, in one transaction; returns how many versions there were
        (0 for a job the store does not know)."""

    @abstractmethod
    def current(self, job: str) -> int | None:
        """The job's current (latest committed) version, None if none."""

    @abstractmethod
    def versions(self, job: str) -> list[VersionInfo]:
        """Every version of the job, committed or staging, oldest first."""

    @abstractmethod
    def jobs(self) -> list[str]:
        """Names of every job with at least one version."""

    def changes(self) -> int | None:
        """A number that differs once anything was written since it was
        read (the last write transaction's), for caches of what the store
        holds; None where the store keeps none (read again each time)."""
        return None

    # --- entries ------------------------------------------------------
    @abstractmethod
    def put(
        self,
        job: str,
        version: int,
        tensor: str,
        part: Slice | str,
        data: Buffer,
        shape: tuple[int, ...],
        dtype: str,
        mark: str | None = None,
        written: float | None = None,
    ) -> None:
        """Store one sub-tensor into a staging version (replacing any entry
        of the same key). ``data`` holds exactly ``prod(shape) * itemsize``
        bytes. VersionImmutable for a committed version; with ``mark``,
        JobBusy unless the version's metadata has that key set (checked in
        the same transaction as the write). ``written``: when the writer
        sent it (``time.time()`` on this host; default now). An entry of the
        key written later is kept and this put dropped: a put that arrives
        late (sent before a daemon was stopped, read when it went on, after
        its writer had given up and written again) never replaces a newer one."""

    @abstractmethod
    def put_many(self, job: str, version: int, entries: Sequence[PutEntry],
                 mark: str | None = None, written: float | None = None) -> None:
        """:meth:`put` of each of ``entries`` (small sub-tensors of one
        save, sent in one request): every entry is checked before any is
        stored, so one that :meth:`put` would refuse stores none."""

    @abstractmethod
    def put_view(
        self,
        job: str,
        version: int,
        tensor: str,
        part: Slice | str,
        shape: tuple[int, ...],
        dtype: str,
        refs: Sequence[ViewRef],
        data: Buffer | None = None,
    ) -> None:
        """Store one sub-tensor into a staging version as a *view*: each of
        ``refs`` says that a box of it is a box of an entry of an earlier
        version of the job (committed or staging, of the same element size),
        whose bytes it shares instead of copying them; the rest of it is
        taken from ``data`` (the whole sub-tensor's bytes, of which only
        those outside the refs' boxes are read) or is zeros when ``data`` is
        None. Reads of the view give the same bytes as a ``put`` of the
        whole; the shared bytes stay as long as any entry refers to them,
        whichever versions are deleted. One transaction, like ``put``; an
        ``abort`` drops it. InvalidRequest when boxes overlap or do not fit,
        TensorNotFound when a ref names no entry."""

    def put_views(self, job: str, version: int, entries: Sequence[ViewEntry]) -> None:
        """``put_view`` of each of ``entries``, for callers that make many
        small views at once (a reshard within hosts): a backend may write
        them in one transaction (the LMDB store does: every one or none)."""
        for e in entries:
            self.put_view(job, version, e.tensor, e.part, e.shape, e.dtype, e.refs, e.data)

    @abstractmethod
    def entries(self, job: str, version: int) -> list[EntryInfo]:
        """Every entry of a version, sorted by (tensor, part)."""

    @abstractmethod
    def reader(self) -> AbstractContextManager[Reader]:
        """Open a consistent read snapshot (use as a context manager)."""

    # --- housekeeping -------------------------------------------------
    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Sizes and counts, for status displays: among them ``stored_bytes``
        (bytes held once, whichever entries share them) and
        ``referenced_bytes`` (bytes of views that are another entry's)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; the object is unusable afterwards."""

    # --- integrity at rest (ptcfs.store.integrity) -----------------------
    def scrub(self, after: bytes | None = None, budget: int = 64 << 20
              ) -> tuple[list[DamagedEntry], bytes | None, int]:
        """Read about ``budget`` bytes of chunks back from cursor ``after``
        (None: the start) against the checksums written with them, and
        quarantine every entry of a chunk that no longer matches (taken out
        of its version: reads raise TensorNotFound, and it is listed by
        :meth:`damaged` until its version is dropped). Returns the entries
        quarantined, the cursor to go on from (None: the end was reached)
        and the bytes read. A backend whose bytes cannot change at rest
        (memory) has nothing to check."""
        return [], None, 0

    def damaged(self) -> list[DamagedEntry]:
        """The entries scrubs quarantined whose versions are still here."""
        return []

    def check_file(self) -> str | None:
        """One line saying what is wrong with the store's files under the
        open store (deleted, replaced, cut short), or None."""
        return None

    # --- conveniences built on the above --------------------------------
    def get(self, job: str, version: int, tensor: str, part: Slice | str) -> np.ndarray:
        """One whole sub-tensor as a new numpy array."""
        with self.reader() as r:
            return r.read_array(job, version, tensor, part)

    def info(self, job: str, version: int, tensor: str, part: Slice | str) -> EntryInfo:
        """Metadata of one entry; TensorNotFound if absent."""
        with self.reader() as r:
            return r.info(job, version, tensor, part)

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
