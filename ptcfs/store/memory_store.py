"""An in-process tensor store: dicts behind one lock, nothing on disk.

Same semantics as :class:`ptcfs.store.lmdb_store.LmdbStore` (the contract
suite runs against both), for unit tests of the layers above the store.
Entries are immutable ``bytes``, so a reader's snapshot is a shallow copy
of the dicts and its ranges are zero-copy views of those bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ptcfs.errors import (
    InvalidRequest,
    JobNotFound,
    PtcError,
    StoreError,
    TensorNotFound,
    VersionImmutable,
    VersionNotFound,
)
from ptcfs.store.base import Buffer, EntryInfo, Reader, TensorStore, VersionInfo, part_key
from ptcfs.store.checks import check_data, check_name, check_range, check_version, copy_meta
from ptcfs.types import Slice

__all__ = ["MemoryStore"]

_Key = tuple[str, int, str, str]


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
            self._entries: dict[_Key, tuple[EntryInfo, bytes]] | None = dict(store._entries)

    def _get(self, job: str, version: int, tensor: str, part: Slice | str
             ) -> tuple[EntryInfo, bytes]:
        if self._entries is None:
            raise StoreError("this reader is closed; open a new one with store.reader()")
        self._store._live()
        key = _key(job, version, tensor, part)
        if key not in self._entries:
            raise _missing(self._jobs, self._versions, job, version,
                           f"has no {tensor} [{part_key(part)}]")
        return self._entries[key]

    def info(self, job: str, version: int, tensor: str, part: Slice | str) -> EntryInfo:
        return self._get(job, version, tensor, part)[0]

    def ranges(self, job: str, version: int, tensor: str, part: Slice | str,
               offset: int = 0, length: int | None = None) -> Iterator[memoryview]:
        info, data = self._get(job, version, tensor, part)
        end = check_range(f"{tensor} [{info.part}]", info.nbytes, offset, length)
        return iter([memoryview(data)[offset:end]] if end > offset else [])

    def close(self) -> None:
        self._entries = None


class MemoryStore(TensorStore):
    """A tensor store in this process's memory; gone when the object is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._versions: dict[tuple[str, int], _Version] = {}
        self._entries: dict[_Key, tuple[EntryInfo, bytes]] = {}
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
            shape: tuple[int, ...], dtype: str) -> None:
        key = _key(job, version, tensor, part)
        view, shape = check_data(f"{tensor} [{key[3]}]", data, shape, dtype)
        copy = bytes(view)
        with self._lock:
            self._live()
            if self._version(job, version).state == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed; "
                                       "begin a new version to write")
            self._entries[key] = (EntryInfo(tensor, key[3], shape, dtype, len(copy)), copy)

    def entries(self, job: str, version: int) -> list[EntryInfo]:
        check_name("job", job)
        with self._lock:
            self._live()
            self._version(job, check_version(version))
            return sorted((info for k, (info, _) in self._entries.items()
                           if k[:2] == (job, version)), key=lambda e: (e.tensor, e.part))

    def reader(self) -> Reader:
        return _MemoryReader(self)

    # --- housekeeping --------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._live()
            return {"backend": "memory", "jobs": len({j for j, _ in self._versions}),
                    "versions": len(self._versions), "entries": len(self._entries),
                    "bytes_used": sum(len(d) for _, d in self._entries.values())}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._jobs, self._versions, self._entries = {}, {}, {}
