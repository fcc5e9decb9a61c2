"""An in-process tensor store: dicts behind one lock, nothing on disk.

Same semantics as :class:`ptcfs.store.lmdb_store.LmdbStore` (the contract
suite runs against both), for unit tests of the layers above the store.
Entries are pieces (:mod:`ptcfs.store.views`) of immutable ``bytes``
blobs, so a reader's snapshot is a shallow copy of the dicts and its ranges
are zero-copy views of those bytes. A blob goes when no entry refers to it
(a scan at each drop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ptcfs.errors import (
    InvalidRequest,
    JobNotFound,
    PtcError,
    StoreError,
    TensorNotFound,
    VersionImmutable,
    VersionNotCommitted,
    VersionNotFound,
)
from ptcfs.store.base import Buffer, EntryInfo, PutEntry, Reader, TensorStore, VersionInfo, part_key
from ptcfs.store.checks import (
    check_data,
    check_name,
    check_range,
    check_shape,
    check_version,
    check_writable,
    copy_meta,
    not_committed,
)
from ptcfs.store.views import ZEROS, Piece, ViewRef, blobs_of, pack, spans, starts, view_runs
from ptcfs.types import DTYPE_SIZES, Slice

__all__ = ["MemoryStore"]

_Key = tuple[str, int, str, str]
_ZERO = memoryview(bytes(1 << 16))


@dataclass(frozen=True)
class _Entry:
    info: EntryInfo
    pieces: tuple[Piece, ...]
    first: tuple[int, ...]  # starts(pieces)
    own: int  # the entry's own blob


def _entry(info: EntryInfo, pieces: Sequence[Piece], own: int) -> _Entry:
    return _Entry(info, tuple(pieces), tuple(starts(pieces)), own)


@dataclass
class _Job:
    last: int = 0  # highest version ever, never reused
    current: int | None = None


@dataclass
class _Version:
    state: str = "staging"
    meta: dict[str, Any] = field(default_factory=dict)


def _key(job: str, version: int, tensor: str, part: Slice | str) -> _Key:
    return (check_name("job", job), check_version(version), check_name("tensor", tensor),
            check_name("part", part_key(part)))


def _missing(jobs: dict[str, _Job], versions: dict[tuple[str, int], _Version], job: str,
             version: int, what: str) -> PtcError:
    if job not in jobs:
        return JobNotFound(f"no job {job!r} in the memory store")
    if (job, version) not in versions:
        have = sorted(v for j, v in versions if j == job)
        return VersionNotFound(f"job {job!r} has no version {version} (it has {have})")
    return TensorNotFound(f"job {job!r} version {version} {what}")


class _MemoryReader(Reader):
    def __init__(self, store: MemoryStore):
        self._store = store
        with store._lock:
            store._live()
            self._jobs = dict(store._jobs)
            self._versions = dict(store._versions)
            self._entries: dict[_Key, _Entry] | None = dict(store._entries)
            self._blobs = dict(store._blobs)

    def _get(self, job: str, version: int, tensor: str, part: Slice | str) -> _Entry:
        if self._entries is None:
            raise StoreError("this reader is closed; open a new one with store.reader()")
        self._store._live()
        key = _key(job, version, tensor, part)
        if key not in self._entries:
            raise _missing(self._jobs, self._versions, job, version,
                           f"has no {tensor} [{part_key(part)}]")
        return self._entries[key]

    def info(self, job: str, version: int, tensor: str, part: Slice | str) -> EntryInfo:
        return self._get(job, version, tensor, part).info

    def check_committed(self, job: str, version: int) -> None:
        v = self._versions.get((job, version))
        if v is None:
            raise _missing(self._jobs, self._versions, job, version, "")
        if v.state != "committed":
            raise VersionNotCommitted(not_committed(job, version, v.state))

    def ranges(self, job: str, version: int, tensor: str, part: Slice | str,
               offset: int = 0, length: int | None = None) -> Iterator[memoryview]:
        e = self._get(job, version, tensor, part)
        end = check_range(f"{tensor} [{e.info.part}]", e.info.nbytes, offset, length)
        out = []
        for blob, at, size in spans(e.pieces, e.first, offset, end):
            if blob != ZEROS:
                out.append(memoryview(self._blobs[blob])[at:at + size])
                continue
            while size > 0:
                out.append(_ZERO[:min(size, len(_ZERO))])
                size -= len(out[-1])
        return iter(out)

    def close(self) -> None:
        self._entries = None


class MemoryStore(TensorStore):
    """A tensor store in this process's memory; gone when the object is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._versions: dict[tuple[str, int], _Version] = {}
        self._entries: dict[_Key, _Entry] = {}
        self._blobs: dict[int, bytes] = {}
        self._next_id = 0
        self._closed = False

    def _live(self) -> None:
        if self._closed:
            raise StoreError("the memory store is closed")

    def _version(self, job: str, version: int) -> _Version:
        if (job, version) not in self._versions:
            raise _missing(self._jobs, self._versions, job, version, "")
        return self._versions[(job, version)]

    def _drop(self, job: str, version: int) -> None:
        del self._versions[(job, version)]
        for key in [k for k in self._entries if k[:2] == (job, version)]:
            del self._entries[key]
        self._free()

    def _free(self) -> None:
        """Drop the blobs that no entry refers to."""
        live: set[int] = set()
        for e in self._entries.values():
            live |= blobs_of(e.pieces)
        for blob in [b for b in self._blobs if b not in live]:
            del self._blobs[blob]

    def _blob(self, data: bytes) -> int:
        self._next_id += 1
        self._blobs[self._next_id] = data
        return self._next_id

    # --- versions ------------------------------------------------------------
    def begin(self, job: str, meta: dict[str, Any] | None = None) -> int:
        check_name("job", job)
        meta = copy_meta(meta)
        with self._lock:
            self._live()
            rec = self._jobs.setdefault(job, _Job())
            rec.last += 1
            self._versions[(job, rec.last)] = _Version(meta=meta)
            return rec.last

    def begin_at(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        check_name("job", job)
        check_version(version)
        copied = copy_meta(meta)
        with self._lock:
            self._live()
            old = self._versions.get((job, version))
            if old is not None and old.state == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed already")
            if old is None or meta is not None:
                self._versions[(job, version)] = _Version(meta=copied)
            rec = self._jobs.setdefault(job, _Job())
            rec.last = max(rec.last, version)

    def update_meta(self, job: str, changes: dict[str, Any]) -> int:
        check_name("job", job)
        copied = copy_meta(changes)
        with self._lock:
            self._live()
            keys = [k for k in self._versions if k[0] == job]
            for k in keys:
                rec = self._versions[k]
                self._versions[k] = _Version(rec.state, {**rec.meta, **copied})
            return len(keys)

    def commit(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        check_name("job", job)
        copied = copy_meta(meta)
        with self._lock:
            self._live()
            rec = self._version(job, check_version(version))
            if rec.state == "committed":
                return
            self._versions[(job, version)] = _Version("committed", {**rec.meta, **copied})
            j = self._jobs[job]
            if j.current is None or version > j.current:
                j.current = version

    def abort(self, job: str, version: int) -> None:
        check_name("job", job)
        check_version(version)
        with self._lock:
            self._live()
            rec = self._versions.get((job, version))
            if rec is None:
                return
            if rec.state == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed; "
                                       "delete_version drops old committed versions")
            self._drop(job, version)

    def delete_version(self, job: str, version: int) -> None:
        check_name("job", job)
        with self._lock:
            self._live()
            if self._version(job, check_version(version)).state != "committed":
                raise InvalidRequest(f"job {job!r} version {version} is staging; abort it instead")
            if self._jobs[job].current == version:
                raise VersionImmutable(f"version {version} is the current version of {job!r}; "
                                       "commit a newer one before deleting it")
            self._drop(job, version)

    def delete_job(self, job: str) -> int:
        check_name("job", job)
        with self._lock:
            self._live()
            versions = [v for j, v in self._versions if j == job]
            for v in versions:
                self._drop(job, v)
            self._jobs.pop(job, None)
            return len(versions)

    def current(self, job: str) -> int | None:
        check_name("job", job)
        with self._lock:
            self._live()
            rec = self._jobs.get(job)
            return None if rec is None else rec.current

    def versions(self, job: str) -> list[VersionInfo]:
        check_name("job", job)
        with self._lock:
            self._live()
            return [VersionInfo(j, v, r.state, copy_meta(r.meta))
                    for (j, v), r in sorted(self._versions.items()) if j == job]

    def jobs(self) -> list[str]:
        with self._lock:
            self._live()
            return sorted({j for j, _ in self._versions})

    # --- entries -------------------------------------------------------------
    def put(self, job: str, version: int, tensor: str, part: Slice | str, data: Buffer,
            shape: tuple[int, ...], dtype: str, mark: str | None = None,
            written: float | None = None) -> None:
        key = _key(job, version, tensor, part)
        view, shape = check_data(f"{tensor} [{key[3]}]", data, shape, dtype)
        copy = bytes(view)
        stamp = time.time() if written is None else written
        with self._lock:
            self._live()
            v = self._version(job, version)
            check_writable(job, version, v.state, v.meta, mark)
            old = self._entries.get(key)
            if old is not None and (old.info.written or 0.0) > stamp:
                return  # a newer write of it is in (see Store.put)
            blob = self._blob(copy)
            pieces = [(len(copy), 1, len(copy), blob, 0)] if copy else []
            replaced = old is not None
            self._entries[key] = _entry(EntryInfo(tensor, key[3], shape, dtype, len(copy),
                                                  stamp), pieces, blob)
            if replaced:
                self._free()

    def put_many(self, job: str, version: int, entries: Sequence[PutEntry],
                 mark: str | None = None, written: float | None = None) -> None:
        for e in entries:
            check_data(f"{e.tensor} [{_key(job, version, e.tensor, e.part)[3]}]", e.data,
                       e.shape, e.dtype)
        for e in entries:
            self.put(job, version, e.tensor, e.part, e.data, e.shape, e.dtype, mark, written)

    def put_view(self, job: str, version: int, tensor: str, part: Slice | str,
                 shape: tuple[int, ...], dtype: str, refs: Sequence[ViewRef],
                 data: Buffer | None = None) -> None:
        key = _key(job, version, tensor, part)
        what = f"{tensor} [{key[3]}]"
        shape, nbytes = check_shape(what, shape, dtype)
        view = None if data is None else check_data(what, data, shape, dtype)[0]
        with self._lock:
            self._live()
            if self._version(job, version).state == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed; "
                                       "begin a new version to write")

            def source(ref: ViewRef) -> tuple[tuple[int, ...], int, Sequence[Piece]]:
                if ref.version >= version:
                    raise InvalidRequest(f"{what}: a view refers to earlier versions only, "
                                         f"not {ref.version}")
                k = _key(job, ref.version, ref.tensor, ref.part)
                if k not in self._entries:
                    raise _missing(self._jobs, self._versions, job, ref.version,
                                   f"has no {ref.tensor} [{ref.part}]")
                e = self._entries[k]
                return e.info.shape, DTYPE_SIZES[e.info.dtype], e.pieces

            runs = view_runs(shape, DTYPE_SIZES[dtype], refs, source, what)
            own = self._next_id + 1
            pieces, gaps = pack(nbytes, runs, None if view is None else own)
            if view is not None:
                self._blob(b"".join(view[a:a + n] for a, n in gaps))
            replaced = key in self._entries
            self._entries[key] = _entry(EntryInfo(tensor, key[3], shape, dtype, nbytes),
                                        pieces, own)
            if replaced or view is None:
                self._free()

    def entries(self, job: str, version: int) -> list[EntryInfo]:
        check_name("job", job)
        with self._lock:
            self._live()
            self._version(job, check_version(version))
            return sorted((e.info for k, e in self._entries.items()
                           if k[:2] == (job, version)), key=lambda e: (e.tensor, e.part))

    def reader(self) -> Reader:
        return _MemoryReader(self)

    # --- housekeeping --------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._live()
            return {"backend": "memory", "jobs": len({j for j, _ in self._versions}),
                    "versions": len(self._versions), "entries": len(self._entries),
                    "bytes_used": sum(len(d) for d in self._blobs.values()),
                    "stored_bytes": sum(len(d) for d in self._blobs.values()),
                    "referenced_bytes": sum(p[0] * p[1] for e in self._entries.values()
                                            for p in e.pieces if p[3] not in (e.own, ZEROS))}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._jobs, self._versions, self._entries, self._blobs = {}, {}, {}, {}
