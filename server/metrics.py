"""Prometheus metrics of one ``ptcd``: what it served and fetched, how long
its stages and commits took, its store's size and room, its mount's reads,
and the errors it answered.

Each daemon has its own :class:`DaemonMetrics` (its own
``CollectorRegistry``, never the process-wide one, so that several daemons
in one process do not clash). Most figures are read at scrape time from
what the daemon counts anyway (:meth:`Daemon.counters`, the store's
``stats``, the mount's ``mount.json``); only durations and errors are
recorded here as they happen.

Call order: the daemon makes its ``DaemonMetrics`` at start (always: the
histograms cost nothing unscraped); :meth:`DaemonMetrics.serve` starts the
HTTP endpoint ``/metrics`` when a port is set (``ptcd --metrics-port``, else
``PTC_METRICS_PORT``; 0 is off), and :meth:`DaemonMetrics.close` stops it
when the daemon closes.

Metric names (``host`` is a label of every one):

- ``ptcd_peer_sent_bytes_total{peer}``: payload bytes served to ``peer``
- ``ptcd_peer_received_bytes_total{peer}``: payload bytes received from
  ``peer`` (what its requests carried, and what this daemon fetched from it)
- ``ptcd_stage_seconds``: histogram of this host's stages that ended well
- ``ptcd_commit_seconds``: histogram of this host's commits of a version
- ``ptcd_requests_total{op}``: requests served, by operation
- ``ptcd_errors_total{kind}``: requests answered with an error, by its class
- ``ptcd_store_used_bytes``, ``ptcd_store_stored_bytes``,
  ``ptcd_store_room_bytes`` (pages made ready past the last used one),
  ``ptcd_store_free_bytes`` (what more fits: the map's and the
  filesystem's room, the smaller), ``ptcd_store_versions``
- ``ptcd_mount_opens_total{path}``: files opened through the page cache
  (``cache``: later reads of cached pages never reach the mount) or
  straight (``direct``)
- ``ptcd_mount_reads_total{source}``, ``ptcd_mount_read_bytes_total{source}``:
  reads the mount answered, by file range of the store (``splice``) or by
  copy (``copy``)
- ``ptcd_mount_lookup_hits_total``, ``ptcd_mount_lookup_misses_total``:
  reads that found where their bytes lie in the mount's cache of store
  extents, or had to look it up
- ``ptcd_mount_cached_bytes``: bytes the mount read into the page cache
  in the background

The mount's figures come from its ``mount.json``, which it rewrites at
most once a second while they change.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ptcfs.errors import PtcError
from ptcfs.fuse.warming import read_status
from ptcfs.server.net.cluster import HostSpec
from ptcfs.store.base import TensorStore


class Daemon(Protocol):
    """What the metrics read of a daemon (:class:`ptcfs.server.daemon.Daemon`
    is one); a protocol, so that this module does not import the daemon's."""

    @property
    def host_id(self) -> str: ...
    @property
    def host(self) -> HostSpec: ...
    @property
    def store(self) -> TensorStore: ...

    def counters(self) -> dict[str, dict[str, int]]: ...

__all__ = ["DaemonMetrics", "metrics_address"]

log = logging.getLogger("ptcd.metrics")

#: Buckets of the stage and commit histograms, in seconds.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0)


def metrics_address(bind: str) -> str:
    """The IP the metrics endpoint binds: that of the daemon's ZeroMQ
    address (``tcp://HOST:PORT``), all of them for ``*``."""
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host in ("*", "") else host


class DaemonMetrics:
    """The metrics of one daemon (see the module docstring)."""

    def __init__(self, daemon: Daemon):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"host": daemon.host_id}
        self.stage_seconds = Histogram(
            "ptcd_stage_seconds", "Seconds a stage of a new version took on this host "
            "(stages that ended well)", registry=self.registry,
            buckets=BUCKETS, labelnames=("host",)).labels(**labels)
        self.commit_seconds = Histogram(
            "ptcd_commit_seconds", "Seconds a commit of a version took on this host",
            registry=self.registry, buckets=BUCKETS, labelnames=("host",)).labels(**labels)
        self._errors = Counter("ptcd_errors", "Requests answered with an error, by its class",
                               labelnames=("host", "kind"), registry=self.registry)
        self._requests = Counter("ptcd_requests", "Requests served, by operation",
                                 labelnames=("host", "op"), registry=self.registry)
        self.host = daemon.host_id
        self.registry.register(_Figures(daemon))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def request(self, op: str) -> None:
        """Count a request of a known operation."""
        self._requests.labels(host=self.host, op=op).inc()

    def error(self, e: BaseException) -> None:
        """Count an error answered to a request (``internal`` for a bug)."""
        kind = type(e).__name__ if isinstance(e, PtcError) else "internal"
        self._errors.labels(host=self.host, kind=kind).inc()

    def serve(self, port: int, address: str) -> None:
        """Serve ``/metrics`` on ``address:port`` in a thread (port 0: don't)."""
        if not port:
            return
        try:
            self._server, self._thread = start_http_server(port, addr=address,
                                                           registry=self.registry)
        except OSError as e:
            raise PtcError(f"cannot serve metrics on {address}:{port}: {e}") from e
        self.port = port
        log.info("metrics at http://%s:%d/metrics", address, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _Figures(Collector):
    """What the daemon, its store and its mount count anyway, read at scrape time."""

    def __init__(self, daemon: Daemon):
        self.d = daemon

    def describe(self) -> list[Metric]:
        return []  # made at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        host = self.d.host_id
        sent = CounterMetricFamily("ptcd_peer_sent_bytes", "Payload bytes served to a peer",
                                   labels=("host", "peer"))
        received = CounterMetricFamily(
            "ptcd_peer_received_bytes", "Payload bytes received from a peer (its requests' "
            "payload and what this daemon fetched from it)", labels=("host", "peer"))
        for peer, c in self.d.counters().items():
            sent.add_metric([host, peer], c["sent"])
            received.add_metric([host, peer], c["received"])
        yield sent
        yield received
        yield from self._store(host)
        yield from self._mount(host)

    def _store(self, host: str) -> Iterator[Metric]:
        try:
            st = self.d.store.stats()
            fs = os.statvfs(st["path"])
        except (PtcError, OSError) as e:
            log.warning("metrics: cannot read the store's figures: %s", e)
            return
        free = min(st["map_size"] - st["bytes_used"], fs.f_bavail * fs.f_frsize
                   + st["room_bytes"])
        for name, value, doc in (
                ("used", st["bytes_used"], "Bytes of the store's data file in use"),
                ("stored", st["stored_bytes"], "Bytes of tensor data the store holds"),
                ("room", st["room_bytes"], "Bytes of pages made ready past the last one in use "
                 "(for the next version)"),
                ("free", max(free, 0), "Bytes more the store can take (the smaller of its "
                 "map's room and its filesystem's)")):
            if value is not None:  # None: a data file cut short, whose trees are not read
                yield _gauge(f"ptcd_store_{name}_bytes", doc, host, value)
        if st["versions"] is not None:
            yield _gauge("ptcd_store_versions", "Versions the store holds, of every job", host,
                         st["versions"])

    def _mount(self, host: str) -> Iterator[Metric]:
        status = read_status(self.d.host.store)
        if status is None:
            return
        c = status.get("counters") or {}
        opens = CounterMetricFamily("ptcd_mount_opens", "Files opened through the mount, "
                                    "through the page cache or straight", labels=("host", "path"))
        reads = CounterMetricFamily("ptcd_mount_reads", "Reads the mount answered, by file "
                                    "range of the store (splice) or by copy",
                                    labels=("host", "source"))
        nbytes = CounterMetricFamily("ptcd_mount_read_bytes", "Bytes the mount answered, by "
                                     "file range of the store (splice) or by copy",
                                     labels=("host", "source"))
        for path in ("cache", "direct"):
            opens.add_metric([host, path], c.get(f"opens_{path}", 0))
        for source in ("splice", "copy"):
            reads.add_metric([host, source], c.get(f"reads_{source}", 0))
            nbytes.add_metric([host, source], c.get(f"read_bytes_{source}", 0))
        yield from (opens, reads, nbytes)
        for what in ("hits", "misses"):
            m = CounterMetricFamily(f"ptcd_mount_lookup_{what}", "Reads that found where "
                                    "their bytes lie in the mount's cache of store extents "
                                    "(hits) or looked it up (misses)", labels=("host",))
            m.add_metric([host], c.get(f"lookup_{what}", 0))
            yield m
        yield _gauge("ptcd_mount_cached_bytes", "Bytes the mount read into the page cache in "
                     "the background", host, status.get("cached_bytes", 0))


def _gauge(name: str, doc: str, host: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=("host",))
    g.add_metric([host], value)
    return g
