"""Client side of the ptcd protocol: one daemon, seen from another process.

Call order: ``PeerClient(address, host_id=..., curve=..., timeout_s=...)``;
then :meth:`~PeerClient.call`, :meth:`~PeerClient.read_into`,
:meth:`~PeerClient.read_box` and :meth:`~PeerClient.put` from any number of
threads; :meth:`~PeerClient.close` at the end.

Threads. Each call borrows an idle DEALER socket from the client's pool (or
makes one) and gives it back when it is done; a socket whose call broke off
(timeout, malformed reply, an error in the middle of a pipelined read) is
closed instead, so a late reply can never reach another call.

Liveness. While a call waits, a peer that has sent nothing for
``PTC_PEER_SILENCE_S`` is asked ``ping`` on another socket (the daemon
answers pings from its I/O thread, never behind other work): no answer
within ``PTC_PING_TIMEOUT_S`` and the call ends at once, the peer is dead;
an answer and the call goes on waiting, the peer is alive and its reply
is only big or slow. So a dead peer is known in a few seconds, and a long
transfer from a live one still runs up to ``timeout_s``. A call whose
request carries a big payload gives the ping BUSY_BYTES_PER_S's time for
each of its bytes more: a daemon taking a GiB in on a host whose cores are
busy answers pings late (its threads all wait for the CPU, and on the
memory the request fills), so its liveness limit grows with its bytes. Sooner where its
daemon has exited and the host is up: before that ping (and in a ping
unanswered for PROBE_AFTER_S) the call asks the kernel whether anything
listens at the peer's address, and ends at once if the connection is
refused (a refusal is remembered: the next calls there look at once). A
ping answers with the daemon's ``boot`` (new at each start), remembered
per address, and how long it has been up: a ping answered by a daemon
started since the last one seen there, or since the request was sent,
ends the call too, since the daemon that had the request is gone with it.

Errors. No reply within ``timeout_s``, no answer to a liveness ping, or
nothing listening at the address, raises PeerError (``timed_out``) naming
the host, the op and the address; an error reply raises the same ptcfs
class the daemon raised (TensorNotFound stays TensorNotFound), its message
prefixed with the host and op. A call given a ``cancel`` event ends within
CANCEL_POLL_S of it being set, with :class:`~ptcfs.errors.Cancelled`.

Big reads. :meth:`~PeerClient.read_into` cuts ``[offset, offset+length)``
into requests of :func:`chunk_bytes` bytes, keeps :func:`pipeline` of them in flight, and
copies each reply's frames straight into the caller's buffer at its offset:
one copy, from ZeroMQ's message into ``out``. Between those requests the
daemon serves everyone else's.
"""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from ptcfs import settings
from ptcfs.dtypes import dtype_name
from ptcfs.errors import Cancelled, InvalidRequest, NoSession, NotAllowed, PeerError
from ptcfs.server.net.keys import CurveKeys
from ptcfs.server.net.sealed import Channel, InvalidTag, open_session, sealing
from ptcfs.server.net.wire import (
    MAX_PAYLOAD,
    PUT_FRAME,
    check_size,
    decode_reply,
    encode_request,
    error_from_wire,
    max_frames,
    max_request,
    put_frame,
)
from ptcfs.types import Box

T = TypeVar("T")

__all__ = ["PeerClient", "chunk_bytes", "on_each", "pipeline", "split_box", "CANCEL_POLL_S",
           "came_back"]

Progress = Callable[[int], None]
#: Where a reply's payload lands: contiguous bytes, or an array of any strides.
Dest = memoryview | np.ndarray
#: How often a call given a ``cancel`` event looks at it while it waits.
CANCEL_POLL_S = 0.05
#: address → the ``boot`` of the daemon that last answered a ping there
_boots: dict[str, str] = {}
#: A ping that has no answer after this long asks the kernel whether anything
#: listens at the peer's address (see :func:`probe`), as another call does
#: before it pings a silent peer ...
#: The slowest a live daemon is taken to take a big request in (decrypt, copy,
#: store) on a busy host: a call's liveness ping waits this rate's time for the
#: request's payload bytes beyond PTC_PING_TIMEOUT_S (a 1 GiB put: 32 s more).
BUSY_BYTES_PER_S = 32 << 20
PROBE_AFTER_S = 0.25
#: ... at most once a second per address.
PROBE_EVERY_S = 1.0
#: address → when a probe last found something listening there
_listening: dict[str, float] = {}
#: address → when a probe last found nothing listening there: a call there
#: within REFUSED_MEMORY_S of it looks again at once, before it waits
_refusals: dict[str, float] = {}
REFUSED_MEMORY_S = 60.0


def chunk_bytes() -> int:
    """Bytes asked for by one read request (``PTC_WIRE_CHUNK``; at most MAX_PAYLOAD)."""
    return min(int(settings.get("PTC_WIRE_CHUNK")), MAX_PAYLOAD)


def pipeline() -> int:
    """Read requests in flight at once per read (``PTC_WIRE_PIPELINE``)."""
    return int(settings.get("PTC_WIRE_PIPELINE"))


def split_box(box: Box, itemsize: int, limit: int | None = None) -> Iterator[Box]:
    """Cut a box into boxes of at most ``limit`` bytes (when a single element
    row allows), in C order, so that their bytes follow one another."""
    size = itemsize * math.prod(max(b - a, 0) for a, b in box)
    limit = limit or chunk_bytes()
    if size <= limit or not box:
        yield box
        return
    dim = next((i for i, (a, b) in enumerate(box) if b - a > 1), None)
    if dim is None:
        yield box
        return
    a, b = box[dim]
    per = size // (b - a)
    step = max(1, limit // per)
    for s in range(a, b, step):
        sub = box[:dim] + ((s, min(s + step, b)),) + box[dim + 1:]
        yield from split_box(sub, itemsize, limit)


class PeerClient:
    """Requests to the daemon at ``address``, as host ``host_id`` ("ctl" for
    ``ptcctl``). ``curve``: the cluster's keys when it uses CurveZMQ.
    ``timeout_s``: the longest wait for one reply (None: forever).
    ``sent`` and ``received`` count the payload bytes this client moved."""

    def __init__(self, address: str, *, host_id: str = "ctl", curve: CurveKeys | None = None,
                 timeout_s: float | None = 60.0, peer_name: str | None = None,
                 context: zmq.Context[Any] | None = None):
        self.address = address
        self.host_id = host_id
        self.curve = curve
        self.timeout_s = timeout_s
        self.peer = peer_name or address
        self.sent = 0
        self.received = 0
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._idle: list[zmq.Socket[Any]] = []
        self._generation = 0  # bumped by close(): sockets of older generations are closed
        #: the sealed channel's session (None: not opened; False: the daemon has none)
        self._channel: Channel | None | bool = None

    # --- sockets ---------------------------------------------------------------------
    def _new_socket(self, channel: Channel | None = None,
                    context: zmq.Context[Any] | None = None) -> zmq.Socket[Any]:
        """A DEALER to the daemon: over CURVE (with keys), or to the sealed
        ``channel``'s socket, whose frames are sealed instead; of ``context``
        when given, else of this client's."""
        s = (context or self._ctx).socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if self.curve is not None and channel is None:
            s.curve_serverkey = self.curve.server_public
            s.curve_publickey = self.curve.client_public
            s.curve_secretkey = self.curve.client_secret
        s.connect(self.address if channel is None else channel.address)
        return s

    @contextmanager
    def _socket(self, channel: Channel | None = None,
                bulk: bool = False) -> Iterator[zmq.Socket[Any]]:
        """Borrow a socket for one call (of the sealed ``channel`` when
        given); it goes back to the pool only if the call ended cleanly (no
        reply of it can still arrive). ``bulk``: a socket of its own on
        :func:`_bulk_context`, closed after the call."""
        idle: list[zmq.Socket[Any]] = [] if bulk else \
            self._idle if channel is None else channel.idle
        with self._lock:
            gen = self._generation
            s = idle.pop() if idle else None
        if s is None:
            s = self._new_socket(channel, _bulk_context() if bulk else None)
        clean = False
        try:
            yield s
            clean = True
        finally:
            with self._lock:
                if clean and gen == self._generation and not bulk:
                    idle.append(s)
                    s = None
            if s is not None:
                s.close(0)

    def _send(self, s: zmq.Socket[Any], op: str, args: dict[str, Any],
              frames: list[Any] | None = None, channel: Channel | None = None) -> int:
        id_ = next(self._ids)
        header = encode_request(id_, op, self.host_id, args)
        if channel is not None:
            s.send_multipart(channel.seal_request(header))
        else:
            s.send_multipart([header, *(frames or [])], copy=False)
        return id_

    def _sealed(self) -> Channel | None:
        """The sealed channel to read over (:mod:`ptcfs.server.net.sealed`),
        opening a session at the first read; None without keys, with
        ``PTC_BULK=0``, or where the daemon has no sealed socket."""
        if not sealing(self.curve):
            return None
        with self._lock:
            ch = self._channel
        if ch is None:
            try:
                ch = open_session(self.call, self.address)
            except InvalidRequest:  # no sealed socket there (PTC_BULK=0): CURVE it is
                ch = False
            with self._lock:
                if self._channel is None:
                    self._channel = ch
                ch = self._channel
        return ch if isinstance(ch, Channel) else None

    def _drop_channel(self, ch: Channel) -> None:
        with self._lock:
            if self._channel is ch:
                self._channel = None
            idle, ch.idle = ch.idle, []
        for s in idle:
            s.close(0)

    def _recv(self, s: zmq.Socket[Any], ids: Any, op: str,
              cancel: threading.Event | None = None, limit: float | None = None,
              watch: bool = True, channel: Channel | None = None, sent: int = 0
              ) -> tuple[int, dict[str, Any], list[zmq.Frame]]:
        """The next reply to one of ``ids``: (id, header, payload frames).
        Waits at most ``limit`` (default ``timeout_s``) for each reply; with
        ``watch``, pings a silent peer (see the module docstring), waiting
        longer for the pong after a request of ``sent`` payload bytes. On a
        sealed ``channel`` the header is opened (the payload is not)."""
        limit = self.timeout_s if limit is None else limit
        start = time.monotonic()
        deadline = math.inf if limit is None else start + limit
        silence = float(settings.get("PTC_PEER_SILENCE_S")) if watch else math.inf
        heard = start  # the last time the peer showed it is alive
        boot = _boots.get(self.address)  # the daemon that got the request, if known
        # when to look whether anything listens at the daemon's address: at once where
        # nothing did lately, else in a call that pings not (a ping itself) once it has
        # waited a while
        probe_at = start if start - _refusals.get(self.address, -math.inf) < REFUSED_MEMORY_S \
            else math.inf if watch else start + PROBE_AFTER_S
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"{self.peer} ({op}): cancelled")
            now = time.monotonic()
            if now >= probe_at:
                probe_at = math.inf
                self._listened(op)
            wake = min(deadline, heard + silence, probe_at,
                       now + CANCEL_POLL_S if cancel is not None else math.inf)
            wait = None if wake == math.inf else max(0, math.ceil((wake - now) * 1000))
            if s.poll(wait):
                parts = s.recv_multipart(copy=False)
                heard = time.monotonic()
                try:
                    h = decode_reply(parts[0].buffer if channel is None else
                                     channel.open_header(parts))
                except InvalidTag:
                    raise PeerError(f"{self.peer} ({op}): a sealed reply that does not open "
                                    "(damaged or forged on the way)") from None
                except NoSession:
                    raise
                except PeerError as e:
                    raise PeerError(f"{self.peer} ({op}): {e}") from None
                if h["id"] in ids:
                    return h["id"], h, parts[1:]
                continue  # a reply to a call of this socket that was abandoned; skip it
            now = time.monotonic()
            if now >= deadline:
                self._listened(op)  # which it is, for the next calls too
                raise PeerError(f"{self.peer} did not answer {op!r} within {limit} s "
                                f"({self.address}; is ptcd running there, with the cluster's "
                                "keys?)", timed_out=True)
            if now - heard >= silence:
                self._listened(op)
                ping_s = min(float(settings.get("PTC_PING_TIMEOUT_S")) +
                             sent / BUSY_BYTES_PER_S, deadline - now)
                pong = self._ping(ping_s, cancel)
                if pong is None:
                    raise PeerError(f"{self.peer} did not answer {op!r}: no answer to a "
                                    f"liveness ping within {ping_s:.1f} s after "
                                    f"{now - heard:.1f} s of silence ({self.address}; is "
                                    "ptcd running there?)", timed_out=True)
                now_boot, up_s = pong
                if channel is not None and now_boot != channel.boot:
                    raise NoSession(f"{self.peer} restarted: its sealed session is gone")
                # the daemon that answers started after the request was sent: up for
                # less time than the request has waited (a daemon that does not tell
                # its uptime: not the one this process saw last there)
                restarted = up_s < now - start if up_s is not None else \
                    boot is not None and now_boot != boot
                if restarted:
                    raise PeerError(f"{self.peer} restarted while {op!r} waited for it; "
                                    "its answer is lost", timed_out=True)
                boot = now_boot
                heard = time.monotonic()

    def _listened(self, op: str) -> None:
        """PeerError (``timed_out``) if nothing listens at the daemon's address:
        its own socket, not a sealed channel's, whose port goes with the
        daemon's start (a restarted daemon's new one is found through the
        pings, as NoSession). NotAllowed if the daemon refuses this client's
        key (its CurveZMQ handshake fails: no request of it is ever read)."""
        listening = probe(self.address)
        if listening is False:
            raise PeerError(f"{self.peer} did not answer {op!r}: nothing listens at "
                            f"{self.address} (connection refused; is ptcd running there?)",
                            timed_out=True)
        if listening and self.curve is not None and \
                key_refused(self._ctx, self.address, self.curve):
            raise NotAllowed(f"{self.peer} refused this client's key ({op!r}; "
                             f"{self.address}): the daemons do not admit it. Use a key of the "
                             "cluster's key directory (PTC_CLIENT_KEY; ptcctl keys list)")

    def alive(self, limit: float | None = None, cancel: threading.Event | None = None) -> bool:
        """Whether the peer answers a ``ping`` within ``limit`` seconds
        (default ``PTC_PING_TIMEOUT_S``); Cancelled once ``cancel`` is set."""
        return self._ping(limit, cancel) is not None

    def _ping(self, limit: float | None = None, cancel: threading.Event | None = None
              ) -> tuple[str, float | None] | None:
        """The ``boot`` of the daemon that answers a ping within ``limit``
        seconds and its ``up_s`` (None from a daemon that does not tell it),
        or None if none answers."""
        limit = float(settings.get("PTC_PING_TIMEOUT_S")) if limit is None else limit
        try:
            with self._socket() as s:
                id_ = self._send(s, "ping", {})
                _, h, _ = self._recv(s, {id_}, "ping", cancel, limit=max(limit, 0.001),
                                     watch=False)
        except PeerError as e:
            if e.timed_out:
                return None
            raise
        self._raise(h, "ping")
        result = h.get("result")
        up = result.get("up_s") if isinstance(result, dict) else None
        return _saw_boot(self.address, result), (float(up) if up is not None else None)

    def _raise(self, h: dict[str, Any], op: str) -> None:
        if not h["ok"]:
            raise error_from_wire(h["error"], f"{self.peer} ({op})")

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

    # --- calls -------------------------------------------------------------------------
    def call(self, op: str, frames: list[Any] | None = None, **args: Any) -> Any:
        """Send ``op`` with ``args`` (and payload ``frames``); the reply's result."""
        result, _ = self.call_frames(op, frames, **args)
        return result

    def call_frames(self, op: str, frames: list[Any] | None = None,
                    **args: Any) -> tuple[Any, list[zmq.Frame]]:
        """Like :meth:`call`, and the reply's payload frames too. A request
        of more than :data:`PUT_FRAME` payload bytes goes over a socket of
        :func:`_bulk_context`: sealing its frames (CurveZMQ) keeps that
        context's I/O thread busy for as long as they take, and the liveness
        pings sent meanwhile go through this client's."""
        nbytes = sum(memoryview(f).nbytes for f in frames or ())
        with self._socket(bulk=nbytes > PUT_FRAME) as s:
            id_ = self._send(s, op, args, frames)
            _, h, out = self._recv(s, {id_}, op, watch=op != "ping", sent=nbytes)
        self._raise(h, op)  # the socket is clean: it went back to the pool
        if op == "ping":
            _saw_boot(self.address, h.get("result"))
        self._count(sent=nbytes,
                    received=sum(len(f) for f in out))
        return h.get("result"), out

    def _fetch(self, op: str, requests: list[tuple[dict[str, Any], Dest]],
               progress: Progress | None = None,
               cancel: threading.Event | None = None) -> None:
        """Send ``op`` once per ``(args, destination)``, at most :func:`pipeline` in
        flight, and copy each reply's payload into its destination;
        ``progress(nbytes)`` after each; Cancelled once ``cancel`` is set.
        Over the sealed channel where there is one; a session the daemon
        no longer knows (it restarted) is opened again, once, for the
        requests not answered yet."""
        ch = self._sealed()
        done: set[int] = set()
        try:
            self._fetch_on(ch, op, requests, done, progress, cancel)
        except NoSession:
            assert ch is not None
            self._drop_channel(ch)
            self._fetch_on(self._sealed(), op, requests, done, progress, cancel)

    def _fetch_on(self, ch: Channel | None, op: str,
                  requests: list[tuple[dict[str, Any], Dest]], done: set[int],
                  progress: Progress | None, cancel: threading.Event | None) -> None:
        """:meth:`_fetch` of the requests not in ``done`` (each one landed is added)."""
        depth = pipeline()
        todo = [i for i in range(len(requests)) if i not in done]
        with self._socket(ch) as s:
            pending: dict[int, int] = {}
            nxt = 0
            while nxt < len(todo) or pending:
                while nxt < len(todo) and len(pending) < depth:
                    pending[self._send(s, op, requests[todo[nxt]][0], channel=ch)] = todo[nxt]
                    nxt += 1
                id_, h, frames = self._recv(s, pending, op, cancel, channel=ch)
                self._raise(h, op)
                i = pending.pop(id_)
                n = _land(frames, requests[i][1], f"{self.peer} ({op})",
                          None if ch is None else _opener(ch, id_, len(frames)))
                done.add(i)
                self._count(received=n)
                if progress is not None:
                    progress(n)

    def read_into(self, job: str, version: int, tensor: str, part: str, offset: int = 0,
                  length: int | None = None, out: Any = None, *, chunk: int | None = None,
                  progress: Progress | None = None) -> memoryview:
        """Bytes ``[offset, offset+length)`` of a stored sub-tensor (to its end
        when ``length`` is None), written into ``out`` (any writable,
        contiguous buffer of exactly ``length`` bytes) or a new bytearray.
        Fetched in ``chunk``-byte pieces (default :func:`chunk_bytes`), pipelined;
        ``progress(nbytes)`` is called as each piece lands."""
        if length is None:
            info = self.call("info", job=job, version=version, tensor=tensor, part=part)
            length = int(info["nbytes"]) - offset
        if offset < 0 or length < 0:
            raise InvalidRequest(f"read_into: offset {offset} and length {length} must be >= 0")
        step = chunk or chunk_bytes()
        if not 0 < step <= MAX_PAYLOAD:
            raise InvalidRequest(f"read_into: chunk must be 1..{MAX_PAYLOAD} bytes")
        view = _byte_view(out, length)
        base = {"job": job, "version": version, "tensor": tensor, "part": part}
        self._fetch("read", [({**base, "offset": offset + p, "length": min(step, length - p)},
                              view[p:p + step]) for p in range(0, length, step)], progress)
        return view

    def read_box(self, job: str, version: int, tensor: str, part: str, box: Box,
                 itemsize: int | None = None, out: Any = None, *,
                 progress: Progress | None = None,
                 cancel: threading.Event | None = None, staging: bool = False) -> memoryview:
        """The C-order bytes of a box (local coordinates) of a stored sub-tensor,
        fetched in pipelined pieces of at most :func:`chunk_bytes` bytes, written into ``out``
        when given (exactly the box's bytes, or a writable array of the box's
        extents with any strides: each piece lands in its place) or a new
        bytearray. Setting ``cancel`` ends it with Cancelled. The version
        must be committed on the peer, or with ``staging``, may be staging
        there (a save's bytes, copied to their replicas before the commit)."""
        if itemsize is None:
            info = self.call("info", job=job, version=version, tensor=tensor, part=part)
            itemsize = info["nbytes"] // max(1, math.prod(info["shape"])) or 1
        box = tuple((int(a), int(b)) for a, b in box)
        pieces = list(split_box(box, itemsize))
        base = {"job": job, "version": version, "tensor": tensor, "part": part,
                **({"staging": True} if staging else {})}
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            extents = tuple(b - a for a, b in box)
            if out.shape != extents or out.itemsize != itemsize or not out.flags.writeable:
                raise InvalidRequest(f"out is a {out.shape} array of {out.itemsize}-byte items; "
                                     f"the box is {list(extents)} of {itemsize}-byte items")
            self._fetch("read_box", [({**base, "box": [list(p) for p in piece]}, out[tuple(
                slice(a - o, b - o) for (a, b), (o, _) in zip(piece, box))])
                for piece in pieces], progress, cancel)
            return out.data
        sizes = [itemsize * math.prod(max(b - a, 0) for a, b in p) for p in pieces]
        view = _byte_view(out, sum(sizes))
        starts = itertools.accumulate([0] + sizes[:-1])
        self._fetch("read_box", [({**base, "box": [list(b) for b in p]}, view[at:at + n])
                                 for p, at, n in zip(pieces, starts, sizes)], progress, cancel)
        return view

    def read_boxes(self, job: str, version: int, boxes: Sequence[tuple[str, str, Box]],
                   out: Any, *, cancel: threading.Event | None = None,
                   staging: bool = False) -> None:
        """The C-order bytes of several boxes ``(tensor, part, box)`` of one
        version, one after another, in one request: into ``out``, a writable
        contiguous buffer of exactly their bytes (at most MAX_PAYLOAD).
        ``cancel`` and ``staging`` as for :meth:`read_box`."""
        args: dict[str, Any] = {"job": job, "version": version, "boxes": [
            [tensor, part, [list(b) for b in box]] for tensor, part, box in boxes],
            **({"staging": True} if staging else {})}
        self._fetch("read_boxes", [(args, _byte_view(out, memoryview(out).nbytes))],
                    None, cancel)

    def put(self, job: str, version: int, tensor: str, part: str, array: np.ndarray,
            dtype: str | None = None, saving: bool = False, **about: Any) -> None:
        """Upload one sub-tensor into a staging version of the daemon's store.
        ``dtype`` is the ptcfs dtype name (default: from the array's dtype;
        give it for bf16, which numpy holds as uint16). ``saving``: only into
        a version still open for saving (JobBusy otherwise); ``about``: what
        the audit trail records of it (a mount's ``uid`` and ``rank``)."""
        shape, name, frames = _payload(array, dtype)
        try:  # the daemon's limits, where they are this process's: refused before sending
            check_size([0, *(memoryview(f).nbytes for f in frames)])
        except InvalidRequest as e:
            raise InvalidRequest(f"{self.peer} (put {tensor}): {e}") from None
        extra = {"saving": True} if saving else {}
        # when it was sent: a copy of it that reaches the daemon late never replaces a newer one
        self.call("put", frames=frames, job=job, version=version, tensor=tensor, part=part,
                  shape=shape, dtype=name, sent=time.time(), **extra, **about)

    def put_many(self, job: str, version: int,
                 items: Sequence[tuple[str, str, np.ndarray, str | None]]) -> None:
        """Upload several small sub-tensors ``(tensor, part, array, dtype)``
        into a staging version (as :meth:`put` each), in as few requests as
        the wire's limits allow (payload frames and bytes a request)."""
        about: list[list[Any]] = []
        frames: list[Any] = []
        size = 0

        def send() -> None:
            try:
                check_size([0, *(memoryview(f).nbytes for f in frames)])
            except InvalidRequest as e:
                raise InvalidRequest(f"{self.peer} (put of {len(about)} sub-tensors): "
                                     f"{e}") from None
            self.call("put_many", frames=frames, job=job, version=version, items=about,
                      sent=time.time())

        for tensor, part, array, dtype in items:
            shape, name, mine = _payload(array, dtype)
            n = sum(memoryview(f).nbytes for f in mine)
            if frames and (len(frames) + len(mine) > max_frames() or size + n > max_request()):
                send()
                about, frames, size = [], [], 0
            about.append([tensor, part, shape, name, len(mine)])
            frames += mine
            size += n
        if frames:
            send()

    def close(self) -> None:
        """Close the idle sockets; sockets busy in a call close when it ends.
        The client stays usable (new calls open new sockets)."""
        with self._lock:
            idle, self._idle = self._idle, []
            if isinstance(self._channel, Channel):
                idle += self._channel.idle
                self._channel.idle = []
            self._generation += 1
        for s in idle:
            s.close(0)


#: How long :func:`key_refused` waits for a handshake's outcome.
HANDSHAKE_WAIT_S = 0.5
#: Addresses whose daemon completed a handshake with this process's keys, and when.
_admitted: dict[str, float] = {}


def key_refused(ctx: zmq.Context[Any], address: str, curve: CurveKeys) -> bool:
    """Whether the daemon at ``address`` refuses ``curve``'s client key: a
    CurveZMQ handshake there fails for authentication (ZAP says no) within
    HANDSHAKE_WAIT_S. False when it succeeds, is not done by then (a busy or
    stopped daemon), or was done in the last PROBE_EVERY_S."""
    if time.monotonic() - _admitted.get(address, -math.inf) < PROBE_EVERY_S:
        return False
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = curve.server_public
    s.curve_publickey = curve.client_public
    s.curve_secretkey = curve.client_secret
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        s.connect(address)
        deadline = time.monotonic() + HANDSHAKE_WAIT_S
        while (left := deadline - time.monotonic()) > 0 and mon.poll(int(left * 1000) + 1):
            event = recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                _admitted[address] = time.monotonic()
                return False
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return True
        return False
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


_bulk: list[zmq.Context[Any]] = []
_bulk_lock = threading.Lock()


def _bulk_context() -> zmq.Context[Any]:
    """The ZeroMQ context (one I/O thread) of this process's big requests."""
    with _bulk_lock:
        if not _bulk:
            _bulk.append(zmq.Context(io_threads=1))
        return _bulk[0]


def probe(address: str) -> bool | None:
    """Whether anything listens at ``address`` (``tcp://HOST:PORT``): False
    when the kernel there refuses a TCP connection, as it does at once for
    a port whose daemon has exited, so that a call need not wait out a
    liveness ping to know it; True when a connection is made (a stopped or
    busy daemon still has its socket), and without asking when one was made
    there in the last PROBE_EVERY_S; None when none comes within
    PROBE_AFTER_S, or the address is not TCP. A refusal is remembered
    (``_refusals``) until a connection is made there."""
    if not address.startswith("tcp://"):
        return None
    if time.monotonic() - _listening.get(address, -math.inf) < PROBE_EVERY_S:
        return True
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_AFTER_S):
            pass
    except ConnectionRefusedError:
        _refusals[address] = time.monotonic()
        return False
    except (OSError, ValueError):
        return None
    # one dict operation each: atomic under the GIL
    _listening[address] = time.monotonic()
    _refusals.pop(address, None)
    return True


def came_back(address: str, since: float) -> bool:
    """Whether something listens at ``address`` again: a probe found it since
    ``since`` (``time.monotonic()``), or finds it now where the last one
    found nothing (a daemon started again since)."""
    if _listening.get(address, -math.inf) > since:
        return True
    return address in _refusals and probe(address) is True


def _saw_boot(address: str, result: Any) -> str:
    """Remember the ``boot`` a ping's ``result`` gives for ``address``; it ("" if none)."""
    boot = str(result.get("boot", "")) if isinstance(result, dict) else ""
    if boot:
        _boots[address] = boot  # one dict store: atomic under the GIL
    return boot


#: Opens payload frame ``i`` of a sealed reply: into a view (its size) or as bytes.
Opener = Callable[[int, memoryview, memoryview | None], Any]


def _opener(ch: Channel, id_: int, nframes: int) -> Opener:
    def open_frame(i: int, frame: memoryview, out: memoryview | None) -> Any:
        try:
            return ch.open_into(id_, i + 1, nframes + 1, frame, out)
        except InvalidTag:
            raise PeerError(f"a sealed reply frame that does not open ({ch.address}; damaged "
                            "or forged on the way)") from None
    return open_frame


def _land(frames: list[zmq.Frame], dest: Dest, what: str, unseal: Opener | None = None) -> int:
    """Copy a reply's payload frames into ``dest``, a writable byte view or
    an array of any strides (filled in C order), opening sealed frames with
    ``unseal`` (straight into ``dest`` where it is contiguous); the bytes
    landed."""
    views = [f.buffer for f in frames]
    sizes = [len(v) if unseal is None else Channel.plain_size(v) for v in views]
    total = sum(sizes)
    if total != dest.nbytes:
        raise PeerError(f"{what} sent {total} bytes; asked for {dest.nbytes}")
    if isinstance(dest, np.ndarray):
        plain = views if unseal is None else [unseal(i, v, None) for i, v in enumerate(views)]
        flat = plain[0] if len(plain) == 1 else b"".join(plain)
        dest[...] = np.frombuffer(flat, dtype=dest.dtype).reshape(dest.shape)
        return total
    pos = 0
    for i, (v, n) in enumerate(zip(views, sizes)):
        if unseal is None:
            dest[pos:pos + n] = v
        else:
            unseal(i, v, dest[pos:pos + n])
        pos += n
    return total


def _byte_view(out: Any, nbytes: int) -> memoryview:
    if out is None:
        return memoryview(bytearray(nbytes))
    try:
        view = memoryview(out).cast("B")
    except (TypeError, ValueError):
        raise InvalidRequest("out must be a contiguous buffer (bytearray, numpy array, "
                             "memoryview)") from None
    if view.readonly:
        raise InvalidRequest("out must be writable")
    if view.nbytes != nbytes:
        raise InvalidRequest(f"out holds {view.nbytes} bytes; the range is {nbytes}")
    return view


def _payload(array: np.ndarray, dtype: str | None) -> tuple[list[int], str, list[Any]]:
    """A sub-tensor to upload: its shape, ptcfs dtype name (``dtype``, else
    from the array's) and bytes as payload frames of at most put_frame()."""
    arr = np.ascontiguousarray(array).reshape(np.shape(array))  # 0-d stays 0-d
    flat = arr.reshape(-1).view(np.uint8)
    limit = put_frame(flat.size)
    frames: list[Any] = [flat[i:i + limit].data for i in range(0, flat.size, limit)] or [b""]
    return list(arr.shape), dtype or dtype_name(arr.dtype), frames


def on_each(fn: Callable[[T], None], items: Sequence[T]) -> None:
    """``fn(item)`` for each of ``items`` (hosts, mostly), all at once; one
    item in this thread, with no thread to start (a one-host call's cost
    would be mostly that). The first error raises."""
    if len(items) == 1:
        fn(items[0])
    elif items:
        with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
            for f in [pool.submit(fn, x) for x in items]:
                f.result()
