"""``ptcd``: the per-host daemon that owns a host's tensor store.

Threads: the main thread owns the ROUTER socket (ZeroMQ sockets are not
thread-safe). It hands each request to a pool of workers and sends the
replies they queue back (woken through an inproc socket). So a worker busy
with a large read or a whole ``stage`` never stops small requests.

Operations are functions registered with :func:`daemon_op` in the modules
listed in ``OP_MODULES``; each takes ``(daemon, request)`` and returns
``(result, payload_frames)``. Errors a handler raises go back to the caller
as error replies; the daemon keeps serving whatever arrives.

Start-up order: open the store, bind, start workers, write the ready file.
SIGTERM or SIGINT: stop taking requests, finish, close the store, exit 0.
"""

from __future__ import annotations

import argparse
import importlib
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

import zmq

from ptcfs.errors import PtcError
from ptcfs.server.cluster import ClusterSpec, load_cluster
from ptcfs.server.keys import CurveKeys, load_keys
from ptcfs.server.peer import PeerClient
from ptcfs.server.wire import Request, decode_request, encode_reply
from ptcfs.store.lmdb_store import LmdbStore

__all__ = ["Daemon", "daemon_op", "OPS", "main"]

log = logging.getLogger("ptcd")

Handler = Callable[["Daemon", Request], tuple[Any, list[Any]]]
OPS: dict[str, Handler] = {}
OP_MODULES = ("ptcfs.server.ops_store", "ptcfs.server.ops_reconfig")
WORKERS = int(os.environ.get("PTC_DAEMON_WORKERS", 8))


def daemon_op(name: str) -> Callable[[Handler], Handler]:
    """Register a handler for operation ``name``."""

    def wrap(fn: Handler) -> Handler:
        OPS[name] = fn
        return fn

    return wrap


class Daemon:
    """One host's daemon: its store, its socket, its peers."""

    def __init__(self, cluster: ClusterSpec, host_id: str):
        self.cluster = cluster
        self.host = cluster.host(host_id)
        self.host_id = host_id
        self.keys: CurveKeys | None = load_keys(cluster.curve_dir) if cluster.curve_dir else None
        self.store = LmdbStore(self.host.store)
        self.started = time.time()
        self.sent: dict[str, int] = defaultdict(int)  # payload bytes sent, by caller
        self.received: dict[str, int] = defaultdict(int)  # payload bytes received, by caller
        self.stages: dict[tuple[str, int], Any] = {}  # (job, version) → ops_reconfig.StageJob
        self._counter_lock = threading.Lock()
        self._peers: dict[str, PeerClient] = {}
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._auth: Any = None
        for mod in OP_MODULES:
            importlib.import_module(mod)

    # --- peers ---------------------------------------------------------------
    def peer(self, host: str) -> PeerClient:
        """A client for another daemon of the cluster."""
        if host not in self._peers:
            spec = self.cluster.host(host)
            self._peers[host] = PeerClient(spec.address, host_id=self.host_id, curve=self.keys,
                                           timeout_s=120.0, peer_name=host, context=self._ctx)
        return self._peers[host]

    def count(self, caller: str, sent: int = 0, received: int = 0) -> None:
        with self._counter_lock:
            if sent:
                self.sent[caller] += sent
            if received:
                self.received[caller] += received

    # --- serving -------------------------------------------------------------
    def _bind(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("ptcd.auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.keys.public_dir))
            sock.curve_server = True
            sock.curve_publickey = self.keys.server_public
            sock.curve_secretkey = self.keys.server_secret
        sock.bind(self.host.address)
        return sock

    def _handle(self, ident: bytes, frames: list[Any], replies: queue.Queue[Any]) -> None:
        req_id = None
        try:
            req = decode_request(frames)
            req_id = req.id
            handler = OPS.get(req.op)
            if handler is None:
                raise PtcError(f"unknown operation {req.op!r}")
            inbound = sum(len(f) for f in req.frames)
            if inbound:
                self.count(req.caller, received=inbound)
            result, out = handler(self, req)
            outbound = sum(len(memoryview(f)) for f in out)
            if outbound:
                self.count(req.caller, sent=outbound)
            replies.put([ident, encode_reply(req_id, result), *out])
        except PtcError as e:
            log.info("request %s failed: %s", req_id, e)
            replies.put([ident, encode_reply(req_id, error=e)])
        except Exception as e:  # a bug: log it whole, answer, keep serving
            log.exception("internal error in request %s", req_id)
            replies.put([ident, encode_reply(req_id, error=PtcError(f"internal error: {e!r}"))])

    def serve(self, ready_file: str | None = None) -> None:
        """Serve until stopped (SIGTERM, SIGINT or :meth:`stop`)."""
        sock = self._bind()
        wake_addr = f"inproc://wake-{id(self)}"
        wake_rx = self._ctx.socket(zmq.PULL)
        wake_rx.bind(wake_addr)
        replies: queue.Queue[Any] = queue.Queue()
        local = threading.local()

        def notify() -> None:
            s = getattr(local, "push", None)
            if s is None:
                s = local.push = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(wake_addr)
            s.send(b"")

        def work(ident: bytes, frames: list[Any]) -> None:
            self._handle(ident, frames, replies)
            notify()

        pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ptcd")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_rx, zmq.POLLIN)
        log.info("ptcd %s serving %s, store %s", self.host_id, self.host.address, self.host.store)
        if ready_file:
            Path(ready_file).write_text(f"{os.getpid()}\n")
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if sock in events:
                    for _ in range(64):
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(parts) < 2:
                            continue
                        pool.submit(work, parts[0].bytes, parts[1:])
                if wake_rx in events:
                    while True:
                        try:
                            wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while True:
                    try:
                        msg = replies.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        sock.send_multipart(msg, copy=False, flags=zmq.NOBLOCK)
                    except zmq.ZMQError as e:
                        log.warning("could not send a reply: %s", e)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            sock.close(0)
            wake_rx.close(0)
            for p in self._peers.values():
                p.close()
            if self._auth is not None:
                self._auth.stop()
            self.store.close()
            self._ctx.term()
            log.info("ptcd %s stopped", self.host_id)

    def stop(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ptcd", description="The ptcfs per-host daemon.")
    ap.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    ap.add_argument("--host-id", required=True, help="this host's name in the cluster file")
    ap.add_argument("--ready-file", help="write the pid here once serving")
    ap.add_argument("--log-level", default=os.environ.get("PTC_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s ptcd[{args.host_id}] %(levelname)s %(message)s")
    try:
        daemon = Daemon(load_cluster(args.cluster), args.host_id)
    except PtcError as e:
        print(f"ptcd: error: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    try:
        daemon.serve(args.ready_file)
    except zmq.ZMQError as e:
        print(f"ptcd: error: cannot serve on {daemon.host.address}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
