"""A store's health at rest: chunk checksums, and the data file checked
before LMDB maps it.

Checksums. Every chunk a ``put`` (or a view's own bytes) writes has its
xxHash (XXH3, 64 bits) written beside it in the same transaction
(:func:`chunk_sum`); a scrub (:meth:`LmdbStore.scrub
<ptcfs.store.lmdb_store.LmdbStore.scrub>`) reads chunks back and compares.
A chunk whose bytes no longer give its sum is *damaged*: every entry whose
bytes lie in it is quarantined (taken out of its version and recorded as
a :class:`~ptcfs.types.DamagedEntry`), so no read serves it again and a
repair sees the copy missing and fetches it from a holder whose copy holds.

The data file. LMDB maps ``data.mdb`` and trusts its meta page: a file cut
shorter than the pages the meta page says are in use is read past its end,
and the kernel kills the process with SIGBUS at the first read of such a
page (with writemap, LMDB extends the file with zeros instead, and the
reads give garbage). :func:`check_data_file` reads both meta pages with
``pread`` before the store opens, and raises StoreDamaged naming what is
wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import xxhash

from ptcfs.errors import StoreDamaged
from ptcfs.types import DamagedEntry

__all__ = ["SUM_BYTES", "chunk_sum", "check_data_file", "describe_damage", "fresh_store"]

#: Bytes of a chunk's checksum.
SUM_BYTES = 8

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_PAGEHDR = 16
# MDB_meta after the page header: magic, version, address, map size; two MDB_db
# (pad/psize, flags, depth, branch, leaf, overflow pages, entries, root); last
# page, txn id
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_MIN_PSIZE, _MAX_PSIZE = 512, 1 << 16


def chunk_sum(data: bytes | memoryview) -> bytes:
    """The checksum a chunk's bytes are stored with."""
    return xxhash.xxh3_64_digest(data)


def _meta(raw: bytes) -> tuple[int, int, int] | None:
    """``(txn id, last page, page size)`` of a meta page, None if it is not one."""
    if len(raw) < _PAGEHDR + _META.size:
        return None
    f = _META.unpack_from(raw, _PAGEHDR)
    if f[0] != _MAGIC or f[1] != _DATA_VERSION:
        return None
    return f[-1], f[-2], f[4]  # mm_txnid, mm_last_pg, mm_psize (free db's md_pad)


def check_data_file(path: Path) -> None:
    """Raise StoreDamaged if ``path`` (an LMDB data file) exists but its
    meta pages are not LMDB's or it is shorter than the pages they say are
    in use. An absent or empty file is a new store, and fine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StoreDamaged(f"cannot read {path}: {e}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        first = os.pread(fd, _PAGEHDR + _META.size, 0)
        m0 = _meta(first)
        psize = m0[2] if m0 is not None and _MIN_PSIZE <= m0[2] <= _MAX_PSIZE else 4096
        m1 = _meta(os.pread(fd, _PAGEHDR + _META.size, psize))
    finally:
        os.close(fd)
    metas = [m for m in (m0, m1) if m is not None]
    if not metas:
        raise StoreDamaged(f"{path} is not an LMDB data file: neither of its meta pages "
                           f"is LMDB's ({size} bytes)")
    txnid, last, _ = max(metas)
    need = (last + 1) * psize
    if size < need:
        raise StoreDamaged(f"{path} was cut short: it holds {size} bytes, but its pages "
                           f"reach {need} (transaction {txnid})")


def fresh_store(path: Path, stamp: str) -> Path | None:
    """Set a store's data file aside as ``data.mdb.damaged-<stamp>`` (its
    lock file goes), so that the store opens empty; where it went, or None
    when there was none."""
    data = path / "data.mdb"
    if not data.exists():
        return None
    dest = path / f"data.mdb.damaged-{stamp}"
    data.rename(dest)
    try:
        (path / "lock.mdb").unlink()
    except FileNotFoundError:
        pass
    return dest


def describe_damage(host: str, e: DamagedEntry) -> str:
    """One line naming a quarantined entry and how it heals."""
    return (f"{host}: {e.tensor} [{e.part}] of job {e.job!r} version {e.version} is damaged "
            f"at rest (chunk {e.chunk} fails its checksum): quarantined; `ptcctl repair "
            f"{e.job}` restores it from a copy")
