"""The LMDB tensor store: one LMDB environment per host store directory.

Key layout (named databases; keys are UTF-8, parts joined by NUL, which
names may not contain; version numbers are 8-byte big-endian so that keys
sort by version):

- ``versions``: ``job \\0 ver`` → msgpack ``{"state", "meta"}``
- ``current``:  ``job`` → 8-byte version number of the current version
- ``entries``:  ``job \\0 ver \\0 tensor \\0 part`` → msgpack
  ``{"shape", "dtype", "nbytes", "chunks"}``
- ``chunks``:   ``job \\0 ver \\0 tensor \\0 part \\0 index`` → raw bytes,
  ``chunk_bytes`` each (the last one shorter)

A version's state changes and the job's current pointer move in one write
transaction, so a commit is atomic and durable when it returns. Readers see
a snapshot (one read transaction) and get zero-copy views of the map.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np

from ptcfs.errors import (
    InvalidRequest,
    JobNotFound,
    StoreError,
    TensorNotFound,
    VersionImmutable,
    VersionNotFound,
)
from ptcfs.store.base import Buffer, EntryInfo, Reader, TensorStore, VersionInfo, part_key
from ptcfs.types import DTYPE_SIZES, Slice

__all__ = ["LmdbStore", "CHUNK_BYTES", "MAP_SIZE"]

#: Bytes per stored chunk (``PTC_STORE_CHUNK_BYTES`` overrides; the
#: constructor's argument wins over both).
CHUNK_BYTES = int(os.environ.get("PTC_STORE_CHUNK_BYTES", 64 << 20))
#: Address space reserved for the map; LMDB takes disk only as it fills.
MAP_SIZE = int(os.environ.get("PTC_STORE_MAP_SIZE", 1 << 40))

_V = struct.Struct(">Q")


def _name(kind: str, value: str) -> bytes:
    if not isinstance(value, str) or not value or "\0" in value:
        raise InvalidRequest(f"bad {kind} name {value!r}: must be non-empty text without NUL")
    return value.encode()


def _vkey(job: str, version: int) -> bytes:
    if not isinstance(version, int) or version < 0:
        raise InvalidRequest(f"bad version {version!r}: must be a whole number >= 0")
    return _name("job", job) + b"\0" + _V.pack(version)


def _ekey(job: str, version: int, tensor: str, part: Slice | str) -> bytes:
    return (_vkey(job, version) + b"\0" + _name("tensor", tensor) + b"\0"
            + _name("part", part_key(part)))


class _LmdbReader(Reader):
    def __init__(self, store: LmdbStore):
        self._s = store
        self._txn = store._env.begin(buffers=True)

    def info(self, job: str, version: int, tensor: str, part: Slice | str) -> EntryInfo:
        raw = self._txn.get(_ekey(job, version, tensor, part), db=self._s._entries)
        if raw is None:
            self._s._missing(self._txn, job, version, tensor, part)
            raise AssertionError("unreachable")
        m = msgpack.unpackb(bytes(raw))
        return EntryInfo(tensor, part_key(part), tuple(m["shape"]), m["dtype"], m["nbytes"])

    def ranges(self, job: str, version: int, tensor: str, part: Slice | str,
               offset: int = 0, length: int | None = None) -> Iterator[memoryview]:
        info = self.info(job, version, tensor, part)
        end = info.nbytes if length is None else offset + length
        if offset < 0 or end < offset or end > info.nbytes:
            raise InvalidRequest(
                f"range [{offset}, {end}) is outside {tensor} [{part_key(part)}] "
                f"of {info.nbytes} bytes")
        chunk = self._s.chunk_of(self._txn, job, version, tensor, part)
        key = _ekey(job, version, tensor, part) + b"\0"
        pos = offset
        while pos < end:
            index, within = divmod(pos, chunk)
            view = self._txn.get(key + _V.pack(index), db=self._s._chunks)
            if view is None:
                raise StoreError(f"chunk {index} of {tensor} [{part_key(part)}] is missing")
            take = min(len(view) - within, end - pos)
            yield memoryview(view)[within:within + take]
            pos += take

    def close(self) -> None:
        if self._txn is not None:
            self._txn.abort()
            self._txn = None  # type: ignore[assignment]


class LmdbStore(TensorStore):
    """A host's tensor store in one LMDB environment at ``path``."""

    def __init__(self, path: str | Path, map_size: int = MAP_SIZE,
                 chunk_bytes: int | None = None, readonly: bool = False):
        self.path = Path(path)
        self.chunk_bytes = int(chunk_bytes or CHUNK_BYTES)
        if self.chunk_bytes < 1:
            raise InvalidRequest(f"chunk_bytes={self.chunk_bytes} must be positive")
        try:
            if not readonly:
                self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=8,
                                  max_readers=512, readonly=readonly, lock=True,
                                  readahead=False, metasync=True, sync=True)
        except lmdb.Error as e:
            raise StoreError(f"cannot open the store at {self.path}: {e}") from e
        self._versions = self._env.open_db(b"versions", create=not readonly)
        self._current = self._env.open_db(b"current", create=not readonly)
        self._entries = self._env.open_db(b"entries", create=not readonly)
        self._chunks = self._env.open_db(b"chunks", create=not readonly)
        self._wlock = threading.Lock()

    # --- helpers -------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        with self._wlock:
            try:
                with self._env.begin(write=True) as txn:
                    yield txn
            except lmdb.MapFullError as e:
                raise StoreError(
                    f"the store at {self.path} is full (map size {self._env.info()['map_size']} "
                    "bytes); delete old versions or raise PTC_STORE_MAP_SIZE") from e

    def _vrec(self, txn: lmdb.Transaction, job: str, version: int) -> dict[str, Any] | None:
        raw = txn.get(_vkey(job, version), db=self._versions)
        return None if raw is None else msgpack.unpackb(bytes(raw))

    def _missing(self, txn: lmdb.Transaction, job: str, version: int, tensor: str,
                 part: Slice | str) -> None:
        if self._vrec(txn, job, version) is None:
            if txn.get(_name("job", job), db=self._current) is None and not any(
                    True for _ in self._iter(txn, self._versions, _name("job", job) + b"\0")):
                raise JobNotFound(f"no job {job!r} in the store at {self.path}")
            raise VersionNotFound(f"job {job!r} has no version {version}")
        raise TensorNotFound(f"job {job!r} version {version} has no {tensor} [{part_key(part)}]")

    @staticmethod
    def _iter(txn: lmdb.Transaction, db: Any, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
        cur = txn.cursor(db=db)
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            k = bytes(k)
            if not k.startswith(prefix):
                return
            yield k, v

    def chunk_of(self, txn: lmdb.Transaction, job: str, version: int, tensor: str,
                 part: Slice | str) -> int:
        raw = txn.get(_ekey(job, version, tensor, part), db=self._entries)
        if raw is None:
            raise TensorNotFound(
                f"job {job!r} version {version} has no {tensor} [{part_key(part)}]")
        return int(msgpack.unpackb(bytes(raw))["chunk"])

    # --- versions ------------------------------------------------------------
    def begin(self, job: str, meta: dict[str, Any] | None = None) -> int:
        with self._write() as txn:
            last = -1
            for k, _ in self._iter(txn, self._versions, _name("job", job) + b"\0"):
                last = max(last, _V.unpack(k[-8:])[0])
            version = last + 1 if last >= 0 else 1
            txn.put(_vkey(job, version), msgpack.packb({"state": "staging", "meta": meta or {}}),
                    db=self._versions)
            return version

    def begin_at(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        with self._write() as txn:
            rec = self._vrec(txn, job, version)
            if rec is not None and rec["state"] == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed already")
            if rec is None or meta:
                new = {"state": "staging", "meta": meta or (rec or {}).get("meta", {})}
                txn.put(_vkey(job, version), msgpack.packb(new), db=self._versions)

    def commit(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        with self._write() as txn:
            rec = self._vrec(txn, job, version)
            if rec is None:
                raise VersionNotFound(f"job {job!r} has no version {version} to commit")
            if rec["state"] == "committed":
                return
            rec = {"state": "committed", "meta": {**rec["meta"], **(meta or {})}}
            txn.put(_vkey(job, version), msgpack.packb(rec), db=self._versions)
            cur = txn.get(_name("job", job), db=self._current)
            if cur is None or _V.unpack(bytes(cur))[0] < version:
                txn.put(_name("job", job), _V.pack(version), db=self._current)

    def _drop(self, txn: lmdb.Transaction, job: str, version: int) -> None:
        prefix = _vkey(job, version) + b"\0"
        for db in (self._entries, self._chunks):
            keys = [k for k, _ in self._iter(txn, db, prefix)]
            for k in keys:
                txn.delete(k, db=db)
        txn.delete(_vkey(job, version), db=self._versions)

    def abort(self, job: str, version: int) -> None:
        with self._write() as txn:
            rec = self._vrec(txn, job, version)
            if rec is None:
                return
            if rec["state"] == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed; "
                                       "use delete_version for old committed versions")
            self._drop(txn, job, version)

    def delete_version(self, job: str, version: int) -> None:
        with self._write() as txn:
            cur = txn.get(_name("job", job), db=self._current)
            if cur is not None and _V.unpack(bytes(cur))[0] == version:
                raise VersionImmutable(f"version {version} is the current version of {job!r}")
            if self._vrec(txn, job, version) is None:
                raise VersionNotFound(f"job {job!r} has no version {version}")
            self._drop(txn, job, version)

    def current(self, job: str) -> int | None:
        with self._env.begin() as txn:
            cur = txn.get(_name("job", job), db=self._current)
            return None if cur is None else _V.unpack(bytes(cur))[0]

    def versions(self, job: str) -> list[VersionInfo]:
        with self._env.begin() as txn:
            out = []
            for k, v in self._iter(txn, self._versions, _name("job", job) + b"\0"):
                rec = msgpack.unpackb(bytes(v))
                out.append(VersionInfo(job, _V.unpack(k[-8:])[0], rec["state"], rec["meta"]))
            return sorted(out, key=lambda i: i.version)

    def jobs(self) -> list[str]:
        with self._env.begin() as txn:
            names = {bytes(k).split(b"\0", 1)[0].decode()
                     for k, _ in self._iter(txn, self._versions, b"")}
            return sorted(names)

    # --- entries -------------------------------------------------------------
    def put(self, job: str, version: int, tensor: str, part: Slice | str, data: Buffer,
            shape: tuple[int, ...], dtype: str) -> None:
        if dtype not in DTYPE_SIZES:
            raise InvalidRequest(f"unknown dtype {dtype!r}")
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise InvalidRequest(f"bad shape {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        mv = memoryview(data).cast("B")
        if mv.nbytes != nbytes:
            raise InvalidRequest(f"{tensor} [{part_key(part)}]: got {mv.nbytes} bytes, "
                                 f"shape {shape} of {dtype} needs {nbytes}")
        key = _ekey(job, version, tensor, part)
        with self._write() as txn:
            rec = self._vrec(txn, job, version)
            if rec is None:
                raise VersionNotFound(f"job {job!r} has no version {version}; begin it first")
            if rec["state"] == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed")
            for k in [k for k, _ in self._iter(txn, self._chunks, key + b"\0")]:
                txn.delete(k, db=self._chunks)
            chunk = self.chunk_bytes
            for i, start in enumerate(range(0, max(nbytes, 1), chunk)):
                txn.put(key + b"\0" + _V.pack(i), mv[start:start + chunk], db=self._chunks)
            meta = {"shape": list(shape), "dtype": dtype, "nbytes": nbytes, "chunk": chunk}
            txn.put(key, msgpack.packb(meta), db=self._entries)

    def entries(self, job: str, version: int) -> list[EntryInfo]:
        with self._env.begin() as txn:
            if self._vrec(txn, job, version) is None:
                self._missing(txn, job, version, "-", "-")
            out = []
            for k, v in self._iter(txn, self._entries, _vkey(job, version) + b"\0"):
                tensor, part = k[len(_vkey(job, version)) + 1:].decode().split("\0")
                m = msgpack.unpackb(bytes(v))
                out.append(EntryInfo(tensor, part, tuple(m["shape"]), m["dtype"], m["nbytes"]))
            return sorted(out, key=lambda e: (e.tensor, e.part))

    def reader(self) -> Any:
        return _LmdbReader(self)

    def stats(self) -> dict[str, Any]:
        st = self._env.stat()
        info = self._env.info()
        with self._env.begin() as txn:
            entries = txn.stat(self._entries)["entries"]
        used = (info["last_pgno"] + 1) * st["psize"]
        return {"path": str(self.path), "bytes_used": used, "entries": entries,
                "jobs": len(self.jobs()), "map_size": info["map_size"]}

    def close(self) -> None:
        self._env.close()
