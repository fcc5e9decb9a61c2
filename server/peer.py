"""Client side of the ptcd protocol: one daemon, seen from another process.

``PeerClient`` keeps one DEALER socket per thread, so it may be shared by
threads. Each call sends a request and waits for the reply with the same id
(replies to calls that timed out earlier are dropped). Large reads are cut
into requests of at most ``MAX_PAYLOAD`` bytes, ``PIPELINE`` of them in
flight at once, and land in the caller's buffer.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import zmq

from ptcfs.errors import PeerError
from ptcfs.server.keys import CurveKeys
from ptcfs.server.wire import (
    MAX_PAYLOAD,
    decode_reply,
    encode_request,
    error_from_wire,
)
from ptcfs.types import Box

__all__ = ["PeerClient", "PIPELINE", "split_box"]

PIPELINE = 4


def split_box(box: Box, itemsize: int, limit: int = MAX_PAYLOAD) -> Iterator[Box]:
    """Cut a box into boxes of at most ``limit`` bytes, in C order."""
    size = itemsize
    for a, b in box:
        size *= max(b - a, 0)
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
    """Requests to one daemon at ``address``."""

    def __init__(self, address: str, *, host_id: str = "ctl", curve: CurveKeys | None = None,
                 timeout_s: float | None = 60.0, peer_name: str | None = None,
                 context: zmq.Context[Any] | None = None):
        self.address = address
        self.host_id = host_id
        self.curve = curve
        self.timeout_s = timeout_s
        self.peer = peer_name or address
        self._ctx = context or zmq.Context.instance()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._sockets: list[zmq.Socket[Any]] = []
        self._lock = threading.Lock()
        self.received = 0

    def _socket(self) -> zmq.Socket[Any]:
        s = getattr(self._local, "sock", None)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                s.curve_serverkey = self.curve.server_public
                s.curve_publickey = self.curve.client_public
                s.curve_secretkey = self.curve.client_secret
            s.connect(self.address)
            self._local.sock = s
            with self._lock:
                self._sockets.append(s)
        return s

    def _reset(self) -> None:
        s = getattr(self._local, "sock", None)
        if s is not None:
            with self._lock:
                if s in self._sockets:
                    self._sockets.remove(s)
            s.close(0)
            self._local.sock = None

    def _send(self, op: str, args: dict[str, Any], frames: list[Any] | None = None) -> int:
        id_ = next(self._ids)
        self._socket().send_multipart(
            [encode_request(id_, op, self.host_id, args), *(frames or [])], copy=False)
        return id_

    def _recv(self, ids: set[int], op: str) -> tuple[int, Any, list[zmq.Frame]]:
        s = self._socket()
        timeout = None if self.timeout_s is None else int(self.timeout_s * 1000)
        while True:
            if not s.poll(timeout):
                self._reset()
                raise PeerError(f"{self.peer} did not answer {op!r} within {self.timeout_s} s "
                               f"({self.address})", timed_out=True)
            parts = s.recv_multipart(copy=False)
            h = decode_reply(parts[0].buffer)
            if h.get("id") not in ids:
                continue  # a late reply to an earlier, timed-out call
            if not h["ok"]:
                raise error_from_wire(h.get("error") or {}, f"{self.peer} ({op})")
            return h["id"], h.get("result"), parts[1:]

    def call(self, op: str, frames: list[Any] | None = None, **args: Any) -> Any:
        """Send ``op`` with ``args``; the reply's result (remote errors re-raised)."""
        result, _ = self.call_frames(op, frames, **args)
        return result

    def call_frames(self, op: str, frames: list[Any] | None = None,
                    **args: Any) -> tuple[Any, list[zmq.Frame]]:
        id_ = self._send(op, args, frames or [])
        _, result, out = self._recv({id_}, op)
        return result, out

    def put(self, job: str, version: int, tensor: str, part: str, array: np.ndarray,
            dtype: str) -> None:
        """Upload one sub-tensor into a staging version."""
        arr = np.ascontiguousarray(array)
        self.call("put", frames=[arr.reshape(-1).view(np.uint8).data], job=job,
                  version=version, tensor=tensor, part=part, shape=list(arr.shape), dtype=dtype)

    def read_box(self, job: str, version: int, tensor: str, part: str, box: Box,
                 itemsize: int | None = None, out: memoryview | None = None) -> memoryview:
        """The C-order bytes of a box of a sub-tensor, fetched in pipelined chunks,
        written into ``out`` when given (it must hold exactly the box's bytes)."""
        if itemsize is None:
            info = self.call("info", job=job, version=version, tensor=tensor, part=part)
            itemsize = info["nbytes"] // max(1, int(np.prod(info["shape"]))) or 1
        pieces = list(split_box(tuple((int(a), int(b)) for a, b in box), itemsize))
        sizes = [itemsize * int(np.prod([b - a for a, b in p])) for p in pieces]
        if out is None:
            out = memoryview(bytearray(sum(sizes)))
        elif out.nbytes != sum(sizes):
            raise PeerError(f"read_box: buffer of {out.nbytes} bytes for a box of {sum(sizes)}")
        offsets = list(itertools.accumulate([0] + sizes[:-1]))
        pending: dict[int, int] = {}
        nxt = 0
        while nxt < len(pieces) or pending:
            while nxt < len(pieces) and len(pending) < PIPELINE:
                id_ = self._send("read_box", {"job": job, "version": version, "tensor": tensor,
                                              "part": part, "box": [list(b) for b in pieces[nxt]]})
                pending[id_] = nxt
                nxt += 1
            id_, _, frames = self._recv(set(pending), "read_box")
            i = pending.pop(id_)
            data = frames[0].buffer if frames else memoryview(b"")
            if len(data) != sizes[i]:
                raise PeerError(f"{self.peer} sent {len(data)} bytes for a box of {sizes[i]}")
            out[offsets[i]:offsets[i] + sizes[i]] = data
            self.received += sizes[i]
        return out

    def close(self) -> None:
        with self._lock:
            for s in self._sockets:
                s.close(0)
            self._sockets.clear()
        self._local = threading.local()
