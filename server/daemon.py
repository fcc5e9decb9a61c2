"""``ptcd``: the per-host daemon that owns a host's tensor store.

Threads. The main thread owns the ROUTER socket (ZeroMQ sockets are not
thread-safe): it reads requests, hands each to a pool of ``PTC_DAEMON_WORKERS``
threads, and sends the replies they queue (a pipe wakes it). A worker busy
with a large read, a put or a ``stage`` never stops the small requests of
others: they go to the next free worker. A ``ping`` the main thread
answers itself, at once, so that a daemon busy with big requests still
shows it is alive (the liveness pings of :class:`PeerClient`).

Operations. Handlers are plain functions registered with :func:`daemon_op`
in the modules of ``OP_MODULES`` (imported when a Daemon is made)::

    @daemon_op("stage")
    def stage(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
        job = arg(req, "job", str)          # ptcfs.server.ops.common.arg checks types
        ...
        return {"started": True}, []        # (msgpack result, payload buffers)

``req.args`` is the header's ``args`` map, ``req.frames`` the payload frames,
``req.caller`` the caller's host id. A handler raises ptcfs errors; the
caller gets them as error replies of the same class. Payload buffers borrowed
from a store reader stay valid because the handler opens the reader with
``req.hold(store.reader())``: the worker sends them zero-copy and closes the
reader only once ZeroMQ has finished with them.

Reads are chunked by the client: a ``read`` reply carries at most
``wire.MAX_PAYLOAD`` bytes, and :meth:`PeerClient.read_into` asks for a big
range as a few pipelined requests with offsets.

Counters. Every payload byte a request brings is counted as ``received``
from its caller, every payload byte of a reply as ``sent`` to it; ops that
fetch from peers count what they fetch with :meth:`Daemon.count`.

Room. At start, and when asked (``make_room``: the coordinator asks once a
job's new version is committed and the old ones are deleted), a background
thread has the store make room for a version as big as the largest this
host holds (:meth:`LmdbStore.make_room`), and touches staging buffers as
big as the biggest tensors a next version may give it (its models' whole
tensors; :mod:`ptcfs.server.buffers`), pausing
while a stage runs, so that the next reconfiguration writes into pages the
store and the process have already (``PTC_STORE_ROOM=0`` turns both off).
``health`` says whether it is at work.

Background tasks. Functions registered with :func:`daemon_task` (the
registry's reconciler, :mod:`ptcfs.server.ops.registry`) run each in a
thread from bind to close; they end when :attr:`Daemon.closing` is set.

Keys. With CurveZMQ keys, each request carries the name of the key that
sent it (``req.key``); before its handler runs, :class:`~ptcfs.server.auth.Authorizer`
refuses a change to a job from a client key that is not among the job's
writers, and every changing request, answered or refused, goes to the audit
trail (:mod:`ptcfs.server.audit`).

Registry. The daemon joins the cluster's registry (:mod:`ptcfs.server.net.registry`)
once bound and leaves it at close; a peer it does not know yet (a host that
joined later) is looked up there.

Metrics. With a port (``--metrics-port``, else ``PTC_METRICS_PORT``) the
daemon serves Prometheus metrics at ``/metrics`` (:mod:`ptcfs.server.metrics`).

Order of life: open the store, bind, serve metrics, join the registry, start the workers
and background tasks, write the ready file. SIGTERM or SIGINT: stop reading
requests, drop unsent replies, let the workers finish, leave the registry,
close peers and sockets, close the store, remove the ready file, exit 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ptcfs import settings
from ptcfs.errors import (
    EXIT_FAILED,
    InvalidConfig,
    InvalidRequest,
    NoSession,
    Overloaded,
    PtcError,
    StoreDamaged,
    exit_code,
)
from ptcfs.server.audit import AuditLog
from ptcfs.server.auth import CHANGES, Authorizer, KeyAuthenticator, caller_key, job_of
from ptcfs.server.buffers import BufferPool, whole_sizes
from ptcfs.server.executor import POOLED_BYTES
from ptcfs.server.executor import THREADS as STAGE_THREADS
from ptcfs.server.metrics import DaemonMetrics, metrics_address
from ptcfs.server.net.cluster import ClusterSpec, HostSpec, load_cluster
from ptcfs.server.net.keys import CurveKeys, load_keys
from ptcfs.server.net.peer import PeerClient
from ptcfs.server.net.registry import load_decisions, open_registry, resolve
from ptcfs.server.net.sealed import (
    BULK_OPS,
    MAX_SEALED_REQUEST,
    NO_SESSION,
    Session,
    Sessions,
    sealing,
)
from ptcfs.server.net.wire import (
    FRAME_OVERHEAD,
    Request,
    check_size,
    decode_request,
    encode_reply,
    max_frame,
)
from ptcfs.server.ops.common import OP_MODULES, OPS, TASKS
from ptcfs.server.pins import Pins
from ptcfs.store.integrity import fresh_store
from ptcfs.store.lmdb_store import LmdbStore, keep_heap

__all__ = ["Daemon", "main"]

log = logging.getLogger("ptcd")

#: Requests read but not yet answered; beyond it the daemon stops reading
#: and ZeroMQ's high-water marks push back on the callers.
MAX_INFLIGHT = 256
#: Whole requests ZeroMQ queues per connection before the daemon reads them
#: (ZMQ_RCVHWM; beyond it the connection is not read, and TCP pushes back).
RECV_HWM = 8
#: Payload buffers at least this big go out zero-copy; smaller ones are copied.
ZERO_COPY_MIN = 64 << 10
#: A request whose header is at most this big and carries no payload may
#: be a ``ping``, which the I/O thread answers itself (see :meth:`Daemon._ping_now`).
PING_MAX_HEADER = 256
_PING_OP = b"\xa4ping"  # "ping" as msgpack writes it: read no other header twice


class Daemon:
    """One host's daemon: its store, its socket, its peers.

    Call order: ``Daemon(cluster, host_id)`` opens the store;
    :meth:`serve` binds and serves until :meth:`stop` (from a signal handler
    or another thread), then closes everything.
    """

    def __init__(self, cluster: ClusterSpec, host_id: str, bind: str | None = None,
                 host: HostSpec | None = None, metrics_port: int | None = None):
        self.cluster = cluster
        cluster.check_secure()
        #: this host: ``host`` (from ptcd's flags, to join a registry), else the file's
        self.host = host or cluster.host(host_id)
        self.host_id = host_id
        self.bind_address = bind or self.host.address
        #: worker threads (``PTC_DAEMON_WORKERS``)
        self.workers = int(settings.get("PTC_DAEMON_WORKERS"))
        self.keys: CurveKeys | None = load_keys(cluster.curve_dir, daemon=True) \
            if cluster.curve_dir else None
        for mod in OP_MODULES:
            importlib.import_module(mod)
        try:
            self.store = LmdbStore(self.host.store)
        except StoreDamaged as e:
            raise StoreDamaged(f"{e}: its copies are lost. Start ptcd with --fresh-store to set "
                               "the file aside and start empty; `ptcctl repair JOB` (or the "
                               "registry's self-healing) then restores them from peers") from None
        #: jobs the scrubber quarantined entries of, not yet repaired (ops.scrub)
        self.scrub_jobs: set[str] = set()
        #: checks each request's key against the job it changes (None: no keys)
        self.authorizer = (Authorizer(self.store, self.keys.public_dir.parent)
                           if self.keys is not None else None)
        #: every changing request, per job (:mod:`ptcfs.server.audit`)
        self.audit = AuditLog(host_id, Path(self.host.store) / "audit.jsonl")
        self.registry = open_registry(cluster, self.keys)
        self.locks: dict[str, tuple[str, float]] = {}  # job → (holder, monotonic expiry)
        self.decisions = load_decisions(self.host.store)  # job → the last decision
        self.decisions_lock = threading.Lock()
        self.started = time.time()
        self.boot = os.urandom(8).hex()  # tells this start of the daemon from others
        self.up_since = time.monotonic()
        self.sent: dict[str, int] = defaultdict(int)  # payload bytes sent, by peer
        self.received: dict[str, int] = defaultdict(int)  # payload bytes received, by peer
        self.stages: dict[tuple[str, int], Any] = {}  # (job, version) → ops_reconfig.StageJob
        self.buffers = BufferPool()  # staging buffers, kept between stages
        self.pins = Pins()  # versions open on this host's mounts
        #: sessions of the sealed channel, and its socket's port (None: no such socket)
        self.sessions = Sessions()
        self.bulk_port: int | None = None
        #: Prometheus metrics, served on this port when it is not 0 (PTC_METRICS_PORT)
        self.metrics = DaemonMetrics(self)
        self.metrics_port = int(settings.get("PTC_METRICS_PORT", metrics_port))
        self._lock = threading.Lock()
        self._peers: dict[str, PeerClient] = {}
        self._stop = threading.Event()
        self._closing = threading.Event()
        # replies to send: (sealed socket?, frames)
        self._replies: queue.SimpleQueue[tuple[bool, list[Any]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._room_due = threading.Event()
        self._room_busy = False
        self._held: dict[bytes, int] = defaultdict(int)  # request bytes held, by connection
        self._held_total = 0

    # --- room in the store ---------------------------------------------------------
    def want_room(self) -> None:
        """Have the store make room for the next version, in the background."""
        if settings.get("PTC_STORE_ROOM"):
            self._room_due.set()

    @property
    def making_room(self) -> bool:
        return self._room_due.is_set() or self._room_busy

    def _keep_room(self) -> None:
        def paused() -> bool:
            return self._closing.is_set() or self._stop.is_set() or any(
                sj.state == "running" for sj in list(self.stages.values()))

        while not self._closing.is_set():
            if not self._room_due.wait(0.5) or self._closing.is_set():
                continue
            if paused():  # a stage runs: it needs the CPU; room is made once it ends
                self._closing.wait(0.5)
                continue
            self._room_busy = True
            self._room_due.clear()
            try:
                versions = ((j, self.store.current(j)) for j in self.store.jobs())
                want = max((self.store.footprint(j, v) for j, v in versions if v is not None),
                           default=0)
                made = self.store.make_room(want, stop=paused)
                if made:
                    log.info("made room in the store: %d MB past its last page, for a next "
                             "version of %d MB", made // 10**6, want // 10**6)
                made = self.buffers.prepare(self._next_sizes(STAGE_THREADS), stop=paused)
                if made:
                    log.info("touched %d MB of staging buffers", made // 10**6)
            except PtcError as e:
                log.warning("could not make room in the store: %s", e)
            finally:
                self._room_busy = False

    def _next_sizes(self, n: int) -> list[int]:
        """Bytes of the ``n`` biggest sub-tensors a next stage may build in
        pooled buffers: its jobs' whole tensors (where the current version
        names a model) and the sub-tensors this host holds now."""
        sizes = []
        for job in self.store.jobs():
            v = self.store.current(job)
            if v is None:
                continue
            sizes += [e.nbytes for e in self.store.entries(job, v)]
            sizes += next((whole_sizes(x.meta) for x in self.store.versions(job)
                           if x.version == v), [])
        return sorted((s for s in sizes if s >= POOLED_BYTES), reverse=True)[:n]

    # --- for handlers ------------------------------------------------------------
    @property
    def closing(self) -> threading.Event:
        """Set once the daemon is closing (background tasks end then)."""
        return self._closing

    def refresh_hosts(self) -> None:
        """Take the cluster's hosts from the registry again (those that joined
        since; nothing to do without a registry): after joining, at each
        reconcile, and when a peer is not known."""
        if self.cluster.registry is not None:
            self.cluster = resolve(self.cluster, self.registry)[0]

    def peer(self, host: str) -> PeerClient:
        """The client of another daemon of the cluster (shared, thread-safe);
        a host not known yet is looked up in the registry."""
        with self._lock:
            if host not in self._peers:
                if host not in self.cluster.names:
                    self.refresh_hosts()
                spec = self.cluster.host(host)
                self._peers[host] = PeerClient(spec.address, host_id=self.host_id,
                                               curve=self.keys,
                                               timeout_s=settings.get("PTC_CALL_TIMEOUT_S"),
                                               peer_name=host, context=self._ctx)
            return self._peers[host]

    def count(self, peer: str, sent: int = 0, received: int = 0) -> None:
        """Add payload bytes sent to / received from ``peer`` to the counters."""
        with self._lock:
            if sent:
                self.sent[peer] += sent
            if received:
                self.received[peer] += received

    def counters(self) -> dict[str, dict[str, int]]:
        """``{peer: {"sent": bytes, "received": bytes}}`` since start."""
        with self._lock:
            peers = sorted(set(self.sent) | set(self.received))
            return {p: {"sent": self.sent.get(p, 0), "received": self.received.get(p, 0)}
                    for p in peers}

    # --- one request, in a worker --------------------------------------------------
    def _work(self, ident: bytes, frames: list[Any], held: int, sealed: bool = False) -> None:
        try:
            self._serve(ident, frames, sealed)
        finally:
            del frames
            with self._lock:
                self._held_total -= held
                self._held[ident] -= held
                if not self._held[ident]:
                    del self._held[ident]

    def _admit(self, ident: bytes, parts: list[Any]) -> tuple[int, PtcError | None]:
        """Bytes of a request just read, and why it is refused (None: it is
        not): beyond the wire's limits, or more than this connection
        (``PTC_DAEMON_PEER_INFLIGHT_BYTES``) or the daemon
        (``PTC_DAEMON_INFLIGHT_BYTES``) may hold. Admitted bytes count as
        held until the request is answered."""
        sizes = [len(p) for p in parts]
        n = sum(sizes)
        try:
            check_size(sizes)
        except InvalidRequest as e:
            return n, e
        peer_cap = int(settings.get("PTC_DAEMON_PEER_INFLIGHT_BYTES"))
        cap = int(settings.get("PTC_DAEMON_INFLIGHT_BYTES"))
        with self._lock:
            if self._held.get(ident, 0) + n > peer_cap:
                return n, Overloaded(f"this connection has {self._held[ident]} request bytes "
                                     f"in flight; {n} more exceeds {peer_cap} "
                                     "(PTC_DAEMON_PEER_INFLIGHT_BYTES): wait for answers")
            if self._held_total + n > cap:
                return n, Overloaded(f"ptcd {self.host_id} holds {self._held_total} request "
                                     f"bytes; {n} more exceeds {cap} "
                                     "(PTC_DAEMON_INFLIGHT_BYTES): try again later")
            self._held[ident] += n
            self._held_total += n
        return n, None

    def _refuse(self, ident: bytes, header: Any, error: PtcError) -> None:
        """Answer a request refused before it was queued (its payload is
        dropped already), with its id when its header says it."""
        id_ = None
        if len(header) <= 4096:
            try:
                h = msgpack.unpackb(header.bytes if hasattr(header, "bytes") else header)
                id_ = h.get("id") if isinstance(h, dict) and type(h.get("id")) is int else None
            except Exception:  # a malformed header: answer without an id
                id_ = None
        log.warning("refused a request of %s: %s", ident.hex()[:8], error)
        self.metrics.error(error)
        self._reply([ident, encode_reply(id_, error=error)], False)

    @property
    def held_bytes(self) -> int:
        """Request bytes held now (admitted, not answered yet)."""
        return self._held_total

    def _serve(self, ident: bytes, frames: list[Any], sealed: bool = False) -> None:
        session: Session | None = None
        if sealed:
            try:
                session, header = self.sessions.open_request(frames)
            except NoSession:
                self._reply([ident, NO_SESSION], True)
                return
            except InvalidRequest as e:  # forged, damaged or replayed: no answer
                log.warning("dropped a sealed request of %s: %s", ident.hex()[:8], e)
                self.metrics.error(e)
                self._reply([], True)
                return
            frames = [header]
        req: Request | None = None
        job: str | None = None  # the job a changing request changes (audited)
        inbound = 0
        error: str | None = None
        result: Any = None
        try:
            req = decode_request(frames)
            handler = OPS.get(req.op)
            if handler is None:
                raise InvalidRequest(f"unknown operation {req.op!r} "
                                     f"(this daemon serves: {', '.join(sorted(OPS))})")
            self.metrics.request(req.op)
            if session is not None and req.op not in BULK_OPS:
                raise InvalidRequest(f"{req.op} is not served on the sealed socket (only "
                                     f"{', '.join(sorted(BULK_OPS))})")
            req.sealed = sealed
            inbound = sum(_nbytes(f) for f in req.frames)
            if session is not None:
                req.key, req.fp = session.name, session.fp
            elif self.keys is not None:
                req.key, req.fp = caller_key(frames[0])
            if req.op in CHANGES:
                job = job_of(req.args)
            if self.authorizer is not None:
                self.authorizer.check(req.op, req.args, req.key, req.fp)
            if inbound:
                self.count(req.caller, received=inbound)
            with req.held:
                try:
                    result, out = handler(self, req)
                finally:
                    if job is not None and req.op not in ("put", "put_many") \
                            and self.authorizer is not None:
                        self.authorizer.changed(job)
                outbound = sum(_nbytes(b) for b in out)
                if outbound:
                    self.count(req.caller, sent=outbound)
                trackers = self._answer(ident, session, req.id, encode_reply(req.id, result),
                                        out, req.holding)
                del out
                self._wait_sent(trackers)
        except PtcError as e:
            error = f"{type(e).__name__}: {e}"
            self.metrics.error(e)
            if req is None:
                log.warning("refused a bad request from %s: %s", ident.hex()[:8], e)
            else:
                log.info("%s from %s failed: %s", req.op, req.caller, e)
            self._answer(ident, session, req.id if req else None, encode_reply(
                req.id if req else None, error=e))
        except Exception as e:  # a bug: log it whole, answer, keep serving
            error = f"internal error: {e!r}"
            log.exception("internal error in %s", req.op if req else "a request")
            self.metrics.error(e)
            self._answer(ident, session, req.id if req else None, encode_reply(
                req.id if req else None, error=PtcError(f"internal error: {e!r}")))
        finally:
            # a save already open: the mount asks at every put, nothing changes
            opened = not (isinstance(result, dict) and result.get("opened") is False)
            if req is not None and req.op in CHANGES and opened:
                self.audit.record(req.op, req.args, job, req.key, req.caller, inbound, error)

    def _answer(self, ident: bytes, session: Session | None, id_: int | None,
                header: bytes, out: list[Any] | None = None,
                borrowed: bool = False) -> list[zmq.MessageTracker]:
        """Queue the reply ``[header, *out]``: sealed for a sealed request
        (a copy: the buffers may go at once), else as :func:`_payload` makes
        its frames; the trackers of its zero-copy frames."""
        if session is not None:
            self._reply([ident, *session.seal_reply(id_, [header, *(out or ())])], True)
            return []
        payload, trackers = _payload(out or [], borrowed)
        self._reply([ident, header, *payload], False)
        return trackers

    def _reply(self, msg: list[Any], sealed: bool) -> None:
        """Queue ``msg`` for the main thread to send on the sealed socket or the other."""
        self._replies.put((sealed, msg))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the main thread is due to wake anyway

    def _wait_sent(self, trackers: list[zmq.MessageTracker]) -> None:
        for t in trackers:
            while not t.done and not self._closing.is_set():
                try:
                    t.wait(0.5)
                except zmq.NotDone:
                    pass

    # --- serving (main thread) -------------------------------------------------------
    def _bind(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame() + FRAME_OVERHEAD)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        if self.keys is not None:
            self._auth = KeyAuthenticator(self._ctx, self.keys)
            self._auth.begin()
            sock.curve_server = True
            sock.curve_publickey = self.keys.server_public
            sock.curve_secretkey = self.keys.server_secret
        try:
            sock.bind(self.bind_address)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    def _bind_sealed(self) -> zmq.Socket[Any] | None:
        """The sealed channel's socket (:mod:`ptcfs.server.net.sealed`), on the
        bind address's host at ``PTC_BULK_PORT``; None without keys or with
        ``PTC_BULK=0``."""
        if not sealing(self.keys):
            return None
        host = self.bind_address.rpartition(":")[0]
        port = int(settings.get("PTC_BULK_PORT"))
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SEALED_REQUEST)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        try:
            sock.bind(f"{host}:{port or '*'}")
        except zmq.ZMQError:
            sock.close(0)
            raise
        self.bulk_port = int(str(sock.get_string(zmq.LAST_ENDPOINT)).rpartition(":")[2])
        return sock

    def serve(self, ready_file: str | Path | None = None,
              on_bound: Callable[[], None] | None = None) -> None:
        """Bind, serve until :meth:`stop`, then close everything (the store too).

        ``ready_file`` is written (atomically: pid, host, address as JSON)
        once the socket is bound and the workers run, and removed at exit."""
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ptcd")
        tasks: list[threading.Thread] = []
        room = threading.Thread(target=self._keep_room, name="ptcd-room", daemon=True)
        sock: zmq.Socket[Any] | None = None
        sealed: zmq.Socket[Any] | None = None
        ready = Path(ready_file) if ready_file else None
        try:
            sock = self._bind()
            sealed = self._bind_sealed()
            bound = "" if self.bind_address == self.host.address else \
                f" (bound to {self.bind_address})"
            log.info("ptcd %s serving %s%s, store %s, %d workers%s%s", self.host_id,
                     self.host.address, bound, self.host.store, self.workers,
                     ", CURVE" if self.keys else "",
                     f", sealed reads on port {self.bulk_port}" if sealed else "")
            self.metrics.serve(self.metrics_port, metrics_address(self.bind_address))
            self.registry.join(self.host)
            self.refresh_hosts()
            tasks = [threading.Thread(target=t, args=(self,), name=f"ptcd-{t.__name__}",
                                      daemon=True) for t in TASKS]
            for t in tasks:
                t.start()
            room.start()
            self.want_room()
            if on_bound is not None:
                on_bound()
            # what start-up made (modules, settings, the store's handles) lives as long as
            # the daemon: out of the collector's full passes, which a stage triggers a few
            # times (0.08-0.12 s of a tp=4 -> tp=2,dp=2 stage's CPU per daemon before)
            gc.collect()
            gc.freeze()
            if ready is not None:
                tmp = ready.with_name(ready.name + ".tmp")
                tmp.write_text(json.dumps({"pid": os.getpid(), "host": self.host_id,
                                           "address": self.host.address}) + "\n")
                tmp.replace(ready)
            self._loop(sock, sealed, pool)
        finally:
            self._closing.set()
            self._room_due.set()  # wakes the room thread, which sees the daemon closing
            for s in (sock, sealed):
                if s is not None:
                    s.close(0)  # unsent replies are dropped, their buffers released
            self._drop_replies()
            pool.shutdown(wait=True, cancel_futures=True)
            self._drop_replies()
            self.metrics.close()
            if room.is_alive():
                room.join()
            for t in tasks:
                t.join()
            self.registry.close()
            with self._lock:
                for p in self._peers.values():
                    p.close()
            if self._auth is not None:
                self._auth.stop()
            self._ctx.destroy(linger=0)
            self.audit.close()
            self.store.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if ready is not None:
                ready.unlink(missing_ok=True)
            log.info("ptcd %s stopped", self.host_id)

    def _loop(self, sock: zmq.Socket[Any], sealed: zmq.Socket[Any] | None,
              pool: ThreadPoolExecutor) -> None:
        socks = [sock] if sealed is None else [sock, sealed]
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for s in socks:
            poller.register(s, zmq.POLLIN)
        reading, inflight = True, 0
        while not self._stop.is_set():
            events = dict(poller.poll(200))
            for s in socks:
                if events.get(s):
                    inflight += self._read(s, s is sealed, pool, MAX_INFLIGHT - inflight)
            if events.get(self._wake_r):
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            while True:
                try:
                    to_sealed, msg = self._replies.get_nowait()
                except queue.Empty:
                    break
                inflight -= 1
                if msg:  # empty: a request dropped unanswered
                    self._send_now(sealed if to_sealed and sealed else sock, msg)
                del msg  # release zero-copy frames so their trackers finish
            if reading != (inflight < MAX_INFLIGHT):
                reading = not reading
                for s in socks:
                    if reading:
                        poller.register(s, zmq.POLLIN)
                    else:
                        poller.unregister(s)

    def _read(self, sock: zmq.Socket[Any], sealed: bool, pool: ThreadPoolExecutor,
              room: int) -> int:
        """Hand up to ``min(64, room)`` requests waiting on ``sock`` to the
        workers (answer pings at once); how many will be answered."""
        taken = 0
        for _ in range(min(64, room)):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(parts) < 2:
                log.warning("dropped a message of %d frame(s) without a header", len(parts) - 1)
                continue
            ident = parts[0].bytes
            if sealed:  # a few KiB at most (MAX_SEALED_REQUEST): nothing to hold
                taken += 1
                pool.submit(self._work, ident, parts[1:], 0, True)
                continue
            pong = self._ping_now(parts)
            if pong is not None:
                self._send_now(sock, [ident, pong])
                continue
            taken += 1
            held, refused = self._admit(ident, parts[1:])
            if refused is not None:
                header = parts[1]
                del parts  # the payload goes now, not when the answer is sent
                self._refuse(ident, header, refused)
                continue
            pool.submit(self._work, ident, parts[1:], held)
            del parts
        return taken

    def _ping_now(self, parts: list[Any]) -> bytes | None:
        """The answer to a ``ping``, which the I/O thread gives at once so
        that a busy daemon still shows it is alive (liveness pings of
        :class:`PeerClient`); None for any other request."""
        if len(parts) != 2 or len(parts[1]) > PING_MAX_HEADER or \
                _PING_OP not in parts[1].bytes:
            return None
        try:
            req = decode_request(parts[1:])
        except PtcError:
            return None  # a worker answers it with the error
        if req.op != "ping":
            return None
        return encode_reply(req.id, OPS["ping"](self, req)[0])

    @staticmethod
    def _send_now(sock: zmq.Socket[Any], msg: list[Any]) -> None:
        try:
            sock.send_multipart(msg, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not send a reply: %s", e)

    def _drop_replies(self) -> None:
        while True:
            try:
                self._replies.get_nowait()
            except queue.Empty:
                return

    def stop(self) -> None:
        """Ask :meth:`serve` to stop (safe from signal handlers and other threads)."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")  # the I/O loop sees it now, not at its next poll
        except OSError:
            pass  # the pipe is full (the loop is due to wake) or closed (serve has ended)


def _nbytes(buf: Any) -> int:
    return memoryview(buf).nbytes


def _payload(out: list[Any], borrowed: bool) -> tuple[list[Any], list[zmq.MessageTracker]]:
    """The frames of a reply's payload. Borrowed buffers (from a held store
    reader) go out as tracked zero-copy frames when big; runs of small ones
    are copied into one frame (a view entry's range may be thousands of rows)."""
    if not borrowed:
        return out, []
    frames: list[Any] = []
    trackers = []
    small: list[Any] = []
    for buf in out:
        if _nbytes(buf) >= ZERO_COPY_MIN:
            if small:
                frames.append(b"".join(small))
                small = []
            f = zmq.Frame(buf, copy=False, track=True)
            if f.tracker is not None:  # always, with track=True
                trackers.append(f.tracker)
            frames.append(f)
        else:
            small.append(buf)
    if small:
        frames.append(b"".join(small))
    return frames, trackers


def _own_host(cluster: ClusterSpec, args: argparse.Namespace) -> HostSpec | None:
    """This host from ptcd's flags over its table in the file (None: the
    file's table as it is, for a cluster without a registry)."""
    if cluster.registry is None:
        if args.address or args.store or args.gpus:
            raise InvalidConfig("--address, --store and --gpus join a registry; this cluster "
                                "file names none (set registry = \"etcd://HOST:PORT\" under "
                                "[cluster]), so edit its [hosts.NAME] table instead")
        return None
    known = {h.name: h for h in cluster.hosts}.get(args.host_id)
    address = args.address or (known.address if known else None)
    store = args.store.resolve() if args.store else (known.store if known else None)
    if not address or store is None:
        raise InvalidConfig(f"host {args.host_id!r} is not in {cluster.path}: give its "
                            "--address tcp://HOST:PORT and --store DIR to join the registry")
    gpus = args.gpus if args.gpus is not None else (known.gpus if known else 1)
    if gpus < 1:
        raise InvalidConfig(f"--gpus must be at least 1, not {gpus}")
    return HostSpec(args.host_id, address, store, gpus)


def main(argv: list[str] | None = None) -> int:
    """``ptcd``: serve this host's store until SIGTERM or SIGINT; exit 0 then,
    else as ``ptcctl`` does (``ptcfs.errors.EXIT_CODES``): 2 on a bad setting,
    cluster file or host id, 1 if the store cannot open or the address
    cannot be bound."""
    ap = argparse.ArgumentParser(prog="ptcd", description="The ptcfs per-host daemon: serves "
                                 "this host's tensor store to the cluster over ZeroMQ.")
    ap.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    ap.add_argument("--host-id", required=True, help="this host's name in the cluster file")
    ap.add_argument("--bind", help="address to bind (default: the host's address in the "
                    "cluster file; e.g. tcp://0.0.0.0:7100 behind NAT)")
    ap.add_argument("--address", help="this host's address (tcp://HOST:PORT), to join a "
                    "registry; default: its [hosts.NAME] table in the cluster file")
    ap.add_argument("--store", type=Path, help="this host's store directory, to join a "
                    "registry; default: its [hosts.NAME] table")
    ap.add_argument("--gpus", type=int, help="this host's GPUs (rank slots), to join a "
                    "registry; default: its [hosts.NAME] table, else 1")
    ap.add_argument("--ready-file", help="written (JSON: pid, host, address) once serving, "
                    "removed at exit")
    ap.add_argument("--mount", type=Path, help="also mount this host's /ptc filesystem here "
                    "(unmounted when ptcd stops)")
    ap.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus "
                    "metrics at http://HOST:PORT/metrics, HOST that of the daemon's address "
                    "(default: $PTC_METRICS_PORT; 0: off)")
    ap.add_argument("--fresh-store", action="store_true", help="set the store's data file "
                    "aside (as data.mdb.damaged-TIME) and start on an empty store, whose copies "
                    "`ptcctl repair` restores from peers: for a store ptcd refuses as damaged")
    ap.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    type=str.upper, help="default: $PTC_LOG_LEVEL, else INFO")
    args = ap.parse_args(argv)
    try:
        settings.check_all()
    except PtcError as e:
        print(f"ptcd: error: {e}", file=sys.stderr)
        return exit_code(e)
    args.log_level = args.log_level or str(settings.get("PTC_LOG_LEVEL")).upper()
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s ptcd[{args.host_id}] %(levelname)s %(message)s")
    os.umask(0o077)  # the store, its spool, logs and ready files: this user's only
    keep_heap()  # before the store's first writes: see its docstring
    try:
        cluster = load_cluster(args.cluster)
        if args.fresh_store:
            own = _own_host(cluster, args) or cluster.host(args.host_id)
            moved = fresh_store(Path(own.store), time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
            if moved is not None:
                logging.warning("set the store's data file aside as %s; starting empty", moved)
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise InvalidConfig(f"--metrics-port must be a port (0-65535; 0: off), "
                                f"not {args.metrics_port}")
        daemon = Daemon(cluster, args.host_id, bind=args.bind, host=_own_host(cluster, args),
                        metrics_port=args.metrics_port)
    except PtcError as e:  # a bad cluster file or host id: 2; a store that cannot open: 1
        print(f"ptcd: error: {e}", file=sys.stderr)
        return exit_code(e)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    mount = None
    if args.mount is not None:
        from ptcfs.server.mount import MountChild

        mount = MountChild(args.cluster, args.host_id, args.mount, args.log_level)
    try:
        daemon.serve(args.ready_file, on_bound=mount.start if mount else None)
    except zmq.ZMQError as e:
        print(f"ptcd: error: cannot serve on {daemon.bind_address}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except PtcError as e:
        print(f"ptcd: error: {e}", file=sys.stderr)
        return exit_code(e)
    finally:
        if mount is not None:
            mount.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
