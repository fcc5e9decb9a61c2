"""Scrubbing an LMDB store: chunks read back against their checksums, and
the entries of a damaged chunk quarantined (see :mod:`ptcfs.store.integrity`).

Call order (the daemon's scrubber, :mod:`ptcfs.server.ops.scrub`, and
``ptcctl verify --deep``):

1. :func:`scrub_step` from a cursor (None: the first chunk), reading at
   most about ``budget`` bytes in one short read transaction: the damaged
   chunks it found and the cursor to go on from (None: the store's end).
2. :func:`quarantine` of those chunks, in one write transaction: each is
   checked again, and every entry whose bytes lie in one that is still
   damaged is taken out of its version (its blob's referrers counted down,
   as a delete does) and recorded in ``damaged``.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import lmdb
import msgpack

from ptcfs.errors import StoreDamaged
from ptcfs.store.integrity import chunk_sum
from ptcfs.store.views import blobs_of
from ptcfs.types import DamagedEntry


class LmdbStore(Protocol):
    """What these functions use of :class:`ptcfs.store.lmdb_store.LmdbStore`
    (which imports this module: named here, not imported)."""

    path: Path
    _db: dict[str, Any]

    def _live(self) -> lmdb.Environment: ...

    def check_size(self) -> None: ...

    def _read(self) -> AbstractContextManager[lmdb.Transaction]: ...

    def _write(self, durable: bool = True, adds: int = 0
               ) -> AbstractContextManager[lmdb.Transaction]: ...

    def _drop_chunks(self, txn: lmdb.Transaction, rec: dict[str, Any]) -> None: ...

__all__ = ["scrub_step", "quarantine", "damaged_entries"]


def _blob_of(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "big"), int.from_bytes(key[8:16], "big")


def scrub_step(store: LmdbStore, after: bytes | None, budget: int
               ) -> tuple[list[tuple[int, int]], bytes | None, int]:
    """Step 1: ``(damaged (blob, index) chunks, next cursor, bytes read)``."""
    if "sums" not in store._db:
        return [], None, 0
    bad: list[tuple[int, int]] = []
    read = 0
    store.check_size()
    try:
        with store._live().begin(buffers=True) as txn:
            cur = txn.cursor(db=store._db["sums"])
            found = cur.set_range(after) if after is not None else cur.first()
            if found and after is not None and bytes(cur.key()) == after:
                found = cur.next()
            while found:
                key, want = bytes(cur.key()), bytes(cur.value())
                chunk = txn.get(key, db=store._db["chunks"])
                if chunk is None or chunk_sum(chunk) != want:
                    bad.append(_blob_of(key))
                read += 0 if chunk is None else len(chunk)
                if read >= budget:
                    return bad, key, read
                found = cur.next()
    except lmdb.Error as e:
        raise StoreDamaged(f"the store at {store.path} cannot be read back: {e}") from e
    return bad, None, read


def _key_parts(key: bytes) -> tuple[str, int, str, str]:
    j = key.index(b"\0")
    tensor, part = key[j + 9:].decode().split("\0")
    return key[:j].decode(), int.from_bytes(key[j + 1:j + 9], "big"), tensor, part


def _ckey(blob: int, index: int) -> bytes:
    return blob.to_bytes(8, "big") + index.to_bytes(8, "big")


def _blobs(rec: dict[str, Any]) -> set[int]:
    """The blobs an entry record's bytes lie in (its own among them)."""
    pieces = [tuple(p) for p in rec["pieces"]] if "pieces" in rec else []
    return blobs_of(pieces) | {rec["id"]}  # type: ignore[arg-type]


def quarantine(store: LmdbStore, chunks: list[tuple[int, int]]) -> list[DamagedEntry]:
    """Step 2: the entries taken out, one per entry of a damaged chunk."""
    if not chunks:
        return []
    out: list[DamagedEntry] = []
    now = time.time()
    with store._write() as txn:
        bad: dict[int, int] = {}
        for blob, index in chunks:
            key = _ckey(blob, index)
            want = txn.get(key, db=store._db["sums"])
            chunk = txn.get(key, db=store._db["chunks"])
            if want is not None and (chunk is None or chunk_sum(chunk) != bytes(want)):
                bad.setdefault(blob, index)
        if not bad:
            return []
        hit: list[tuple[bytes, dict[str, Any], int]] = []
        for k, raw in txn.cursor(db=store._db["entries"]):
            rec = msgpack.unpackb(raw, strict_map_key=False)
            for blob in _blobs(rec) & bad.keys():
                hit.append((bytes(k), rec, blob))
                break
        for k, rec, blob in hit:
            store._drop_chunks(txn, rec)
            txn.delete(k, db=store._db["entries"])
            job, version, tensor, part = _key_parts(k)
            d = DamagedEntry(job, version, tensor, part, bad[blob], blob, now)
            txn.put(k, msgpack.packb([d.chunk, d.blob, d.found]), db=store._db["damaged"])
            out.append(d)
        held = {b for _, _, b in hit}
        for blob in bad.keys() - held:  # chunks no entry refers to: they go
            prefix = blob.to_bytes(8, "big")
            for db in ("chunks", "sums"):
                cur = txn.cursor(db=store._db[db])
                if cur.set_range(prefix):
                    while bytes(cur.key()).startswith(prefix):
                        if not cur.delete():
                            break
            txn.delete(prefix, db=store._db["refs"])
    return out


def damaged_entries(store: LmdbStore) -> list[DamagedEntry]:
    """Every quarantined entry still recorded (its version not dropped)."""
    if "damaged" not in store._db:
        return []
    out = []
    with store._read() as txn:
        for k, raw in txn.cursor(db=store._db["damaged"]):
            chunk, blob, found = msgpack.unpackb(raw)
            out.append(DamagedEntry(*_key_parts(bytes(k)), chunk, blob, found))
    return out
