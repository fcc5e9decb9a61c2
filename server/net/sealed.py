"""The sealed channel: tensor reads between hosts at AES-GCM speed, under
the CurveZMQ channel's authentication.

Why. CurveZMQ encrypts every byte with XSalsa20-Poly1305 in one ZeroMQ I/O
thread per connection: about 0.5 GB/s on the development machine, a fifth
of plain TCP over loopback there, and about 4 Gb/s on a 100 Gb/s link.
AES-256-GCM with the CPU's AES instructions seals 5-9 GB/s per core. So
where a cluster has keys, the big replies (``read``, ``read_box``, ``read_boxes``:
the regions a reconfiguration fetches, peers' and mounts' reads) go over a
second daemon socket whose frames are sealed with AES-GCM; every other
request stays on the CURVE socket.

Sessions. A caller opens one over the CURVE socket (``bulk_open``), so
only an admitted key can: the daemon makes a random 256-bit key and a
16-byte session id, keeps them with the caller's key name and fingerprint,
and answers them with the port of its sealed socket (a ROUTER without
CURVE; ``PTC_BULK_PORT``, 0: any free port). Sessions live in the
daemon's memory, so a restart ends them.

On the sealed socket a request is ``[sid, sealed header]`` and its reply
``[sealed header, sealed payload]`` (the payload's pieces joined: a view
entry's reply may be thousands of rows); a sealed frame is a 12-byte nonce,
then the AES-GCM ciphertext and tag. Then:

- a nonce is a direction byte and a counter of the session: never twice
  under one key;
- the associated data binds each frame to its place: a request to its
  session; a reply's frames to the request id, their index and count. A
  frame moved to another reply, dropped or reordered does not open;
- only reads are served there, each authorised as on the CURVE socket
  with the session's key name and fingerprint: a key rotated or removed
  stops its sessions at once. A request whose counter was seen is dropped,
  so a replayed request is not served twice;
- a request that does not open is dropped and logged; one of a session the
  daemon does not know is answered ``[NO_SESSION]`` (unsealed: a forged
  one makes the caller open a new session, nothing more). The caller
  opens a new session and asks again, once, for what was not answered;
  so it does when a liveness ping shows another start of the daemon than
  the one that opened the session (its sealed port may have changed);
- the socket takes messages of at most :data:`MAX_SEALED_REQUEST` bytes.

``PTC_BULK=0`` keeps every request on the CURVE socket.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ptcfs import settings
from ptcfs.errors import InvalidRequest, NoSession

__all__ = ["BULK_OPS", "MAX_SEALED_REQUEST", "NO_SESSION", "Channel", "InvalidTag",
           "Session", "Sessions", "bulk_address", "sealing"]

#: Operations served on the sealed socket.
BULK_OPS = frozenset({"read", "read_box", "read_boxes"})
#: Bytes of one message the sealed socket accepts (a request's header).
MAX_SEALED_REQUEST = 8192
#: The daemon's answer to a request of a session it does not know.
NO_SESSION = b"ptcfs:no-session"
SID_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
_TO_DAEMON, _TO_CALLER = b"\x00", b"\x01"
#: Sessions a daemon keeps (each a few hundred bytes; a short-lived ptcctl opens one per host).
MAX_SESSIONS = 4096
#: Request counters a session remembers, to refuse replays.
_REPLAY_WINDOW = 4096
_PLACE = struct.Struct("<QII")  # request id, frame index, frame count




def sealing(curve: Any) -> bool:
    """Whether reads go over the sealed channel: the cluster has keys and
    ``PTC_BULK`` is on."""
    return curve is not None and bool(settings.get("PTC_BULK"))


def bulk_address(address: str, port: int) -> str:
    """``address`` (``tcp://HOST:PORT``) with its port replaced."""
    host, sep, _ = address.rpartition(":")
    if not sep or not host.startswith("tcp://"):
        raise InvalidRequest(f"cannot make a sealed channel's address from {address!r}")
    return f"{host}:{port}"


def _nonce(direction: bytes, counter: int) -> bytes:
    return direction + b"\0\0\0" + counter.to_bytes(8, "little")


def _reply_aad(sid: bytes, id_: int, index: int, count: int) -> bytes:
    return sid + _PLACE.pack(id_ & (2**64 - 1), index, count)


@dataclass
class Session:
    """One session's key and who opened it (daemon side)."""
    sid: bytes
    key: bytes
    name: str | None  # the CURVE key name of its opener
    fp: str
    aes: AESGCM = field(init=False, repr=False)
    _out: Any = field(default_factory=itertools.count, repr=False)
    _seen: set[int] = field(default_factory=set, repr=False)
    _floor: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.aes = AESGCM(self.key)

    def first_use(self, counter: int) -> bool:
        """Whether request counter ``counter`` is new (then it is seen)."""
        with self._lock:
            if counter <= self._floor or counter in self._seen:
                return False
            self._seen.add(counter)
            if len(self._seen) > _REPLAY_WINDOW:
                drop = sorted(self._seen)[:_REPLAY_WINDOW // 2]
                self._floor = drop[-1]
                self._seen.difference_update(drop)
            return True

    def seal_reply(self, id_: int | None, frames: list[Any]) -> list[bytes | memoryview]:
        """The reply ``[header, *payload]`` to request ``id_``, sealed: the
        header, and the payload as one frame (a view entry's reply may be
        thousands of small pieces: one seal of them joined is far cheaper)."""
        payload = [memoryview(f).cast("B") for f in frames[1:]]
        whole = [frames[0]] + ([] if not payload else
                               [payload[0] if len(payload) == 1 else b"".join(payload)])
        out: list[bytes | memoryview] = []
        for i, f in enumerate(whole):
            nonce = _nonce(_TO_CALLER, next(self._out))
            data = memoryview(f).cast("B")
            buf = np.empty(NONCE_BYTES + data.nbytes + TAG_BYTES, np.uint8).data
            buf[:NONCE_BYTES] = nonce
            # the header's place names no id (the caller learns it from the header)
            aad = _reply_aad(self.sid, (id_ or 0) if i else 0, i, len(whole))
            self.aes.encrypt_into(nonce, data, aad, buf[NONCE_BYTES:])
            out.append(buf.tobytes() if data.nbytes < 4096 else buf)
        return out


class Sessions:
    """The daemon's sessions, by id: at most :data:`MAX_SESSIONS`, the one
    used longest ago making room for a new one (its caller gets NO_SESSION
    at its next read, and opens another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: OrderedDict[bytes, Session] = OrderedDict()

    def new(self, name: str | None, fp: str) -> Session:
        s = Session(os.urandom(SID_BYTES), AESGCM.generate_key(bit_length=256), name, fp)
        with self._lock:
            self._by_id[s.sid] = s
            while len(self._by_id) > MAX_SESSIONS:
                self._by_id.popitem(last=False)
        return s

    def __len__(self) -> int:
        return len(self._by_id)

    def open_request(self, frames: list[Any]) -> tuple[Session, bytes]:
        """The session and the plain header of a sealed request
        ``[sid, sealed]``; NoSession for an unknown session, InvalidRequest
        for one that does not open or was seen before."""
        if len(frames) != 2:
            raise InvalidRequest(f"a sealed request has 2 frames, not {len(frames)}")
        sid, sealed = bytes(frames[0]), memoryview(frames[1]).cast("B")
        with self._lock:
            session = self._by_id.get(sid)
            if session is not None:
                self._by_id.move_to_end(sid)
        if session is None:
            raise NoSession("unknown session")
        if sealed.nbytes < NONCE_BYTES + TAG_BYTES or \
                bytes(sealed[:4]) != _TO_DAEMON + b"\0\0\0":
            raise InvalidRequest("a sealed request that does not open")
        try:
            header = session.aes.decrypt(bytes(sealed[:NONCE_BYTES]), sealed[NONCE_BYTES:], sid)
        except InvalidTag:
            raise InvalidRequest("a sealed request that does not open") from None
        if not session.first_use(int.from_bytes(sealed[4:NONCE_BYTES], "little")):
            raise InvalidRequest("a sealed request seen before (a replay)")
        return session, header


class Channel:
    """The caller's side of a session: seals requests, opens replies, and
    keeps the idle sockets connected to the daemon's sealed socket."""

    def __init__(self, address: str, sid: bytes, key: bytes, boot: str = ""):
        self.address = address
        self.sid = sid
        #: the daemon's ``boot`` when the session opened: another one there has not got it
        self.boot = boot
        self.aes = AESGCM(key)
        self.idle: list[zmq.Socket[Any]] = []
        self._out = itertools.count()

    def seal_request(self, header: bytes) -> list[bytes]:
        nonce = _nonce(_TO_DAEMON, next(self._out))
        return [self.sid, nonce + self.aes.encrypt(nonce, header, self.sid)]

    def open_header(self, parts: list[zmq.Frame]) -> bytes:
        """The plain header of a reply; NoSession when the daemon does not
        know the session, InvalidTag when it does not open."""
        first = parts[0].buffer
        if len(parts) == 1 and first == NO_SESSION:
            raise NoSession("the daemon does not know this session (it restarted)")
        return self._open(first, _reply_aad(self.sid, 0, 0, len(parts)), None)

    def open_into(self, id_: int, index: int, count: int, frame: memoryview,
                  out: memoryview | None) -> bytes | int:
        """Open payload frame ``index`` of ``count`` of the reply to ``id_``:
        into ``out`` (exactly its plain size; returns that size) or as bytes."""
        return self._open(frame, _reply_aad(self.sid, id_, index, count), out)

    def _open(self, frame: memoryview, aad: bytes, out: memoryview | None) -> Any:
        if len(frame) < NONCE_BYTES + TAG_BYTES:
            raise InvalidTag
        nonce, body = bytes(frame[:NONCE_BYTES]), frame[NONCE_BYTES:]
        if nonce[:1] != _TO_CALLER:
            raise InvalidTag
        if out is None:
            return self.aes.decrypt(nonce, body, aad)
        return self.aes.decrypt_into(nonce, body, aad, out)

    @staticmethod
    def plain_size(frame: memoryview) -> int:
        return len(frame) - NONCE_BYTES - TAG_BYTES


def open_session(call: Callable[..., Any], address: str) -> Channel:
    """A new session with the daemon that ``call`` (a CURVE-channel call)
    reaches at ``address``."""
    r = call("bulk_open")
    return Channel(bulk_address(address, int(r["port"])), bytes(r["sid"]), bytes(r["key"]),
                   str(r.get("boot", "")))
