"""Ingest: a checked :class:`~ptcfs.data.source.Source` into the stores.

The call order (one ingest; ``sink`` is the cluster, or one store in tests):

1. ``plan_chunks``: samples are cut, in ingest order, into chunks of whole
   samples of about ``chunk_bytes``; chunk ``i`` goes to ``replicas``
   hosts of the ring, starting at host ``i mod n``.
2. ``sink.begin(version, meta)`` on every host: a staging version of
   ``<job>@data`` with the dataset record as metadata.
3. ``sink.put`` each chunk to its holders (``inflight`` chunks read and
   sent at once), then the per-sample index (``offsets``, ``tokens``, and
   the format's own entries) to every host.
4. ``sink.commit(version, meta)`` on every host.

Any failure in 2–4 (bad input found while reading, a host that fails, an
interrupt) aborts the staging version on every host and re-raises: a
failed ingest leaves nothing behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np

from ptcfs import settings
from ptcfs.data.record import (
    CHUNK_TENSOR,
    INDEX_TENSOR,
    Chunk,
    DatasetRecord,
    Position,
    check_position,
    check_settings,
    chunk_part,
)
from ptcfs.data.source import Source, SourceInfo
from ptcfs.errors import BadDataset, InvalidRequest
from ptcfs.jobstate import check_job_name

__all__ = ["Sink", "plan_chunks", "index_entries", "ingest"]


class Sink(Protocol):
    """Where an ingest writes (every method but ``abort`` raises on failure)."""

    ring: list[str]  # every host, in the cluster's order
    replicas: int

    def next_version(self) -> int:
        """A version number of ``<job>@data`` never used on any host."""

    def begin(self, version: int, meta: dict[str, Any]) -> None:
        """Stage ``version`` with ``meta`` on every host."""

    def put(self, hosts: tuple[str, ...], version: int, tensor: str, part: str,
            data: np.ndarray) -> None:
        """Store one entry (flat uint8 or typed array) on ``hosts``."""

    def commit(self, version: int, meta: dict[str, Any]) -> None:
        """Commit ``version`` on every host."""

    def abort(self, version: int) -> None:
        """Drop ``version`` on every host that answers; never raises."""


def plan_chunks(sizes: np.ndarray, chunk_bytes: int, ring: list[str],
                replicas: int) -> tuple[Chunk, ...]:
    """Whole-sample chunks of at most ``chunk_bytes`` (at least one sample
    each) and their holders on the ring."""
    if chunk_bytes < 1:
        raise InvalidRequest(f"chunk_bytes must be at least 1, not {chunk_bytes}")
    if not ring:
        raise InvalidRequest("no hosts to store the dataset on")
    copies = max(1, min(replicas, len(ring)))
    ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
    chunks: list[Chunk] = []
    first, base = 0, 0
    while first < len(ends):
        stop = int(np.searchsorted(ends, base + chunk_bytes, side="right"))
        stop = max(stop, first + 1)
        i = len(chunks)
        chunks.append(Chunk(first, stop, tuple(ring[(i + k) % len(ring)]
                                               for k in range(copies))))
        first, base = stop, int(ends[stop - 1])
    return tuple(chunks)


def index_entries(info: SourceInfo) -> dict[str, np.ndarray]:
    """The per-sample index every host keeps: byte offsets of each sample in
    the chunks laid end to end, token counts, and the format's entries."""
    offsets = np.zeros(info.count + 1, dtype=np.int64)
    np.cumsum(info.sizes, out=offsets[1:])
    out = {"offsets": offsets, **info.extra}
    if info.tokens is not None:
        out["tokens"] = np.asarray(info.tokens, dtype=np.int64)
    return out


def ingest(source: Source, sink: Sink, job: str, *, seed: int, global_batch: int,
           balance: str = "samples", step: int = 0, dp: int = 1,
           chunk_bytes: int | None = None, inflight: int | None = None,
           progress: Callable[[int], None] | None = None,
           access: dict[str, Any] | None = None) -> DatasetRecord:
    """Store ``source`` as ``job``'s dataset (see the module docstring) and
    return its committed record. ``progress(nbytes)`` as chunks land;
    ``access``: the record's (:class:`DatasetRecord`)."""
    check_job_name(job)
    info = source.info
    if info.count == 0:
        raise BadDataset(f"{info.path}: the dataset has no samples; nothing to ingest")
    check_settings(global_batch, seed, balance, info.tokens is not None, info.format)
    check_position(step, dp)
    chunks = plan_chunks(info.sizes, settings.get("PTC_DATA_CHUNK_BYTES", chunk_bytes), sink.ring,
                         sink.replicas)
    version = sink.next_version()
    rec = DatasetRecord(job=job, format=info.format, count=info.count, nbytes=info.nbytes,
                        seed=seed, global_batch=global_batch, balance=balance,
                        base_version=version, chunks=chunks, position=Position(step, dp),
                        version=version, dtype=info.dtype, sample_shape=info.sample_shape,
                        has_tokens=info.tokens is not None, source=info.path,
                        access=dict(access or {}))
    meta = rec.to_meta()
    sink.begin(version, meta)
    try:
        _put_chunks(source, sink, version, chunks,
                    settings.get("PTC_DATA_INGEST_INFLIGHT", inflight), progress)
        everyone = tuple(sink.ring)
        for name, arr in index_entries(info).items():
            sink.put(everyone, version, INDEX_TENSOR, name, arr)
        sink.commit(version, meta)
    except BaseException:
        sink.abort(version)
        raise
    return rec


def _put_chunks(source: Source, sink: Sink, version: int, chunks: tuple[Chunk, ...],
                inflight: int, progress: Callable[[int], None] | None) -> None:
    lock = threading.Lock()
    failed = threading.Event()

    def one(i: int, c: Chunk) -> None:
        if failed.is_set():
            return
        data = np.frombuffer(source.read(c.first, c.stop), dtype=np.uint8)
        sink.put(c.hosts, version, CHUNK_TENSOR, chunk_part(i), data)
        if progress is not None:
            with lock:
                progress(data.nbytes * len(c.hosts))

    with ThreadPoolExecutor(max_workers=max(1, inflight)) as pool:
        pending: set[Future[None]] = set()
        try:
            for i, c in enumerate(chunks):
                if len(pending) >= inflight:
                    done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for f in done:
                        f.result()
                pending.add(pool.submit(one, i, c))
            for f in pending:
                f.result()
        except BaseException:
            failed.set()
            raise
