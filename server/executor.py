"""One host's part of a reconfiguration: build its new sub-tensors.

Called by the daemon's ``stage`` operation (see :mod:`ptcfs.server.ops.reconfig`)
with this host's part of the plan (:class:`~ptcfs.plan.stagework.HostWork`): the
entries it must hold in the new version and the planner's transfers that
fill them. For each destination sub-tensor, in parallel:

1. each local region becomes a reference to the old version's entry
   (:class:`~ptcfs.store.views.ViewRef`): nothing is copied, the new entry
   shares those chunks (:meth:`~ptcfs.store.base.TensorStore.put_view`),
   unless it is strided in the new entry (a merge) in runs under
   :data:`MIN_VIEW_RUN` bytes, which are copied as in 3 (and every local
   region is copied with ``PTC_STAGE_VIEWS=0``, for comparisons);
2. when some region comes from another host (or is copied), take a buffer
   from the daemon's pool (:mod:`ptcfs.server.buffers`: kept from earlier
   stages, so its pages are touched already) and zero the rows no transfer
   writes (padding);
3. fetch each remote region from the peer that the plan names, as the
   contiguous bytes of the region's box, landing straight in the buffer
   (strided regions too); copy the small local ones out of the store.
   Regions under :data:`SMALL_FETCH` bytes (biases, norms, small shards)
   come many to a request instead (``FetchMany``, :data:`BATCH_BYTES` and
   :data:`BATCH_BOXES` at most), fetched just before the first entry that
   needs one of them, and copied from there: a request costs both daemons
   far more than a few KiB do (a tp=4 -> tp=2,dp=2 stage of the reshard
   bench's model asked 636 requests; 288 of them were under 1 MiB);
4. ``put_view`` the entry into the staging version (the store writes only
   the buffer's bytes outside the references; without a buffer the rest is
   zeros) and give the buffer back.

Entries made of views only (every entry of a reshard within hosts) take no
buffer and no thread: this thread puts them while the others build the
rest, :data:`VIEW_BATCH` to a store transaction (``put_views``), so such a
stage costs a few tens of microseconds per entry, whatever its bytes.

Nothing here commits: the coordinator commits on every host once all have
staged. Any failure raises (and stops the other sub-tensors at their next
transfer); the caller reports it and the coordinator aborts the staging
version everywhere.

Cancelling. The stage's :class:`CancelFlag` is looked at before each
transfer and each put, and wakes the fetches waiting on a peer (the
caller's ``fetch`` passes it on) and the ``PTC_STAGE_RATE`` pauses; every
put holds the flag's lock, so once :meth:`CancelFlag.cancel` returns no
put is under way and none will start: the version can be dropped.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ptcfs import settings
from ptcfs.boxes import box_index, contiguous_range
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import Cancelled, InvalidRequest
from ptcfs.plan.stagework import HostWork
from ptcfs.server.buffers import BufferPool
from ptcfs.store.base import Reader, TensorStore
from ptcfs.store.boxes import copy_box
from ptcfs.store.views import ViewEntry, ViewRef, box_runs
from ptcfs.types import Box, Entry, Transfer, box_volume

__all__ = ["StageResult", "THREADS", "execute", "copy_local", "Fetch", "CancelFlag",
           "zero_uncovered"]

#: (peer host, job, version, tensor, part, box, itemsize, out) → the box's bytes,
#: written in C order into ``out``: a writable array of the box's extents, any strides.
Fetch = Callable[[str, str, int, str, str, Box, int, np.ndarray], memoryview]
#: (peer host, job, version, [(tensor, part, box)], out): the boxes' C-order bytes,
#: one after another, written into ``out`` (a contiguous byte array of exactly them).
FetchMany = Callable[[str, str, int, list[tuple[str, str, Box]], np.ndarray], None]

#: Sub-tensors a host builds at once during a stage.
THREADS = 4
#: Sub-tensors smaller than this are built in buffers of their own, not the pool's.
POOLED_BYTES = 1 << 20
#: A local region whose contiguous runs are shorter than this is copied, not
#: referred to: a view keeps a few words per run.
MIN_VIEW_RUN = 256
#: Entries made of views only are put this many per store transaction.
VIEW_BATCH = 128
#: Remote regions under this many bytes are fetched many to a request ...
SMALL_FETCH = 1 << 20
#: ... of at most this many bytes and boxes (a sealed request's header is at
#: most 8 KiB: a box named takes some 100 bytes of it).
BATCH_BYTES = 8 << 20
BATCH_BOXES = 48


class CancelFlag:
    """A stage's cancel flag and the lock its puts hold (see the module docstring)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._writing = threading.Lock()

    def is_set(self) -> bool:
        return self.event.is_set()

    def check(self) -> None:
        """Cancelled if the flag is set."""
        if self.event.is_set():
            raise Cancelled("stage cancelled by abort")

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or raise Cancelled as soon as the flag is set."""
        if seconds > 0:
            self.event.wait(seconds)
        self.check()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the write lock, unless cancelled (then raise)."""
        with self._writing:
            self.check()
            yield

    def cancel(self) -> None:
        """Set the flag; return once no put holds the lock."""
        self.event.set()
        with self._writing:
            pass


class _Rate:
    """``PTC_STAGE_RATE``: pace the bytes copied and fetched (0: no pacing)."""

    def __init__(self, flag: CancelFlag):
        self.rate = int(settings.get("PTC_STAGE_RATE"))
        self.flag = flag
        self.free = time.monotonic()  # when the bytes allowed so far are spent
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            self.flag.check()
            return
        with self.lock:
            self.free = max(self.free, time.monotonic()) + nbytes / self.rate
            until = self.free
        self.flag.sleep(until - time.monotonic())


@dataclass
class StageResult:
    """What a host did while staging: bytes by source and time."""

    tensors: int = 0
    local_bytes: int = 0
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: of local_bytes, those shared with the old version instead of copied
    viewed_bytes: int = 0
    #: thread-seconds spent copying local regions, fetching remote ones and
    #: putting the built sub-tensors into the store
    seconds: dict[str, float] = field(
        default_factory=lambda: {"copy": 0.0, "fetch": 0.0, "put": 0.0})


class _Batch:
    """Small regions from one peer (transfers with their bytes), fetched in
    one request (``future``); its bytes are let go once every region has
    been taken."""

    def __init__(self, peer: str, transfers: list[tuple[Transfer, int]]):
        self.peer = peer
        self.transfers = transfers
        self.future: Future[None] | None = None
        self.data: np.ndarray | None = None
        self._left = len(transfers)
        self._lock = threading.Lock()

    def take(self, at: int, nbytes: int) -> np.ndarray:
        """Bytes ``[at, at + nbytes)`` of the batch, once fetched (the fetch's
        failure is raised here too)."""
        assert self.future is not None
        self.future.result()
        assert self.data is not None
        out = self.data[at:at + nbytes]
        with self._lock:
            self._left -= 1
            if not self._left:
                self.data = None  # the slices taken keep what they need
        return out


def _batches(transfers: list[tuple[Transfer, int]]
             ) -> Iterator[tuple[str, list[tuple[Transfer, int]]]]:
    """``transfers`` (with their bytes) by source host, cut into batches of
    at most :data:`BATCH_BYTES` bytes and :data:`BATCH_BOXES` boxes."""
    by_peer: dict[str, list[tuple[Transfer, int]]] = defaultdict(list)
    for t, n in transfers:
        by_peer[t.src.host].append((t, n))
    for peer, ts in by_peer.items():
        batch: list[tuple[Transfer, int]] = []
        size = 0
        for t, n in ts:
            if batch and (size + n > BATCH_BYTES or len(batch) == BATCH_BOXES):
                yield peer, batch
                batch, size = [], 0
            batch.append((t, n))
            size += n
        if batch:
            yield peer, batch


def copy_local(store: TensorStore, job: str, version: int, tensor: str, part: str,
               box: Box, target: np.ndarray) -> None:
    """Copy the region ``box`` of a stored sub-tensor into ``target``: one
    strided copy per store chunk, straight from the store's memory."""
    with store.reader() as r:
        info = r.info(job, version, tensor, part)
        copy_box(r, (job, version, tensor, part), info.shape, target.itemsize, box, target)


def zero_uncovered(arr: np.ndarray, boxes: Sequence[Box]) -> None:
    """Zero the elements of ``arr`` that none of ``boxes`` (disjoint) covers:
    only the uncovered rows when every box spans all but the first
    dimension (padding rows of a vocabulary), else the whole array."""
    if sum(box_volume(b) for b in boxes) >= arr.size:
        return
    rest = arr.shape[1:]
    if arr.ndim == 0 or not all(all(a == 0 and b == n for (a, b), n in zip(box[1:], rest))
                                for box in boxes):
        arr.fill(0)
        return
    row = 0
    for a, b in sorted(box[0] for box in boxes):
        if a > row:
            arr[row:a] = 0
        row = max(row, b)
    if row < arr.shape[0]:
        arr[row:] = 0


def execute(
    store: TensorStore,
    host: str,
    job: str,
    old_version: int,
    new_version: int,
    work: HostWork,
    fetch: Fetch,
    threads: int = THREADS,
    progress: Callable[[int], None] | None = None,
    pool: BufferPool | None = None,
    cancel: CancelFlag | None = None,
    fetch_many: FetchMany | None = None,
) -> StageResult:
    """Build and put every entry of ``work`` (this host's part of the plan),
    in buffers from ``pool`` (default: buffers of its own, kept by nobody),
    until ``cancel`` is set (then Cancelled). The first failure sets
    ``cancel`` too, so that the other sub-tensors stop, and is raised.
    With ``fetch_many``, small remote regions are fetched many to a request."""
    by_dst: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in work.transfers:
        by_dst[(t.dst.tensor, t.dst.slice.key())].append(t)
    known = {(e.tensor, e.slice.key()) for e in work.entries}
    stray = [k for k in by_dst if k not in known]
    if stray:
        raise InvalidRequest(f"transfers into sub-tensors this host was not asked to hold: "
                             f"{stray[:3]}")
    result = StageResult()
    lock = threading.Lock()
    buffers = pool if pool is not None else BufferPool(0)
    flag = cancel if cancel is not None else CancelFlag()
    pace = _Rate(flag)
    views = bool(settings.get("PTC_STAGE_VIEWS"))
    first: list[BaseException] = []  # the first failure, not a Cancelled that followed it

    def buffer(e: Entry, moves: list[Transfer]) -> tuple[np.ndarray, np.ndarray | None]:
        """The array to build ``e`` in, and the pooled buffer under it."""
        dt = numpy_dtype(e.dtype)
        n = int(np.prod(e.shape, dtype=np.int64)) * dt.itemsize
        buf = buffers.take(n) if n >= POOLED_BYTES else None
        raw = buf if buf is not None else np.empty(max(n, 1), dtype=np.uint8)
        arr = raw[:n].view(dt).reshape(e.shape)
        zero_uncovered(arr, [t.dst.box for t in moves])
        return arr, buf

    def failed(exc: BaseException) -> None:
        with lock:
            if not first and not isinstance(exc, Cancelled):
                first.append(exc)
        flag.event.set()

    def build(e: Entry, refs: list[ViewRef], copied: list[Transfer]) -> None:
        try:
            flag.check()
            t0 = time.perf_counter()
            arr, buf = buffer(e, by_dst[(e.tensor, e.slice.key())])
            try:
                fill(e, arr, refs, copied, t0)
            finally:
                if buf is not None:
                    buffers.give(buf)
        except BaseException as exc:
            failed(exc)
            raise

    def split(e: Entry, r: Reader | None) -> tuple[list[ViewRef], list[Transfer]]:
        """The regions of ``e`` that become views, and those copied or fetched."""
        refs, copied = [], []
        for t in by_dst[(e.tensor, e.slice.key())]:
            if views and t.src.host == host and viewable(t, e, r):
                refs.append(ViewRef(t.dst.box, old_version, t.src.tensor, t.src.slice.key(),
                                    t.src.box))
            else:
                copied.append(t)
        return refs, copied

    def viewable(t: Transfer, e: Entry, r: Reader | None) -> bool:
        """Whether a local region is referred to rather than copied: when it
        is one stretch of the new entry (its runs in the old entry make a
        strided piece or a few), or its runs are long."""
        itemsize = numpy_dtype(e.dtype).itemsize
        if box_volume(t.dst.box) == 0 or contiguous_range(t.dst.box, e.shape, itemsize):
            return True
        if r is None:
            return False
        src = r.info(job, old_version, t.src.tensor, t.src.slice.key())
        return box_runs(e.shape, t.dst.box, src.shape, t.src.box, itemsize)[2] >= MIN_VIEW_RUN

    def put_views(batch: list[tuple[Entry, list[ViewRef]]]) -> None:
        """Entries made of views only, many per store transaction."""
        itemsize = {e.dtype: numpy_dtype(e.dtype).itemsize for e, _ in batch}
        for at in range(0, len(batch), VIEW_BATCH):
            flag.check()
            some = batch[at:at + VIEW_BATCH]
            t0 = time.perf_counter()
            with flag.writing():
                store.put_views(job, new_version, [
                    ViewEntry(e.tensor, e.slice.key(), e.shape, e.dtype, tuple(refs))
                    for e, refs in some])
            nbytes = sum(box_volume(ref.dst) * itemsize[e.dtype] for e, refs in some
                         for ref in refs)
            with lock:
                result.seconds["put"] += time.perf_counter() - t0
                result.tensors += len(some)
                result.local_bytes += nbytes
                result.viewed_bytes += nbytes
            if progress is not None:
                progress(nbytes)

    def fill(e: Entry, arr: np.ndarray | None, refs: list[ViewRef], copied: list[Transfer],
             t0: float) -> None:
        """Copy and fetch the regions ``copied`` into ``arr``, then put ``e``
        as a view of ``refs`` and the rest of ``arr``."""
        itemsize = numpy_dtype(e.dtype).itemsize
        viewed = sum(box_volume(ref.dst) for ref in refs) * itemsize
        local = viewed
        received: dict[str, int] = defaultdict(int)
        spent = {"copy": time.perf_counter() - t0, "fetch": 0.0}
        part = e.slice.key()
        for t in copied:
            if arr is None:
                raise InvalidRequest("a copied region needs a buffer")
            early = fetched.get(id(t))
            if early is None:
                pace.take(box_volume(t.dst.box) * itemsize)
            t0 = time.perf_counter()
            target = arr[box_index(t.dst.box)]
            src = t.src
            if src.host == host:
                copy_local(store, job, old_version, src.tensor, src.slice.key(), src.box, target)
                local += target.nbytes
                spent["copy"] += time.perf_counter() - t0
                continue
            if early is not None:
                batch, at = early
                target[...] = batch.take(at, target.nbytes).view(
                    target.dtype).reshape(target.shape)
            else:
                fetch(src.host, job, old_version, src.tensor, src.slice.key(), src.box,
                      arr.itemsize, target)
            received[src.host] += target.nbytes
            spent["fetch"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        with flag.writing():
            store.put_view(job, new_version, e.tensor, part, e.shape, e.dtype, refs, arr)
        spent["put"] = time.perf_counter() - t0
        with lock:
            for k, v in spent.items():
                result.seconds[k] += v
            result.tensors += 1
            result.local_bytes += local
            result.viewed_bytes += viewed
            for k, v in received.items():
                result.received[k] += v
        if progress is not None:
            progress(local + sum(received.values()))

    def fetch_batch(batch: _Batch) -> None:
        try:
            assert fetch_many is not None
            out = np.empty(sum(n for _, n in batch.transfers), dtype=np.uint8)
            pace.take(out.nbytes)
            fetch_many(batch.peer, job, old_version, [
                (t.src.tensor, t.src.slice.key(), t.src.box) for t, _ in batch.transfers], out)
            batch.data = out
        except BaseException as exc:
            failed(exc)
            raise

    t0 = time.perf_counter()
    with store.reader() as r:
        split_up = [(e, *split(e, r if views else None)) for e in work.entries]
    result.seconds["copy"] += time.perf_counter() - t0
    only_views = [(e, refs) for e, refs, copied in split_up if not copied]
    # largest first, so that the threads finish together
    order = sorted(((e, refs, copied) for e, refs, copied in split_up if copied),
                   key=lambda x: -int(np.prod(x[0].shape)))
    # transfer (by id) → (the batch that brings it, where its bytes begin there)
    fetched: dict[int, tuple[_Batch, int]] = {}
    if fetch_many is not None:
        small = [(t, n) for e, _, copied in order for t in copied if t.src.host != host
                 and (n := box_volume(t.dst.box) * numpy_dtype(e.dtype).itemsize) < SMALL_FETCH]
        for peer, ts in _batches(small):
            batch = _Batch(peer, ts)
            for (t, _), at in zip(ts, itertools.accumulate([0] + [n for _, n in ts])):
                fetched[id(t)] = (batch, at)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as workers:
        futures: list[Future[Any]] = []
        for x in order:
            # a batch goes just before the first build that waits on it: the pool
            # starts it first, and its bytes are not held long
            for t in x[2]:
                due = fetched[id(t)][0] if id(t) in fetched else None
                if due is not None and due.future is None:
                    due.future = workers.submit(fetch_batch, due)
                    futures.append(due.future)
            futures.append(workers.submit(build, *x))
        try:
            put_views(only_views)  # meanwhile, in this thread
        except BaseException as exc:
            failed(exc)
        for f in futures:
            if f.exception() is not None:
                break
    if first:
        raise first[0]
    flag.check()
    for f in futures:
        f.result()  # a Cancelled that raced the flag's check
    return result
