"""Serving ``(offset, size)`` reads of files under the mount.

A read touches only the bytes it asks for: headers from memory, local
sub-tensors straight from the store's memory, remote ones from the peer
daemons (``Remote``). When one read lies inside one stored run on this
host, the answer *is* the store's memory (no copy in Python: the FUSE
layer copies it once into the kernel's buffer); otherwise the pieces are
gathered into a per-thread buffer that is reused from read to read.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import numpy as np

from ptcfs.boxes import linear_boxes
from ptcfs.errors import TensorNotFound
from ptcfs.fuse.tally import Tally
from ptcfs.fuse.tree import ArrayFile, File
from ptcfs.store.base import ZERO_FD, Reader, TensorStore
from ptcfs.store.boxes import copy_box
from ptcfs.types import Box, box_intersect
from ptcfs.vfile import Literal, StoreRange, VFile

__all__ = ["FileRange", "Remote", "ReadServer", "Span"]


class Remote(Protocol):
    """Reads from other hosts' daemons."""

    def read_range(self, hosts: tuple[str, ...], job: str, version: int, tensor: str,
                   part: str, offset: int, length: int, out: memoryview) -> None:
        """Bytes of an entry from the first of ``hosts`` that answers."""

    def read_box(self, hosts: tuple[str, ...], job: str, version: int, tensor: str, part: str,
                 box: Box, itemsize: int, out: memoryview) -> None:
        """A box of an entry from the first of ``hosts`` that answers."""


class FileRange(NamedTuple):
    """``size`` bytes at ``pos`` of the open file ``fd``."""

    fd: int
    pos: int
    size: int


def _add_range(out: list[Any], fd: int, pos: int, size: int) -> None:
    """Append a file range to ``out``, joined to the last piece when it follows on."""
    last = out[-1] if out else None
    if isinstance(last, FileRange) and last.fd == fd and last.pos + last.size == pos:
        out[-1] = FileRange(fd, last.pos, last.size + size)
    else:
        out.append(FileRange(fd, pos, size))


#: A read answered in more pieces than this is copied into one buffer instead
#: (each piece costs the kernel at least a page of its pipe).
MAX_PIECES = 16


class Span:
    """A read-only buffer handed to the FUSE layer by address (no copy)."""

    def __init__(self, view: memoryview):
        self._keep = np.frombuffer(view, dtype=np.uint8)
        self._as_parameter_ = ctypes.c_void_p(self._keep.ctypes.data)

    def __len__(self) -> int:
        return int(self._keep.size)


#: Seconds a thread keeps one store snapshot before taking a fresh one. A
#: snapshot sees every version committed before it; one that misses a newer
#: version is renewed at once. Long-lived snapshots keep a store from
#: reusing the pages of deleted versions, so they are renewed regularly.
READER_RENEW_S = 1.0
#: A thread's state (snapshot, caches, buffers) unused this long is dropped,
#: by a sweeper that looks every IDLE_S / 2 seconds.
IDLE_S = 2 * READER_RENEW_S


class _Local:
    """One thread's state. Kept by thread id, not in a ``threading.local``:
    libfuse's threads are not Python's, and each callback into Python from
    one of them starts with a fresh thread state, which would empty a
    ``threading.local`` every time."""

    reader: Reader | None = None
    opened: float = 0.0
    used: float = 0.0
    # (job, version, tensor, part) → the entry's bytes when they are one view of
    # the reader's snapshot (a view of many small ranges reads them without lookups)
    whole: dict[tuple[str, int, str, str], memoryview | None]
    # (job, version, tensor, part) → where the entry's bytes lie in the store's
    # data file in the reader's snapshot: the entry offset each run starts at,
    # and the runs; None when some of them are not in such a file
    extents: dict[tuple[str, int, str, str], tuple[list[int], list[FileRange]] | None]
    # (job, version) the reader's snapshot holds committed
    committed: set[tuple[str, int]]

    def __init__(self) -> None:
        self.whole = {}
        self.extents = {}
        self.committed = set()
        self.lock = threading.Lock()  # held by its thread while it serves a read
    buf: bytearray | None = None
    scratch: bytearray | None = None

    def drop_reader(self) -> None:
        """Close the snapshot and forget what was looked up in it."""
        self.whole.clear()
        self.extents.clear()
        self.committed.clear()
        if self.reader is not None:
            self.reader.close()
            self.reader = None


class ReadServer:
    """Reads of files for one host (``host``, holding ``store``)."""

    def __init__(self, store: TensorStore, host: str, remote: Remote,
                 tally: Tally | None = None):
        self.store = store
        self.host = host
        self.remote = remote
        #: counts lookups of where entries lie (``lookup_hits``, ``lookup_misses``)
        self.tally = tally or Tally()
        self._states: dict[int, _Local] = {}
        # the store's placement token of an entry → where it lies (``_extents``),
        # shared by all threads and kept across their snapshots: finding it
        # again costs a lookup of each of the entry's chunks, and LMDB's
        # binding touches every page of a chunk it looks up
        self._placed: dict[Hashable, tuple[list[int], list[FileRange]]] = {}
        self._locating = threading.Lock()
        self._states_lock = threading.Lock()
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def _tls(self) -> _Local:
        """This thread's state."""
        ident = threading.get_ident()
        st = self._states.get(ident)
        if st is None:
            with self._states_lock:
                st = self._states.setdefault(ident, _Local())
                if self._sweeper is None and not self._closed.is_set():
                    self._sweeper = threading.Thread(target=self._sweep_loop,
                                                     name="ptcfs-read-sweeper", daemon=True)
                    self._sweeper.start()
        return st

    def read(self, f: File, offset: int, size: int) -> Any:
        """The bytes ``[offset, offset + size)`` of ``f`` (short at its end),
        as an object the FUSE layer can copy from: valid until the next read
        on this thread."""
        size = max(0, min(size, f.size - offset))
        if size == 0:
            return b""
        with self._using():
            try:
                return self._read(self._reader(), f, offset, size, self.host)
            except FileNotFoundError:  # committed after this thread's snapshot: take a new one
                try:
                    return self._read(self._reader(renew=True), f, offset, size, self.host)
                except TensorNotFound:  # this host's copy went (a scrub quarantined it)
                    return self._read(self._reader(), f, offset, size, None)

    def _read(self, reader: Reader, f: File, offset: int, size: int, here: str | None) -> Any:
        """:meth:`read` in ``reader``, reading this host's copies when
        ``here`` (its name) is among a piece's holders; ``here`` None: every
        piece from the holders' daemons (this host's, which lacks the piece,
        says so, and the next is asked)."""
        copy_out = getattr(f, "copy_out", None)  # files of many runs (dataset views)
        if copy_out is not None:
            out = self._buffer("buf", size)

            def source(chunk: int, part: str, hosts: tuple[str, ...]) -> np.ndarray | None:
                seg = StoreRange(f.job, f.version, f.tensor, part, 0, 0, hosts)  # type: ignore
                w = self._whole(reader, seg) if here in hosts else None
                return None if w is None else np.frombuffer(w, dtype=np.uint8)

            if copy_out(offset, size, np.frombuffer(out, dtype=np.uint8, count=size), source):
                return (ctypes.c_char * size).from_buffer(out)
        if isinstance(f, VFile):
            spans = list(f.spans(offset, size))
            if len(spans) == 1:
                seg, at, n = spans[0]
                if isinstance(seg, StoreRange) and here in seg.hosts:
                    self._committed(reader, seg.job, seg.version)
                    views = list(reader.ranges(seg.job, seg.version, seg.tensor, seg.part,
                                               seg.offset + at, n))
                    if len(views) == 1:
                        return Span(views[0])
            out = self._buffer("buf", size)
            self._vfile(reader, spans, out, here)
        else:
            out = self._buffer("buf", size)
            self._array(reader, f, offset, size, out, here)
        return (ctypes.c_char * size).from_buffer(out)

    def pieces(self, f: File, offset: int, size: int) -> list[FileRange | bytes] | None:
        """The bytes ``[offset, offset + size)`` of ``f`` as a few pieces:
        ranges of the store's data file (sent on by the kernel, no copy here)
        and small literals. None when they are not all on this host in such
        a file (read with :meth:`read` instead). File ranges are valid until
        the next read on this thread."""
        if not isinstance(f, VFile):
            return None
        size = max(0, min(size, f.size - offset))
        with self._using():
            try:
                return self._pieces(self._reader(), f, offset, size)
            except FileNotFoundError:  # committed after this thread's snapshot: take a new one
                try:
                    return self._pieces(self._reader(renew=True), f, offset, size)
                except TensorNotFound:  # this host's copy went: read() asks the others
                    return None

    def _pieces(self, reader: Reader, f: VFile, offset: int, size: int
                ) -> list[FileRange | bytes] | None:
        out: list[FileRange | bytes] = []
        for seg, at, n in f.spans(offset, size):
            if isinstance(seg, Literal):
                out.append(bytes(seg.data[at:at + n]))
                continue
            if self.host not in seg.hosts:
                return None
            ext = self._extents(reader, seg)
            if ext is None:
                return None
            starts, runs = ext
            pos, end = seg.offset + at, seg.offset + at + n
            i = bisect.bisect_right(starts, pos) - 1
            while pos < end:
                if not 0 <= i < len(runs):
                    return None  # outside the entry: the read path says why
                run = runs[i]
                within = pos - starts[i]
                take = min(run.size - within, end - pos)
                if run.fd == ZERO_FD:  # a view's padding
                    out.append(bytes(take))
                else:
                    _add_range(out, run.fd, run.pos + within, take)
                pos += take
                i += 1
            if len(out) > MAX_PIECES:
                return None
        return out

    def _extents(self, reader: Reader, seg: StoreRange
                 ) -> tuple[list[int], list[FileRange]] | None:
        """Where a whole stored entry lies in the store's data file: looked up
        once for all threads and snapshots where the store says the entry
        stays in place (its placement token), else once per snapshot. Each
        read is then a bisection, not a walk through the store's chunks."""
        key = (seg.job, seg.version, seg.tensor, seg.part)
        self._committed(reader, seg.job, seg.version)
        known = self._tls.extents
        if key in known:
            self.tally.add("lookup_hits")
            return known[key]
        token = reader.placement(*key)
        found = self._placed.get(token) if token is not None else None
        self.tally.add("lookup_misses" if found is None else "lookup_hits")
        if found is None and token is not None:
            with self._locating:  # one thread looks, the others wait and share it
                found = self._placed.get(token)
                if found is None:
                    found = self._locate(reader, key)
                    if found is not None:
                        if len(self._placed) > 4096:
                            self._placed.clear()
                        self._placed[token] = found
        elif found is None:
            found = self._locate(reader, key)
        if len(known) > 4096:
            known.clear()
        known[key] = found
        return found

    @staticmethod
    def _locate(reader: Reader, key: tuple[str, int, str, str]
                ) -> tuple[list[int], list[FileRange]] | None:
        found = reader.file_ranges(*key)
        if found is None:
            return None
        starts: list[int] = []
        runs: list[FileRange] = []
        at = 0
        for fd, pos, size in found:
            before = len(runs)
            _add_range(runs, fd, pos, size)
            if len(runs) > before:  # a new run, not joined to the last
                starts.append(at)
            at += size
        return starts, runs

    def read_bytes(self, f: File, offset: int, size: int) -> bytes:
        """The same bytes as :meth:`read`, copied (for callers outside FUSE)."""
        got = self.read(f, offset, size)
        return got._keep.tobytes() if isinstance(got, Span) else bytes(memoryview(got).cast("B"))

    # --- internals --------------------------------------------------------------
    @contextmanager
    def _using(self) -> Iterator[None]:
        """Hold this thread's state while serving one read."""
        st = self._tls
        with st.lock:
            st.used = time.monotonic()
            yield

    def _sweep(self, now: float) -> None:
        """Drop the states of threads idle for IDLE_S (libfuse's threads come
        and go), closing their snapshots so the store can reuse pages."""
        for ident, st in list(self._states.items()):
            if now - st.used <= IDLE_S or not st.lock.acquire(blocking=False):
                continue
            try:
                if now - st.used > IDLE_S:
                    with self._states_lock:
                        if self._states.get(ident) is st:
                            del self._states[ident]
                    st.drop_reader()
            finally:
                st.lock.release()

    def _sweep_loop(self) -> None:
        while not self._closed.wait(IDLE_S / 2):
            self._sweep(time.monotonic())

    def close(self) -> None:
        """Close every thread's snapshot."""
        self._closed.set()
        if self._sweeper is not None:
            self._sweeper.join()
        with self._states_lock:
            states = list(self._states.values())
            self._states.clear()
        for st in states:
            with st.lock:
                st.drop_reader()

    def _committed(self, reader: Reader, job: str, version: int) -> None:
        """Refuse a version that this thread's snapshot holds but not as
        committed (VersionNotCommitted, a FileNotFoundError: the read takes a
        new snapshot and tries again). A snapshot taken while a save or a
        stage had that version number open would otherwise serve their
        staging bytes as the committed version's (a save aborted for a
        reconfiguration that took its number, for up to READER_RENEW_S)."""
        done = self._tls.committed
        if (job, version) not in done:
            reader.check_committed(job, version)
            done.add((job, version))

    def _reader(self, renew: bool = False) -> Reader:
        """This thread's snapshot, renewed after READER_RENEW_S (the last
        answer, which may point into the old one, has been copied by now)."""
        tls = self._tls
        now = time.monotonic()
        if tls.reader is None or renew or now - tls.opened > READER_RENEW_S:
            tls.drop_reader()
            tls.reader = self.store.reader().__enter__()
            tls.opened = now
        return tls.reader

    def _buffer(self, which: str, size: int) -> bytearray:
        buf = getattr(self._tls, which)
        if buf is None or len(buf) < size:
            buf = bytearray(max(size, 1 << 20))  # zero-filled: its pages are touched once
            setattr(self._tls, which, buf)
        return buf

    def _whole(self, reader: Reader, seg: StoreRange) -> memoryview | None:
        key = (seg.job, seg.version, seg.tensor, seg.part)
        self._committed(reader, seg.job, seg.version)
        whole = self._tls.whole
        if key not in whole:
            views = reader.ranges(*key)  # a strided view has thousands: look at two
            first, second = next(views, None), next(views, None)
            if len(whole) > 4096:
                whole.clear()
            whole[key] = first if first is not None and second is None else None
        return whole[key]

    def _vfile(self, reader: Reader, spans: list[tuple[Any, int, int]], out: bytearray,
               here: str | None) -> None:
        mv = memoryview(out)
        pos = 0
        for seg, at, n in spans:
            if isinstance(seg, Literal):
                mv[pos:pos + n] = seg.data[at:at + n]
            elif here in seg.hosts and (w := self._whole(reader, seg)) is not None:
                start = seg.offset + at
                mv[pos:pos + n] = w[start:start + n]
            elif here in seg.hosts:  # strided runs of a view: copied a piece at once
                self._committed(reader, seg.job, seg.version)
                reader.read_into(seg.job, seg.version, seg.tensor, seg.part, seg.offset + at,
                                 np.frombuffer(mv[pos:pos + n], dtype=np.uint8))
            else:
                self.remote.read_range(seg.hosts, seg.job, seg.version, seg.tensor,
                                       seg.part, seg.offset + at, n, mv[pos:pos + n])
            pos += n

    def _array(self, reader: Reader, f: ArrayFile, offset: int, size: int,
               out: bytearray, here: str | None) -> None:
        mv = memoryview(out)
        head = len(f.header)
        pos = 0
        if offset < head:
            n = min(head - offset, size)
            mv[:n] = f.header[offset:offset + n]
            pos, offset, size = n, offset + n, size - n
        if size == 0:
            return
        isz = f.itemsize
        first, last = (offset - head) // isz, -(-(offset + size - head) // isz)
        skip = offset - head - first * isz
        aligned = skip == 0 and (offset + size - head) % isz == 0
        cover = (last - first) * isz
        dst = mv[pos:pos + cover] if aligned else memoryview(self._buffer("scratch", cover))
        word = np.dtype(f"u{isz}") if isz in (1, 2, 4, 8) else np.dtype(f"V{isz}")
        at = 0
        for box in linear_boxes(f.extents, first, last):
            n = isz * math.prod(b - a for a, b in box)
            dest = np.frombuffer(dst[at:at + n], dtype=word).reshape([b - a for a, b in box])
            self._gather(reader, f, tuple((a + r0, b + r0) for (a, b), (r0, _)
                                          in zip(box, f.region)), dest, word, here)
            at += n
        if not aligned:
            mv[pos:pos + size] = dst[skip:skip + size]

    def _gather(self, reader: Reader, f: ArrayFile, want: Box, dest: np.ndarray,
                word: np.dtype, here: str | None) -> None:
        """Fill ``dest`` (the extents of ``want``) from the pieces of ``f``."""
        for p in f.pieces:
            inter = box_intersect(want, p.box)
            if inter is None:
                continue
            sub = dest[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(inter, want))]
            entry_box = tuple((s + a - p0, s + b - p0) for (a, b), (p0, _), s
                              in zip(inter, p.box, p.entry_start))
            key = (p.job, p.version, p.tensor, p.part)
            if here in p.hosts:
                self._committed(reader, p.job, p.version)
                copy_box(reader, key, p.entry_shape, f.itemsize, entry_box, sub)
                continue
            tmp = np.empty(sub.shape, dtype=word)
            self.remote.read_box(p.hosts, *key, entry_box, f.itemsize,
                                 tmp.reshape(-1).view(np.uint8).data)
            sub[...] = tmp

