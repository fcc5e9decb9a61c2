"""The LMDB tensor store: one LMDB environment per host store directory.

Named databases and their keys (names are UTF-8 without NUL; ``ver``,
``id`` and ``index`` are 8-byte big-endian, so keys sort by number):

- ``meta``:     ``format`` → layout number; ``next_id`` → next entry id;
  ``store_id`` → 16 random bytes written when the store is made (a host
  back with another store is told from one back with its own)
- ``jobs``:     ``job`` → msgpack ``{"last", "current"}``: the highest
  version the job ever had (never reused, even after an abort) and its
  current version (or None)
- ``versions``: ``job \\0 ver`` → msgpack ``{"state", "meta"}``
- ``entries``:  ``job \\0 ver tensor \\0 part`` → msgpack
  ``{"shape", "dtype", "nbytes", "chunk", "id", "written"}`` (``written``:
  the wall-clock time of the ``put``; views have none)
- ``chunks``:   ``id index`` → raw bytes, ``chunk`` bytes each (the last
  one shorter; none for an empty tensor). Each entry stores its own chunk
  size, so a store reopened with another ``chunk_bytes`` reads old entries.
  The chunks under one id are that entry's *blob*.
- ``sums``:     ``id index`` → the chunk's checksum, written with it
  (:mod:`ptcfs.store.integrity`); a chunk written before sums were kept has
  none, and a scrub skips it
- ``damaged``:  ``job \\0 ver tensor \\0 part`` → msgpack of a quarantined
  entry (:class:`~ptcfs.types.DamagedEntry`), until its version is dropped
- ``refs``:     ``id`` → msgpack ``[referrers, nbytes, chunk]`` for a blob
  that views share (:mod:`ptcfs.store.views`): how many entries refer to it
  (its own entry among them while it lives), its size and chunk size. A blob
  without a record belongs to its plain entry alone. Dropping an entry
  counts its blobs down, and a blob's chunks go with its last referrer, in
  the same transaction.

A *view* entry (``put_view``) also has ``"pieces"`` (see
:mod:`ptcfs.store.views`), ``"own"`` (the bytes of its own blob) and
``"chunks"`` (blob id → its chunk size).

Every call that changes something is one write transaction, so it is
atomic: a commit flips the version's state and the job's current pointer
together. Writes are made durable (fsync) before ``begin``, ``begin_at``,
``commit``, ``abort`` and ``delete_version`` return; a ``put`` is
crash-consistent (LMDB's ``metasync=False``) and made durable by the commit
that follows it. A :class:`Reader` is one read transaction: a snapshot whose
``ranges`` are memoryviews of LMDB's map, not copies, valid until the reader
(or the store) is closed. Threads may read concurrently while one writes;
other processes may open the same store (LMDB locks across processes). Do
not open one store directory twice in one process: share the object.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np

from ptcfs import settings
from ptcfs.errors import (
    InvalidRequest,
    JobNotFound,
    PtcError,
    StoreDamaged,
    StoreError,
    TensorNotFound,
    VersionImmutable,
    VersionNotCommitted,
    VersionNotFound,
)
from ptcfs.store.base import (
    ZERO_FD,
    Buffer,
    EntryInfo,
    PutEntry,
    Reader,
    TensorStore,
    VersionInfo,
    part_key,
)
from ptcfs.store.checks import (
    check_data,
    check_name,
    check_range,
    check_shape,
    check_version,
    check_writable,
    copy_meta,
    not_committed,
    tunable,
)
from ptcfs.store.integrity import SUM_BYTES, check_data_file, chunk_sum
from ptcfs.store.lmdb_pages import PageWalker
from ptcfs.store.lmdb_scrub import damaged_entries, quarantine, scrub_step
from ptcfs.store.room import in_memory, populate, written_end
from ptcfs.store.views import (
    ZEROS,
    Piece,
    ViewEntry,
    ViewRef,
    blobs_of,
    merge_pieces,
    one_ref_pieces,
    pack,
    spans,
    starts,
    view_runs,
)
from ptcfs.types import DTYPE_SIZES, DamagedEntry, Slice

__all__ = ["CHUNK_BYTES", "MAP_SIZE", "MAX_READERS", "LmdbStore", "keep_heap"]

#: Chunk views one reader remembers (see ``_LmdbReader``).
_CHUNK_VIEWS = 4096

#: Bytes per stored chunk by default (``PTC_STORE_CHUNK_BYTES``; the
#: constructor's ``chunk_bytes`` overrides it). Under :func:`keep_heap`'s
#: threshold, so that LMDB's buffer for a chunk being written is reused
#: memory, not fresh pages.
CHUNK_BYTES: int = settings.SETTINGS["PTC_STORE_CHUNK_BYTES"].default
#: Allocations up to this size come from malloc's heap once :func:`keep_heap`
#: ran (glibc's largest allowed threshold), and freed heap memory up to
#: HEAP_KEEP is kept for the next ones.
HEAP_THRESHOLD = 32 << 20
HEAP_KEEP = 1 << 30
#: Address space reserved for the map by default (``PTC_STORE_MAP_SIZE``,
#: ``map_size``); LMDB takes disk only as the store fills.
MAP_SIZE: int = settings.SETTINGS["PTC_STORE_MAP_SIZE"].default
#: With writemap: blocks given to the data file beyond what a write
#: transaction may add (a put adds its bytes, plus 1/64 for page overhead,
#: plus 1/512 of the store for its free list).
RESERVE_SLACK = 1 << 20
#: :meth:`LmdbStore.make_room` writes zeros this many bytes per write
#: transaction, so that a writer waits for one step at most.
ROOM_STEP = 32 << 20
#: Bytes of an overflow page's header: a value of n bytes takes
#: ceil((n + _PAGE_HEADER) / page size) pages.
_PAGE_HEADER = 16
#: Bytes of a leaf node holding a chunk's checksum (key, sum, node header).
_SUM_NODE = 16 + SUM_BYTES + 8
#: Read transactions open at once, over all processes.
MAX_READERS = 1024
_FORMAT = 1
_MAX_KEY = 511  # LMDB's key size limit
_U64 = struct.Struct(">Q")
_DBS = ("meta", "jobs", "versions", "entries", "chunks", "refs", "sums", "damaged")
#: databases a store made before them may lack (opened read-only: absent)
_LATER_DBS = ("sums", "damaged")
_OPEN: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) of open store directories
_OPEN_LOCK = threading.Lock()


def _unpack(raw: Any) -> Any:
    return msgpack.unpackb(raw, strict_map_key=False)


def _fits(key: bytes) -> bytes:
    if len(key) > _MAX_KEY:
        raise InvalidRequest(f"job, tensor and part names are too long together: their key "
                             f"takes {len(key)} bytes, at most {_MAX_KEY} fit")
    return key


def _vkey(job: str, version: int) -> bytes:
    return _fits(check_name("job", job).encode() + b"\0" + _U64.pack(check_version(version)))


def _ekey(job: str, version: int, tensor: str, part: Slice | str) -> bytes:
    key = part_key(part)
    return _fits(_vkey(job, version) + check_name("tensor", tensor).encode() + b"\0"
                 + check_name("part", key).encode())


def _ckey(entry_id: int, index: int) -> bytes:
    return _U64.pack(entry_id) + _U64.pack(index)


def _scan(txn: lmdb.Transaction, db: Any, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
    cur = txn.cursor(db=db)
    if not cur.set_range(prefix):
        return
    for k, v in cur:
        k = bytes(k)
        if not k.startswith(prefix):
            return
        yield k, v


def _cut_short(data: Path, size: int, used: int) -> str:
    return (f"{data} was cut short under the running store: {size} bytes, its pages reach "
            f"{used}. Restart ptcd with --fresh-store, then run ptcctl repair for its jobs")


def _used(env: lmdb.Environment) -> int:
    """Bytes of the data file up to the end of the last page in use."""
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def keep_heap() -> bool:
    """Have this process's malloc serve buffers up to HEAP_THRESHOLD from its
    one heap and keep freed heap memory, for processes that write stores.
    Call it before the process starts threads.

    Without writemap, LMDB copies each value into a malloc'd buffer before
    writing it to the data file; glibc maps a fresh region for each big one
    and unmaps it after, and fresh pages cost a fault and a zeroing each
    (writes of 1 GiB into /dev/shm ran at 1.1-1.2 GB/s here, 2.9-3.05 with
    this and 16 MiB chunks). False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    # one arena: other threads' arenas live in 64 MiB heaps that are unmapped
    # as soon as they empty, so chunk buffers allocated there were fresh again
    return bool(mallopt(m_mmap_threshold, HEAP_THRESHOLD)) and \
        bool(mallopt(m_trim_threshold, HEAP_KEEP)) and bool(mallopt(m_arena_max, 1))


def _owner_only(path: Path) -> None:
    """Make a store's folder 0700 and its files 0600, whatever the umask
    of the process that made them (a store is its jobs' state: only the
    user that runs its daemon may read or change it)."""
    path.chmod(0o700)
    for name in ("data.mdb", "lock.mdb"):
        f = path / name
        if f.exists():
            f.chmod(0o600)


def _data_map(data: Path, size: int) -> tuple[int, int, int] | None:
    """``data`` (LMDB's data file, which this process maps once) opened
    read-only, with the address of its map: ``(fd, address, size)``; None
    where ``/proc/self/maps`` does not show the map."""
    fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        with open("/proc/self/maps") as maps:
            for line in maps:
                f = line.split(maxsplit=5)
                if len(f) == 6 and int(f[2], 16) == 0 and int(f[4]) == st.st_ino and \
                        os.path.realpath(f[5].rstrip("\n")) == os.path.realpath(data):
                    return fd, int(f[0].split("-")[0], 16), size
    except OSError:
        pass
    os.close(fd)
    return None


_ZERO_VIEW = memoryview(bytes(1 << 20))
#: file_ranges gives up on views strided in runs shorter than this
MIN_SPLICE_RUN = 64 << 10


#: what a view's source entry tells it: shape, itemsize, pieces, blob → (nbytes, chunk)
_Source = tuple[tuple[int, ...], int, Sequence[Piece], dict[int, tuple[int, int]]]


def _piece_list(r: dict[str, Any]) -> list[Piece]:
    """An entry record's pieces."""
    if "pieces" in r:
        return [tuple(p) for p in r["pieces"]]
    return [(r["nbytes"], 1, r["nbytes"], r["id"], 0)] if r["nbytes"] else []


def _pieces(r: dict[str, Any]) -> tuple[list[Piece], list[int]]:
    """An entry record's pieces and their starts (cached in the record)."""
    got = r.get("_pieces")
    if got is None:
        raw = r.get("pieces")
        if raw is not None and len(raw) > 16:  # a merge's: one array op, not a loop
            arr = r["_array"] = np.array(raw, dtype=np.int64).reshape(-1, 5)
            got = (list(map(tuple, raw)),
                   np.concatenate([[0], np.cumsum(arr[:, 0] * arr[:, 1])]).tolist())
        else:
            pieces = _piece_list(r)
            got = (pieces, starts(pieces))
        r["_pieces"] = got
    return got  # type: ignore[no-any-return]


#: Fewest rows an interleaved block has (fewer: piece by piece), and the most
#: pieces one of its rows has.
_MIN_ROWS, _MAX_PERIOD = 8, 4


def _interleaved(r: dict[str, Any], i: int) -> tuple[int, int, int] | None:
    """``(period, rows, row bytes)`` of the interleaved block starting at
    piece ``i`` of an entry (cached in the record), or None. A merge along
    a later dimension leaves one piece per source per row (a tp=2 row made
    of two tp=4 rows: a view of the local shard, then the fetched bytes):
    ``period`` single-run pieces that repeat ``rows`` times, each phase from
    one chunk at a constant stride, the rows back to back. Such a block is
    read with one strided copy per phase instead of a copy per piece."""
    cache: dict[int, tuple[int, int, int] | None] = r.setdefault("_interleaved", {})
    if i in cache:
        return cache[i]
    pieces, first = _pieces(r)
    found = None
    for period in range(2, _MAX_PERIOD + 1):
        rows = _block_rows(r, pieces, first, i, period)
        if rows >= _MIN_ROWS:
            found = (period, rows, first[i + period] - first[i])
            break
    cache[i] = found
    return found


def _block_rows(r: dict[str, Any], pieces: list[Piece], first: list[int], i: int,
                period: int) -> int:
    """How many rows of ``period`` pieces repeat from piece ``i`` (see
    :func:`_interleaved`); 0 when not even two do."""
    if i + 2 * period > len(pieces):
        return 0
    arr = r.get("_array")
    if arr is None:  # a record of few pieces
        arr = r["_array"] = np.array(pieces, dtype=np.int64).reshape(-1, 5)
    size, count, _, blob, off = arr[i:i + (len(pieces) - i) // period * period].reshape(
        -1, period, 5).transpose(2, 0, 1)  # each (rows, period)
    steps = off[1] - off[0]
    zeros = blob[0] == ZEROS
    if (count[:2] != 1).any() or (size[1] != size[0]).any() or (blob[1] != blob[0]).any() \
            or ((steps <= 0) & ~zeros).any():
        return 0
    # a row is one of the block while its pieces are single runs of the first
    # row's sizes and blobs, each phase's offsets at its step (the pieces being
    # back to back, the row then starts where the rows before it end)
    k = np.arange(len(size), dtype=np.int64)[:, None]
    same = (count == 1) & (size == size[0]) & (blob == blob[0]) & \
        (zeros | (off == off[0] + k * steps))
    bad = np.flatnonzero(~same.all(axis=1))
    rows = int(bad[0]) if len(bad) else len(size)
    for j in range(period):  # each phase's runs must lie in one chunk
        if not zeros[j]:
            lo, step, sz = int(off[0, j]), int(steps[j]), int(size[0, j])
            chunk = _chunk_size(r, int(blob[0, j]))
            rows = min(rows, (lo // chunk * chunk + chunk - lo - sz) // step + 1)
    return rows if rows >= 2 else 0


def _own_chunks(view: memoryview, gaps: list[tuple[int, int]], step: int
                ) -> Iterator[memoryview | bytes]:
    """The bytes of ``view`` in the stretches ``gaps``, back to back, cut in
    chunks of ``step`` bytes (copied only where a chunk joins stretches)."""
    parts: list[memoryview] = []
    have = 0
    for pos, size in gaps:
        while size > 0:
            take = min(size, step - have)
            parts.append(view[pos:pos + take])
            have, pos, size = have + take, pos + take, size - take
            if have == step:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
                parts, have = [], 0
    if parts:
        yield parts[0] if len(parts) == 1 else b"".join(parts)


def _spans(r: dict[str, Any], offset: int, end: int) -> Iterator[tuple[int, int, int]]:
    pieces, first = _pieces(r)
    return spans(pieces, first, offset, end)


def _chunk_size(r: dict[str, Any], blob: int) -> int:
    if blob == r["id"]:
        return int(r["chunk"])
    return int(r["chunks"][blob])


class _LmdbReader(Reader):
    """One read transaction of an :class:`LmdbStore`; use from one thread at a time."""

    def __init__(self, store: LmdbStore, txn: lmdb.Transaction):
        self._store = store
        self._txn: lmdb.Transaction | None = txn
        # chunk key → its view: a get of a big value costs time in proportion to
        # its size (~4 us per MiB here), so a reader that serves many small
        # reads of one chunk looks it up once
        self._chunks: dict[bytes, memoryview] = {}
        self._entries: dict[bytes, dict[str, Any]] = {}  # entry key → record, likewise

    def _live(self) -> lmdb.Transaction:
        if self._txn is None:
            raise StoreError("this reader is closed; open a new one with store.reader()")
        return self._txn

    def _entry(self, job: str, version: int, tensor: str, part: Slice | str) -> dict[str, Any]:
        txn = self._live()
        key = _ekey(job, version, tensor, part)
        rec = self._entries.get(key)
        if rec is not None:
            return rec
        self._store.check_size()
        raw = txn.get(key, db=self._store._db["entries"])
        if raw is None:
            raise self._store._missing(txn, job, version, f"has no {tensor} [{part_key(part)}]")
        rec = _unpack(raw)
        if len(self._entries) >= _CHUNK_VIEWS:
            self._entries.clear()
        self._entries[key] = rec
        return rec

    def check_committed(self, job: str, version: int) -> None:
        txn = self._live()
        raw = txn.get(_vkey(job, version), db=self._store._db["versions"])
        if raw is None:
            raise self._store._missing(txn, job, version, "")
        state = _unpack(raw)["state"]
        if state != "committed":
            raise VersionNotCommitted(not_committed(job, version, state))

    def info(self, job: str, version: int, tensor: str, part: Slice | str) -> EntryInfo:
        r = self._entry(job, version, tensor, part)
        return EntryInfo(tensor, part_key(part), tuple(r["shape"]), r["dtype"], r["nbytes"])

    def ranges(self, job: str, version: int, tensor: str, part: Slice | str,
               offset: int = 0, length: int | None = None) -> Iterator[memoryview]:
        r = self._entry(job, version, tensor, part)
        what = f"{tensor} [{part_key(part)}]"
        end = check_range(what, r["nbytes"], offset, length)

        def views() -> Iterator[memoryview]:
            for blob, at, size in _spans(r, offset, end):
                if blob == ZEROS:
                    while size > 0:
                        take = min(size, len(_ZERO_VIEW))
                        yield _ZERO_VIEW[:take]
                        size -= take
                    continue
                chunk = _chunk_size(r, blob)
                while size > 0:
                    index, within = divmod(at, chunk)
                    view = self._chunk(blob, index, what)
                    if len(view) <= within:
                        raise StoreError(f"chunk {index} of {what} is short: the store at "
                                         f"{self._store.path} is damaged")
                    take = min(len(view) - within, size)
                    yield view[within:within + take]  # a view of the map, not a copy
                    at, size = at + take, size - take

        return views()

    def read_into(self, job: str, version: int, tensor: str, part: Slice | str, offset: int,
                  out: np.ndarray) -> None:
        # the whole runs of a strided piece that lie in one chunk: one copy
        r = self._entry(job, version, tensor, part)
        end = check_range(f"{tensor} [{part_key(part)}]", r["nbytes"], offset, out.size)
        pieces, first = _pieces(r)
        i = max(bisect.bisect_right(first, offset) - 1, 0)
        pos = offset
        while pos < end:
            block = _interleaved(r, i) if pos == first[i] else None
            if block is not None and first[i + block[0] * block[1]] <= end:
                pos, i = self._copy_block(r, i, block, out[pos - offset:], tensor)
                continue
            size, count, stride, blob, off = pieces[i]
            last = min(end, first[i + 1])
            ka, kb = -(-(pos - first[i]) // size), (last - first[i]) // size
            a, b = first[i] + ka * size, first[i] + kb * size
            if kb - ka >= 2 and blob != ZEROS and size < stride:
                chunk = _chunk_size(r, blob)
                lo, hi = off + ka * stride, off + (kb - 1) * stride + size
                if lo // chunk == (hi - 1) // chunk:
                    if a > pos:
                        super().read_into(job, version, tensor, part, pos,
                                          out[pos - offset:a - offset])
                    view = np.frombuffer(self._chunk(blob, lo // chunk, tensor), np.uint8)
                    src = np.lib.stride_tricks.as_strided(
                        view[lo % chunk:], (kb - ka, size), (stride, 1), writeable=False)
                    out[a - offset:b - offset].reshape(kb - ka, size)[...] = src
                    pos = b
            if last > pos:
                super().read_into(job, version, tensor, part, pos, out[pos - offset:last - offset])
            pos = last
            i += 1

    def _copy_block(self, r: dict[str, Any], i: int, block: tuple[int, int, int],
                    out: np.ndarray, what: str) -> tuple[int, int]:
        """Copy an interleaved block (:func:`_interleaved`) that starts at
        piece ``i`` into the front of ``out``: one strided copy per phase.
        The position after it, and its next piece."""
        pieces, first = _pieces(r)
        period, rows, rowlen = block
        dest = out[:rows * rowlen].reshape(rows, rowlen)
        for j in range(period):
            size, _, _, blob, lo = pieces[i + j]
            col = first[i + j] - first[i]
            if blob == ZEROS:
                dest[:, col:col + size] = 0
                continue
            step = pieces[i + period + j][4] - lo
            chunk = _chunk_size(r, blob)
            view = np.frombuffer(self._chunk(blob, lo // chunk, what), np.uint8)
            dest[:, col:col + size] = np.lib.stride_tricks.as_strided(
                view[lo % chunk:], (rows, size), (step, 1), writeable=False)
        n = period * rows
        return first[i + n], i + n

    def _chunk(self, blob: int, index: int, what: str) -> memoryview:
        key = _ckey(blob, index)
        view: memoryview | None = self._chunks.get(key)
        if view is None:
            self._store.check_size()
            found = self._live().get(key, db=self._store._db["chunks"])
            if found is None:
                raise StoreError(f"chunk {index} of {what} is missing: the store at "
                                 f"{self._store.path} is damaged")
            view = memoryview(found)
            if len(self._chunks) >= _CHUNK_VIEWS:
                self._chunks.clear()
            self._chunks[key] = view
        return view

    def file_ranges(self, job: str, version: int, tensor: str, part: Slice | str
                    ) -> list[tuple[int, int, int]] | None:
        # found in the tree's pages where possible: a lookup would touch every
        # page of every chunk (see lmdb_pages)
        walker, mapped = self._store._walker, self._store._map
        if walker is None or mapped is None:
            return super().file_ranges(job, version, tensor, part)
        r = self._entry(job, version, tensor, part)
        if any(count > 1 and size < MIN_SPLICE_RUN for size, count, _, _, _ in _pieces(r)[0]):
            return None  # runs too short to splice: a read would need hundreds of ranges
        what = f"{tensor} [{part_key(part)}]"
        txnid = self._live().id()
        out: list[tuple[int, int, int]] = []
        found: dict[bytes, tuple[int, int] | None] = {}
        for blob, at, size in _spans(r, 0, r["nbytes"]):
            if blob == ZEROS:  # padding of a view: no file holds it
                out.append((ZERO_FD, 0, size))
                continue
            chunk = _chunk_size(r, blob)
            while size > 0:
                index, within = divmod(at, chunk)
                key = _ckey(blob, index)
                if key not in found:
                    found[key] = walker.locate(txnid, b"chunks", key)
                where = found[key]
                if where is None or where[1] <= within:
                    got = self.file_range(self._chunk(blob, index, what))
                    if got is None:
                        return None
                    where = found[key] = (got[1], len(self._chunk(blob, index, what)))
                take = min(where[1] - within, size)
                out.append((mapped[0], where[0] + within, take))
                at, size = at + take, size - take
        return out

    def placement(self, job: str, version: int, tensor: str, part: Slice | str) -> Hashable:
        # entry ids are never reused (``next_id``) and chunks are written once,
        # by the put that took the id. A value on overflow pages stays there
        # until it is deleted; a small one lives inside a leaf page, which
        # LMDB copies elsewhere whenever a neighbouring key changes (and then
        # reuses): its place holds only for this snapshot
        r = self._entry(job, version, tensor, part)
        return ("lmdb", r["id"]) if self._on_overflow_pages(r) else None

    def _on_overflow_pages(self, r: dict[str, Any]) -> bool:
        """Whether every chunk of every blob an entry's bytes lie in is big
        enough that LMDB keeps it on overflow pages: a value goes there when
        it does not fit in half a page with its key (``me_nodemax``)."""
        least = self._store._psize // 2
        sizes = [(int(r.get("own", r["nbytes"])), int(r["chunk"]))]
        for blob in blobs_of(_pieces(r)[0]) - {r["id"]}:
            raw = self._live().get(_U64.pack(blob), db=self._store._db["refs"])
            if raw is None:
                return False
            _, nbytes, chunk = _unpack(raw)
            sizes.append((int(nbytes), int(chunk)))
        for nbytes, chunk in sizes:
            if nbytes and ((nbytes >= chunk and chunk < least) or 0 < nbytes % chunk < least):
                return False
        return True

    def file_range(self, view: memoryview) -> tuple[int, int] | None:
        # LMDB maps its data file from offset 0, and a committed value's pages
        # are never rewritten while a read transaction that sees them is open
        if self._store._map is None:
            return None
        fd, base, size = self._store._map
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        return (fd, addr - base) if base <= addr <= base + size - len(view) else None

    def close(self) -> None:
        self._chunks.clear()
        self._entries.clear()
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
            self._store._readers.discard(self)


class LmdbStore(TensorStore):
    """A host's tensor store in one LMDB environment at ``path``.

    ``map_size`` and ``chunk_bytes`` default to ``PTC_STORE_MAP_SIZE`` and
    ``PTC_STORE_CHUNK_BYTES``, else :data:`MAP_SIZE` and :data:`CHUNK_BYTES`.
    ``readonly`` opens an existing store for reading only. ``writemap``
    lets LMDB write straight into its map: several times faster writes (see
    bench/bench_store.py); the data file's apparent size becomes
    ``map_size`` (sparse). It defaults to ``PTC_STORE_WRITEMAP`` (1 or 0),
    else on for a store on a filesystem that keeps files in memory (tmpfs)
    and off on disk, where whole reconfigurations were slower with it. A
    write into a map page the filesystem has no room for would kill the
    process (SIGBUS), so each write transaction first gives the data file
    real blocks (``posix_fallocate``) for what it may add: a full filesystem
    is a StoreError before anything is written. Processes writing to one
    store should agree on it (they do when they take the default).
    """

    def __init__(self, path: str | Path, map_size: int | None = None,
                 chunk_bytes: int | None = None, readonly: bool = False,
                 writemap: bool | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self.chunk_bytes = tunable(chunk_bytes, "PTC_STORE_CHUNK_BYTES")
        map_size = tunable(map_size, "PTC_STORE_MAP_SIZE")
        self.writemap = False  # decided once the folder exists
        self._wlock = threading.Lock()
        self._readers: weakref.WeakSet[_LmdbReader] = weakref.WeakSet()
        self._env: lmdb.Environment | None = None
        # the data file, open, with where it is mapped: (fd, address, size)
        self._map: tuple[int, int, int] | None = None
        self._walker: PageWalker | None = None  # finds values in _map's file (lmdb_pages)
        self._psize = 4096  # LMDB's page size, read once the store is open
        self._wfd: int | None = None  # writemap: the data file, for posix_fallocate
        self._backed = 0  # writemap: bytes of the data file known to have blocks
        self._registered = False
        try:
            if not readonly:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(self.path)
        except OSError as e:
            raise StoreError(f"cannot open the store at {self.path}: {e}") from e
        writemap = settings.get("PTC_STORE_WRITEMAP", writemap)
        if writemap is None:
            writemap = in_memory(self.path)
        self.writemap = bool(writemap) and not readonly
        self._ident = (st.st_dev, st.st_ino)
        with _OPEN_LOCK:
            if self._ident in _OPEN:
                raise StoreError(f"the store at {self.path} is open in this process already "
                                 f"(as {_OPEN[self._ident]}); share that LmdbStore object")
            _OPEN[self._ident] = str(self.path)
            self._registered = True
        try:
            check_data_file(self.path / "data.mdb")  # before LMDB maps it
            self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=len(_DBS),
                                  max_readers=MAX_READERS, readonly=readonly, lock=True,
                                  sync=True, metasync=False, writemap=self.writemap)
            self._db = {}
            for n in _DBS:
                try:
                    self._db[n] = self._env.open_db(n.encode(), create=not readonly)
                except lmdb.NotFoundError:
                    if n not in _LATER_DBS:
                        raise
            if not readonly:
                _owner_only(self.path)
            self._env.reader_check()
            self._psize = int(self._env.stat()["psize"])
            self._map = _data_map(self.path / "data.mdb", self._env.info()["map_size"])
            if self._map is not None:
                self._walker = PageWalker(self._map[0], self._psize)
            if self.writemap:
                self._wfd = os.open(self.path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
            self._check_format()
        except (lmdb.Error, PtcError, OSError) as e:
            self.close()
            if isinstance(e, PtcError):
                raise
            raise StoreError(f"cannot open the store at {self.path}: {e}"
                             + (" (is it a ptcfs store?)" if readonly else "")) from e

    def _check_format(self) -> None:
        env = self._live()
        with env.begin(write=not self.readonly) as txn:
            raw = txn.get(b"format", db=self._db["meta"])
            ident = txn.get(b"store_id", db=self._db["meta"])
            if ident is None and not self.readonly:
                ident = os.urandom(16)
                txn.put(b"store_id", ident, db=self._db["meta"])
            #: the id written when the store was made (None: an old read-only store)
            self.store_id = None if ident is None else bytes(ident).hex()
            #: whether this open made the store (it held nothing before)
            self.created = raw is None and not self.readonly
            if raw is None and txn.stat(self._db["versions"])["entries"]:
                raise StoreError(f"the store at {self.path} was written by an earlier ptcfs "
                                 "with another layout; move it away and fetch from peers")
            if raw is None and not self.readonly:
                txn.put(b"format", _U64.pack(_FORMAT), db=self._db["meta"])
            elif raw is not None and _U64.unpack(raw)[0] != _FORMAT:
                raise StoreError(f"the store at {self.path} has layout {_U64.unpack(raw)[0]}; "
                                 f"this ptcfs reads layout {_FORMAT}")

    # --- helpers -------------------------------------------------------------
    def _live(self) -> lmdb.Environment:
        if self._env is None:
            raise StoreError(f"the store at {self.path} is closed")
        return self._env

    def check_size(self) -> None:
        """StoreDamaged when the data file is shorter than the pages in use
        (cut under this process): LMDB would read past its end through its
        map, and the kernel kill the process with SIGBUS. Every transaction
        and every lookup of a reader asks first (one fstat); a file cut
        between the question and the read is still a SIGBUS."""
        if self._map is None or self._env is None:
            return
        # pages in use first: a commit in between grows the file before its meta page
        used = (self._env.info()["last_pgno"] + 1) * self._psize
        size = os.fstat(self._map[0]).st_size
        if size < used:
            raise StoreDamaged(_cut_short(self.path / "data.mdb", size, used))

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        self.check_size()
        try:
            with self._live().begin() as txn:
                yield txn
        except lmdb.Error as e:
            raise StoreError(f"cannot read the store at {self.path}: {e}") from e

    @contextmanager
    def _write(self, durable: bool = True, adds: int = 0) -> Iterator[lmdb.Transaction]:
        """A write transaction that may add ``adds`` bytes of values."""
        env = self._live()
        if self.readonly:
            raise StoreError(f"the store at {self.path} is open read-only")
        with self._wlock:
            self.check_size()
            try:
                with env.begin(write=True) as txn:
                    if self._wfd is not None:
                        self._reserve(env, self._wfd, adds)
                    yield txn
                if durable:
                    env.sync(True)
            except lmdb.MapFullError as e:
                raise StoreError(
                    f"the store at {self.path} is full: its map size is {env.info()['map_size']} "
                    "bytes. Delete old versions (delete_version) or abort staging ones, or reopen "
                    "it with a larger map_size (PTC_STORE_MAP_SIZE)") from e
            except lmdb.Error as e:
                raise StoreError(f"the store at {self.path} failed: {e}") from e

    def _reserve(self, env: lmdb.Environment, fd: int, adds: int) -> None:
        """Writemap: blocks for every page this transaction may use. LMDB
        takes new pages past the last one in use (pages below it are written
        already), so the file needs blocks up to there plus what is added,
        plus room for the free list (8 bytes per freed 4 KiB page). When the
        filesystem has no room for that, pages freed by deleted or aborted
        versions that LMDB will reuse are counted too (:meth:`_reusable`), so
        a store that filled up works again once versions are freed."""
        info, used = env.info(), _used(env)
        grow = adds + adds // 64
        want = used + grow + used // 512 + RESERVE_SLACK
        start = max(used, self._backed)
        want = min(want, info["map_size"])  # past the map LMDB says it is full
        if want <= start:
            return
        try:
            os.posix_fallocate(fd, start, want - start)
            self._backed = want
            return
        except OSError as e:
            error = e
        reused = self._reusable(env, info["last_txnid"], adds)
        need = min(used + max(0, grow - reused - reused // 64) + used // 512 + RESERVE_SLACK,
                   info["map_size"])
        try:
            if need > start:
                os.posix_fallocate(fd, start, need - start)
                self._backed = need
            return
        except OSError:
            pass
        raise StoreError(
            f"the filesystem holding the store at {self.path} has no room for "
            f"{max(need - start, 0)} more bytes ({error.strerror}); nothing was written. "
            f"{self._freeable()}") from error

    def _reusable(self, env: lmdb.Environment, last_txn: int, adds: int) -> int:
        """Bytes of a write of ``adds`` that pages freed by earlier
        transactions will take instead of new ones: LMDB puts a chunk on a
        run of contiguous free pages when one is long enough, and takes pages
        freed before the oldest snapshot a reader still sees (from the free
        list as the data file holds it, :mod:`ptcfs.store.lmdb_pages`)."""
        if self._walker is None or adds <= 0:
            return 0
        seen = [int(f[2]) for f in (line.split() for line in env.readers().splitlines()[1:])
                if len(f) == 3 and f[2].isdigit()]
        pages = self._walker.free_pages(last_txn, min(seen, default=last_txn + 1))
        if not pages:
            return 0
        chunk = min(adds, self.chunk_bytes)
        need = -(-(chunk + _PAGE_HEADER) // self._walker.psize)
        fit, run = 0, 1
        for a, b in zip(pages, pages[1:] + [-1]):
            if b == a + 1:
                run += 1
                continue
            fit, run = fit + run // need, 1
        return min(adds, fit * chunk)

    def _freeable(self) -> str:
        """What could be freed in this store, as advice for an error."""
        old: list[str] = []
        staging: list[str] = []
        for job in self.jobs():
            infos = self.versions(job)
            current = max((v.version for v in infos if v.state == "committed"), default=None)
            for v in infos:
                size = self.footprint(job, v.version) / 2**20
                if v.state == "staging":
                    staging.append(f"{job} v{v.version} ({size:.1f} MiB)")
                elif v.version != current:
                    old.append(f"{job} v{v.version} ({size:.1f} MiB)")
        parts = []
        if old:
            parts.append("old versions that can be deleted: " + ", ".join(old))
        if staging:
            parts.append("staging versions that can be aborted: " + ", ".join(staging))
        if not parts:
            return ("Every version in it is current: give the store a larger filesystem, "
                    "or delete a job (ptcctl job delete)")
        return "Free space on the filesystem, or free it in the store: " + "; ".join(parts)

    def _get(self, txn: lmdb.Transaction, db: str, key: bytes) -> Any:
        raw = txn.get(key, db=self._db[db])
        return None if raw is None else _unpack(raw)

    def _missing(self, txn: lmdb.Transaction, job: str, version: int, what: str) -> PtcError:
        """The error for an absent entry: no such job, version, or entry."""
        if txn.get(check_name("job", job).encode(), db=self._db["jobs"]) is None:
            return JobNotFound(f"no job {job!r} in the store at {self.path}")
        if txn.get(_vkey(job, version), db=self._db["versions"]) is None:
            have = [_U64.unpack(k[-8:])[0]
                    for k, _ in _scan(txn, self._db["versions"], job.encode() + b"\0")]
            return VersionNotFound(f"job {job!r} has no version {version} (it has {have})")
        return TensorNotFound(f"job {job!r} version {version} {what}")

    def _version(self, txn: lmdb.Transaction, job: str, version: int) -> dict[str, Any]:
        rec = self._get(txn, "versions", _vkey(job, version))
        if rec is None:
            raise self._missing(txn, job, version, "")
        return dict(rec)

    def _drop_chunks(self, txn: lmdb.Transaction, rec: dict[str, Any]) -> None:
        """An entry goes: each blob it refers to loses a referrer, and one
        that has no referrer left goes with its chunks."""
        pieces, _ = _pieces(rec)
        blobs = blobs_of(pieces) | ({rec["id"]} if rec.get("own", rec["nbytes"]) else set())
        for blob in blobs:
            raw = txn.get(_U64.pack(blob), db=self._db["refs"])
            if raw is None:  # a plain entry's own blob: no one else refers to it
                nbytes, chunk = rec["nbytes"], rec["chunk"]
            else:
                n, nbytes, chunk = _unpack(raw)
                if n > 1:
                    txn.put(_U64.pack(blob), msgpack.packb([n - 1, nbytes, chunk]),
                            db=self._db["refs"])
                    continue
                txn.delete(_U64.pack(blob), db=self._db["refs"])
            for i in range(-(-nbytes // chunk)):
                txn.delete(_ckey(blob, i), db=self._db["chunks"])
                txn.delete(_ckey(blob, i), db=self._db["sums"])

    def _drop(self, txn: lmdb.Transaction, job: str, version: int) -> None:
        prefix = _vkey(job, version)
        cur = txn.cursor(db=self._db["entries"])
        if cur.set_range(prefix):
            while bytes(cur.key()).startswith(prefix):
                self._drop_chunks(txn, _unpack(cur.value()))
                if not cur.delete():
                    break
        for k in [k for k, _ in _scan(txn, self._db["damaged"], prefix)]:
            txn.delete(k, db=self._db["damaged"])
        txn.delete(prefix, db=self._db["versions"])

    # --- versions ------------------------------------------------------------
    def begin(self, job: str, meta: dict[str, Any] | None = None) -> int:
        jkey, meta = check_name("job", job).encode(), copy_meta(meta)
        with self._write() as txn:
            rec = self._get(txn, "jobs", jkey) or {"last": 0, "current": None}
            version = rec["last"] + 1
            txn.put(jkey, msgpack.packb({**rec, "last": version}), db=self._db["jobs"])
            txn.put(_vkey(job, version), msgpack.packb({"state": "staging", "meta": meta}),
                    db=self._db["versions"])
        return version

    def begin_at(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        vkey, jkey, packed = _vkey(job, version), job.encode(), copy_meta(meta)
        with self._write() as txn:
            old = self._get(txn, "versions", vkey)
            if old is not None and old["state"] == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed already")
            if old is None or meta is not None:
                new = {"state": "staging", "meta": packed if meta is not None else {}}
                txn.put(vkey, msgpack.packb(new), db=self._db["versions"])
            rec = self._get(txn, "jobs", jkey) or {"last": 0, "current": None}
            if version > rec["last"]:
                txn.put(jkey, msgpack.packb({**rec, "last": version}), db=self._db["jobs"])

    def commit(self, job: str, version: int, meta: dict[str, Any] | None = None) -> None:
        packed = copy_meta(meta)
        with self._write() as txn:
            rec = self._version(txn, job, version)
            if rec["state"] == "committed":
                return
            rec = {"state": "committed", "meta": {**rec["meta"], **packed}}
            txn.put(_vkey(job, version), msgpack.packb(rec), db=self._db["versions"])
            jrec = self._get(txn, "jobs", job.encode())
            if jrec["current"] is None or version > jrec["current"]:
                txn.put(job.encode(), msgpack.packb({**jrec, "current": version}),
                        db=self._db["jobs"])

    def update_meta(self, job: str, changes: dict[str, Any]) -> int:
        packed = copy_meta(changes)
        prefix = check_name("job", job).encode() + b"\0"
        with self._write() as txn:
            found = [(bytes(k), _unpack(v)) for k, v in _scan(txn, self._db["versions"], prefix)]
            for k, rec in found:
                rec = {**rec, "meta": {**rec["meta"], **packed}}
                txn.put(k, msgpack.packb(rec), db=self._db["versions"])
        return len(found)

    def abort(self, job: str, version: int) -> None:
        vkey = _vkey(job, version)
        with self._write() as txn:
            rec = self._get(txn, "versions", vkey)
            if rec is None:
                return
            if rec["state"] == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed; "
                                       "delete_version drops old committed versions")
            self._drop(txn, job, version)

    def delete_version(self, job: str, version: int) -> None:
        with self._write() as txn:
            rec = self._version(txn, job, version)
            if rec["state"] != "committed":
                raise InvalidRequest(f"job {job!r} version {version} is staging; abort it instead")
            if self._get(txn, "jobs", job.encode())["current"] == version:
                raise VersionImmutable(f"version {version} is the current version of {job!r}; "
                                       "commit a newer one before deleting it")
            self._drop(txn, job, version)

    def delete_job(self, job: str) -> int:
        jkey = check_name("job", job).encode()
        with self._write() as txn:
            versions = [_U64.unpack(bytes(k)[-8:])[0]
                        for k, _ in _scan(txn, self._db["versions"], jkey + b"\0")]
            for v in versions:
                self._drop(txn, job, v)
            txn.delete(jkey, db=self._db["jobs"])
        return len(versions)

    def current(self, job: str) -> int | None:
        jkey = check_name("job", job).encode()
        with self._read() as txn:
            rec = self._get(txn, "jobs", jkey)
        return None if rec is None else rec["current"]

    def versions(self, job: str) -> list[VersionInfo]:
        prefix = check_name("job", job).encode() + b"\0"
        with self._read() as txn:
            return [VersionInfo(job, _U64.unpack(k[-8:])[0], r["state"], r["meta"])
                    for k, r in ((k, _unpack(v))
                                 for k, v in _scan(txn, self._db["versions"], prefix))]

    def changes(self) -> int | None:
        """The id of the last write transaction (any process's: LMDB's meta
        page), the data file checked first as every reader is."""
        env = self._live()
        self.check_size()
        return int(env.info()["last_txnid"])

    def jobs(self) -> list[str]:
        with self._read() as txn:
            names = [bytes(k) for k, _ in _scan(txn, self._db["jobs"], b"")]
            return [n.decode() for n in names
                    if next(_scan(txn, self._db["versions"], n + b"\0"), None) is not None]

    # --- room for the next versions --------------------------------------------
    def make_room(self, nbytes: int, stop: Callable[[], bool] | None = None) -> int:
        """Make sure values taking ``nbytes`` of pages (:meth:`footprint`) fit
        in pages of the data file that are written already: pages freed by
        deleted versions count, and room is made past the last page in use
        for the rest (:mod:`ptcfs.store.room`: zeros written, or with
        writemap pages faulted in for writing), ROOM_STEP at a time until
        ``stop()`` says so. Returns the bytes of room made.

        Why: a page that a file never had costs the filesystem an allocation
        (and on tmpfs, fresh memory, which is slow to touch on VMs whose host
        takes back free memory), while rewriting a page costs only the copy.
        Called between reconfigurations, it takes that cost off the next one
        (bench/bench_reconfigure.py). Each step holds LMDB's write lock, so no
        transaction is writing past the last page meanwhile; LMDB reads no
        page past it, so the zeros are never taken for data. Nothing is made
        read-only (or with writemap where this process's map is not known),
        nor more than half of the filesystem's free space."""
        if self.readonly or nbytes <= 0 or (self.writemap and self._map is None):
            return 0
        env = self._live()
        used = _used(env)
        # the trees' pages count as free: 1/64 more covers them
        goal = min(used + nbytes + nbytes // 64 - max(0, used - self.footprint()),
                   env.info()["map_size"])
        made = 0
        try:
            fd = os.open(self.path / "data.mdb", os.O_WRONLY | os.O_CLOEXEC)
            fs = os.statvfs(fd)
        except OSError as e:
            raise StoreError(f"cannot open the store at {self.path} for writing: {e}") from e
        # never more than half of the filesystem's free space
        goal = min(goal, written_end(fd, used, self.writemap) + fs.f_bavail * fs.f_frsize // 2)
        # with writemap: where this process maps the data file; else zeros to write
        mapped = self._map[1] if self.writemap and self._map is not None else None
        zeros = b"" if mapped is not None else bytes(min(ROOM_STEP, max(goal - used, 0)))
        try:
            while stop is None or not stop():
                with self._write(durable=False):
                    end = written_end(fd, _used(env), self.writemap)
                    if end >= goal:
                        break
                    if mapped is not None:
                        n = min(ROOM_STEP, goal - end)
                        populate(mapped + end, n)
                        made += n
                    else:
                        made += os.pwrite(fd, memoryview(zeros)[:goal - end], end)
        except OSError as e:
            raise StoreError(f"could not make room in the store at {self.path} after "
                             f"{made} bytes: {e}") from e
        finally:
            os.close(fd)
        return made

    def footprint(self, job: str | None = None, version: int | None = None) -> int:
        """Bytes of the pages that hold the values of a version's entries (of
        every entry in the store without arguments): what writing a version
        like it takes. An absent version takes nothing."""
        prefix = b"" if job is None or version is None else _vkey(job, version)
        psize = self._live().stat()["psize"]

        def pages(n: int) -> int:
            return -(-(n + _PAGE_HEADER) // psize) if n else 0

        total = chunks = 0
        with self._read() as txn:
            for _, raw in _scan(txn, self._db["entries"], prefix):
                rec = _unpack(raw)
                full, last = divmod(rec.get("own", rec["nbytes"]), rec["chunk"])
                total += full * pages(rec["chunk"]) + pages(last)
                chunks += full + (last > 0)
        # each chunk's checksum: a leaf node of key, value and node header
        return (total + pages(chunks * _SUM_NODE)) * psize

    # --- entries -------------------------------------------------------------
    def put(self, job: str, version: int, tensor: str, part: Slice | str, data: Buffer,
            shape: tuple[int, ...], dtype: str, mark: str | None = None,
            written: float | None = None) -> None:
        self.put_many(job, version, [PutEntry(tensor, part, data, shape, dtype)], mark, written)

    def put_many(self, job: str, version: int, entries: Sequence[PutEntry],
                 mark: str | None = None, written: float | None = None) -> None:
        checked = [(_ekey(job, version, e.tensor, e.part), e.dtype,
                    *check_data(f"{e.tensor} [{part_key(e.part)}]", e.data, e.shape, e.dtype))
                   for e in entries]
        stamp = time.time() if written is None else written
        with self._write(durable=False, adds=sum(c[2].nbytes for c in checked)) as txn:
            rec = self._version(txn, job, version)
            check_writable(job, version, rec["state"], rec["meta"], mark)
            for key, dtype, view, shape in checked:
                self._put_entry(txn, key, view, shape, dtype, stamp)

    def _put_entry(self, txn: lmdb.Transaction, key: bytes, view: memoryview,
                   shape: tuple[int, ...], dtype: str, stamp: float) -> None:
        old = self._get(txn, "entries", key)
        if old is not None:
            if (old.get("written") or 0.0) > stamp:
                return  # a newer write of it is in (see Store.put)
            self._drop_chunks(txn, old)
        raw = txn.get(b"next_id", db=self._db["meta"])
        entry_id = 0 if raw is None else _U64.unpack(raw)[0]
        txn.put(b"next_id", _U64.pack(entry_id + 1), db=self._db["meta"])
        step = self.chunk_bytes
        for i, start in enumerate(range(0, view.nbytes, step)):
            chunk = view[start:start + step]
            txn.put(_ckey(entry_id, i), chunk, db=self._db["chunks"])
            txn.put(_ckey(entry_id, i), chunk_sum(chunk), db=self._db["sums"])
        rec = {"shape": list(shape), "dtype": dtype, "nbytes": view.nbytes, "chunk": step,
               "id": entry_id, "written": stamp}
        txn.put(key, msgpack.packb(rec), db=self._db["entries"])

    def put_view(self, job: str, version: int, tensor: str, part: Slice | str,
                 shape: tuple[int, ...], dtype: str, refs: Sequence[ViewRef],
                 data: Buffer | None = None) -> None:
        self.put_views(job, version, [ViewEntry(tensor, part, shape, dtype, tuple(refs), data)])

    def put_views(self, job: str, version: int, entries: Sequence[ViewEntry]) -> None:
        """One transaction: every entry is stored, or none."""
        checked = []
        for e in entries:
            what = f"{e.tensor} [{part_key(e.part)}]"
            shape, nbytes = check_shape(what, e.shape, e.dtype)
            view = None if e.data is None else check_data(what, e.data, shape, e.dtype)[0]
            checked.append((e, what, tuple(shape), nbytes, view))
        adds = sum(nbytes for _, _, _, nbytes, view in checked if view is not None)
        with self._write(durable=False, adds=adds) as txn:
            if self._version(txn, job, version)["state"] == "committed":
                raise VersionImmutable(f"job {job!r} version {version} is committed; "
                                       "begin a new version to write")
            # the entries views refer to, read once per transaction: (shape,
            # itemsize, pieces, blob → (nbytes, chunk) of its blob)
            known: dict[tuple[int, str, str], _Source] = {}
            for e, what, shape, nbytes, view in checked:
                self._put_view(txn, job, version, e, what, shape, nbytes, view, known)

    def _put_view(self, txn: lmdb.Transaction, job: str, version: int, e: ViewEntry,
                  what: str, shape: tuple[int, ...], nbytes: int,
                  view: memoryview | None, known: dict[tuple[int, str, str], _Source]) -> None:
        key = _ekey(job, version, e.tensor, e.part)
        itemsize = DTYPE_SIZES[e.dtype]
        refs = e.refs
        sources: dict[int, tuple[int, int]] = {}  # blob → (nbytes, chunk) of its blob

        def source(ref: ViewRef) -> tuple[tuple[int, ...], int, Sequence[Piece]]:
            if ref.version >= version:
                raise InvalidRequest(f"{what}: a view refers to earlier versions only, "
                                     f"not {ref.version}")
            found = known.get((ref.version, ref.tensor, ref.part))
            if found is None:
                raw = txn.get(_ekey(job, ref.version, ref.tensor, ref.part),
                              db=self._db["entries"])
                if raw is None:
                    raise self._missing(txn, job, ref.version,
                                        f"has no {ref.tensor} [{ref.part}]")
                src = _unpack(raw)
                pieces = _piece_list(src)
                # a plain entry's blob is its whole entry
                blobs = {blob: (-1 if "pieces" in src else src["nbytes"], _chunk_size(src, blob))
                         for blob in blobs_of(pieces)}
                # many pieces (a merge's): as an array, expanded once per ref, not converted
                listed: Sequence[Piece] = pieces if len(pieces) < 16 else \
                    np.array(pieces, dtype=np.int64)  # type: ignore[assignment]
                made: _Source = (tuple(src["shape"]), DTYPE_SIZES[src["dtype"]], listed, blobs)
                known[(ref.version, ref.tensor, ref.part)] = found = made
            sources.update(found[3])
            return found[0], found[1], found[2]

        # one ref of one stored stretch, taken whole or cut along one dimension
        # (most entries of a reshard within hosts), or shards merged side by side:
        # their pieces by arithmetic
        simple = None
        if view is None and len(refs) == 1:
            simple = one_ref_pieces(shape, itemsize, refs[0], source(refs[0]))
        elif view is None and refs:
            simple = merge_pieces(shape, itemsize, refs, [source(r) for r in refs])
        runs = view_runs(shape, itemsize, refs, source, what) if simple is None else None
        old = self._get(txn, "entries", key)
        if old is not None:
            self._drop_chunks(txn, old)
        raw = txn.get(b"next_id", db=self._db["meta"])
        entry_id = 0 if raw is None else _U64.unpack(raw)[0]
        txn.put(b"next_id", _U64.pack(entry_id + 1), db=self._db["meta"])
        pieces: list[Piece] = simple or []
        gaps: list[tuple[int, int]] = []
        if runs is not None:
            pieces, gaps = pack(nbytes, runs, None if view is None else entry_id)
        own = sum(n for _, n in gaps)
        step = self.chunk_bytes
        if view is not None:
            for i, buf in enumerate(_own_chunks(view, gaps, step)):
                txn.put(_ckey(entry_id, i), buf, db=self._db["chunks"])
                txn.put(_ckey(entry_id, i), chunk_sum(buf), db=self._db["sums"])
            if own:
                txn.put(_U64.pack(entry_id), msgpack.packb([1, own, step]),
                        db=self._db["refs"])
        used = blobs_of(pieces) - {entry_id}
        for blob in used:
            rkey = _U64.pack(blob)
            raw = txn.get(rkey, db=self._db["refs"])
            if raw is None:  # a plain entry's blob, shared from now on
                rec_n, rec_bytes, rec_chunk = 1, *sources[blob]
            else:
                rec_n, rec_bytes, rec_chunk = _unpack(raw)
            txn.put(rkey, msgpack.packb([rec_n + 1, rec_bytes, rec_chunk]),
                    db=self._db["refs"])
        rec = {"shape": list(shape), "dtype": e.dtype, "nbytes": nbytes, "chunk": step,
               "id": entry_id, "own": own, "pieces": pieces,
               "chunks": {b: sources[b][1] for b in used}}
        txn.put(key, msgpack.packb(rec), db=self._db["entries"])

    def entries(self, job: str, version: int) -> list[EntryInfo]:
        prefix = _vkey(job, version)
        with self._read() as txn:
            self._version(txn, job, version)
            out = []
            for k, v in _scan(txn, self._db["entries"], prefix):
                tensor, part = k[len(prefix):].decode().split("\0")
                r = _unpack(v)
                out.append(EntryInfo(tensor, part, tuple(r["shape"]), r["dtype"], r["nbytes"],
                                     r.get("written")))
        return sorted(out, key=lambda e: (e.tensor, e.part))

    def reader(self) -> Reader:
        self.check_size()
        try:
            r = _LmdbReader(self, self._live().begin(buffers=True))
        except lmdb.ReadersFullError as e:
            raise StoreError(f"{MAX_READERS} readers are open on the store at {self.path}; "
                             "close readers you no longer need") from e
        except lmdb.Error as e:
            raise StoreError(f"cannot read the store at {self.path}: {e}") from e
        self._readers.add(r)
        return r

    # --- integrity at rest ---------------------------------------------------
    def scrub(self, after: bytes | None = None, budget: int = 64 << 20
              ) -> tuple[list[DamagedEntry], bytes | None, int]:
        if self.readonly:
            raise StoreError(f"the store at {self.path} is open read-only: it cannot scrub")
        bad, nxt, read = scrub_step(self, after, budget)
        return quarantine(self, bad), nxt, read

    def damaged(self) -> list[DamagedEntry]:
        return damaged_entries(self)

    def check_file(self) -> str | None:
        data = self.path / "data.mdb"
        # pages in use first: a commit in between grows the file before its meta page
        used = _used(self._live())
        try:
            st = os.stat(data)
        except FileNotFoundError:
            return (f"{data} was deleted under the running store: its copies live on only "
                    "until it closes")
        except OSError as e:
            return f"cannot look at {data}: {e}"
        if self._map is not None:
            mine = os.fstat(self._map[0])
            if (mine.st_dev, mine.st_ino) != (st.st_dev, st.st_ino):
                return f"{data} was replaced under the running store: it is not the file in use"
        if st.st_size < used:
            return _cut_short(data, st.st_size, used)
        return None

    # --- housekeeping --------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        env = self._live()
        info = env.info()
        try:
            st = os.stat(self.path / "data.mdb")
        except FileNotFoundError:  # deleted under us (check_file says so): the file in use
            if self._map is None:
                raise StoreDamaged(f"{self.path / 'data.mdb'} was deleted under the running "
                                   "store") from None
            st = os.fstat(self._map[0])
        used = _used(env)
        if self._map is not None:
            end = written_end(self._map[0], used, self.writemap)
        else:
            end = used if self.writemap else max(used, st.st_size)
        try:
            tally: dict[str, Any] = self._tally()
        except StoreDamaged:  # cut short under us (check_file says so): no page is read
            tally = dict.fromkeys(("jobs", "versions", "entries", "stored_bytes",
                                   "referenced_bytes", "damaged"))
        return {"backend": "lmdb", "path": str(self.path), **tally,
                "bytes_used": used, "disk_bytes": st.st_blocks * 512,
                # zeros past the last page in use (make_room)
                "room_bytes": end - used,
                "writemap": self.writemap, "store_id": self.store_id,
                "map_size": info["map_size"], "chunk_bytes": self.chunk_bytes,
                "readers": info["num_readers"]}

    def _tally(self) -> dict[str, Any]:
        """What :meth:`stats` counts by reading the store's trees."""
        stored = referenced = 0
        with self._read() as txn:
            counts = {n: txn.stat(self._db[n])["entries"] for n in ("versions", "entries")}
            # shared blobs have a refs record; the others are their entry's alone
            stored = sum(_unpack(raw)[1] for _, raw in _scan(txn, self._db["refs"], b""))
            for _, raw in _scan(txn, self._db["entries"], b""):
                rec = _unpack(raw)
                if txn.get(_U64.pack(rec["id"]), db=self._db["refs"]) is None:
                    stored += rec.get("own", rec["nbytes"])
                referenced += sum(p[0] * p[1] for p in _pieces(rec)[0]
                                  if p[3] not in (rec["id"], ZEROS))
        return {"jobs": len(self.jobs()), **counts, "stored_bytes": stored,
                "referenced_bytes": referenced, "damaged": len(self.damaged())}

    def close(self) -> None:
        """Close the store; open readers are closed and their buffers become invalid."""
        for r in list(self._readers):
            r.close()
        if self._map is not None:
            os.close(self._map[0])
            self._map = None
            self._walker = None
        if self._wfd is not None:
            os.close(self._wfd)
            self._wfd = None
        if self._env is not None:
            self._env.close()
            self._env = None
        with _OPEN_LOCK:
            if self._registered:
                del _OPEN[self._ident]
                self._registered = False
