"""The ptcd wire protocol (version 1), over ZeroMQ multipart messages.

A client's DEALER sends a request ``[header, *payload]``; the header is a
msgpack map::

    {"v": 1, "id": <int>, "op": <str>, "from": <caller host id or "ctl">, "args": {...}}

The daemon's ROUTER answers with ``[header, *payload]``::

    {"v": 1, "id": <the request's id, or None if it had none>, "ok": <bool>,
     "result": <msgpack value>,
     "error": None | {"type": <ptcfs error class name>, "message": <str>}}

Rules:

- Tensor bytes travel only as payload frames, never inside msgpack; both
  sides send them with ``copy=False``.
- A reply carries at most :data:`MAX_PAYLOAD` payload bytes. Big ranges are
  read as several requests with offsets, a few in flight at once
  (:meth:`ptcfs.server.net.peer.PeerClient.read_into`), so a 1 GB read is many
  small replies and other callers' requests are served in between.
- A request whose header is broken gets an error reply with ``id`` None
  when the daemon can answer it, or is dropped and logged; the daemon keeps
  serving. A reply's ``error.type`` names a :mod:`ptcfs.errors` class, which
  the client raises again (TensorNotFound stays TensorNotFound).
- ``from`` is the caller's host id; the daemon counts payload bytes per
  caller with it (the ``counters`` operation).
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from ptcfs import errors, settings
from ptcfs.errors import InvalidRequest, PeerError, PtcError

__all__ = [
    "check_size",
    "max_frame",
    "max_frames",
    "max_request",
    "MAX_HEADER",
    "MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "Request",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "error_from_wire",
]

PROTOCOL_VERSION = 1
#: Bytes of one msgpack header (either direction).
MAX_HEADER = 1 << 20
#: Payload bytes of one reply: the largest chunk a read returns.
MAX_PAYLOAD = 16 << 20


def max_frame() -> int:
    """Bytes of any one frame (``PTC_WIRE_MAX_FRAME``, at most 1 GiB; tests
    lower it): the daemon's socket refuses bigger frames before they are
    read (ZMQ_MAXMSGSIZE; ZeroMQ drops the connection), and clients cut a
    put's bytes into frames of this size."""
    return int(settings.get("PTC_WIRE_MAX_FRAME"))


def max_frames() -> int:
    """Payload frames of one request (``PTC_WIRE_MAX_FRAMES``)."""
    return int(settings.get("PTC_WIRE_MAX_FRAMES"))


def max_request() -> int:
    """Payload bytes of one request (``PTC_WIRE_MAX_REQUEST_BYTES``): a
    ``put`` of a bigger sub-tensor is refused."""
    return int(settings.get("PTC_WIRE_MAX_REQUEST_BYTES"))


def check_size(sizes: list[int]) -> None:
    """InvalidRequest unless a request whose frames (header first) have
    ``sizes`` bytes is within the limits above. The daemon checks this
    before a request is queued, so a refused one is freed at once."""
    if not sizes:
        raise InvalidRequest("empty message")
    if sizes[0] > MAX_HEADER:
        raise InvalidRequest(f"header of {sizes[0]} bytes exceeds {MAX_HEADER}")
    count, limit, total = len(sizes) - 1, max_frame(), sum(sizes[1:])
    if count > max_frames():
        raise InvalidRequest(f"{count + 1} frames exceeds {max_frames() + 1} (a header and "
                             f"at most {max_frames()} payload frames: PTC_WIRE_MAX_FRAMES)")
    if count and max(sizes[1:]) > limit:
        raise InvalidRequest(f"a payload frame of {max(sizes[1:])} bytes exceeds {limit} "
                             "(PTC_WIRE_MAX_FRAME)")
    if total > max_request():
        raise InvalidRequest(f"payload of {total} bytes exceeds {max_request()} "
                             "(PTC_WIRE_MAX_REQUEST_BYTES)")


_OP = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_MAX_CALLER = 128
T = TypeVar("T")


@dataclass
class Request:
    """A decoded, checked request: what a handler receives.

    ``frames`` are the payload frames (zmq.Frame or buffers); ``caller`` is
    the ``from`` host id (what the caller says), ``key`` its key's name
    (what CurveZMQ proved). A handler that replies with buffers borrowed from
    something that must stay open (a store reader's memoryviews) opens it
    with :meth:`hold`; the daemon closes it once ZeroMQ has sent the reply.
    """

    id: int
    op: str
    caller: str
    args: dict[str, Any]
    frames: list[Any] = field(default_factory=list)
    held: ExitStack = field(default_factory=ExitStack, repr=False)
    holding: bool = False
    #: the name of the CurveZMQ key that sent it (:mod:`ptcfs.server.auth`; None: no keys)
    key: str | None = None
    #: that key's fingerprint (:func:`ptcfs.server.auth.fingerprint`; "": no keys)
    fp: str = ""
    #: whether it came over the sealed channel (:mod:`ptcfs.server.net.sealed`)
    sealed: bool = False

    def hold(self, resource: AbstractContextManager[T]) -> T:
        """Enter ``resource`` and keep it open until the reply is sent."""
        self.holding = True
        return self.held.enter_context(resource)


def _unpack(raw: bytes | memoryview, what: str) -> Any:
    if len(raw) > MAX_HEADER:
        raise InvalidRequest(f"{what} of {len(raw)} bytes exceeds {MAX_HEADER}")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many kinds: ExtraData, ValueError, TypeError ...
        raise InvalidRequest(f"malformed msgpack {what}: {type(e).__name__}: {e}") from None


def _pack(obj: dict[str, Any]) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequest(f"cannot encode {obj.get('op') or 'reply'}: {e} "
                             "(arguments and results must be msgpack values)") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def encode_request(id_: int, op: str, caller: str, args: dict[str, Any]) -> bytes:
    """The header frame of a request (payload frames follow it)."""
    return _pack({"v": PROTOCOL_VERSION, "id": id_, "op": op, "from": caller, "args": args})


def decode_request(frames: list[Any]) -> Request:
    """Parse and check a request ``[header, *payload]``; InvalidRequest says
    what is wrong (the daemon sends that back)."""
    check_size([_buffer(f).nbytes for f in frames])
    h = _unpack(_buffer(frames[0]), "header")
    if not isinstance(h, dict):
        raise InvalidRequest(f"header is a {type(h).__name__}, not a map")
    if h.get("v") != PROTOCOL_VERSION:
        raise InvalidRequest(f"protocol version {h.get('v')!r} is not supported "
                             f"(this daemon speaks {PROTOCOL_VERSION})")
    id_, op, caller, args = h.get("id"), h.get("op"), h.get("from", "?"), h.get("args", {})
    if not isinstance(id_, int) or isinstance(id_, bool) or not 0 <= id_ < 1 << 63:
        raise InvalidRequest("header needs id (int >= 0), op (str), from (str), args (map); "
                             f"id is {id_!r}")
    if not isinstance(op, str) or not _OP.match(op):
        raise InvalidRequest(f"header needs op as a lower-case name, not {op!r}")
    if not isinstance(caller, str) or not 0 < len(caller) <= _MAX_CALLER:
        raise InvalidRequest(f"header 'from' must be the caller's host id (text), "
                             f"not {caller!r:.80}")
    if not isinstance(args, dict):
        raise InvalidRequest(f"header args must be a map, not {type(args).__name__}")
    return Request(id_, op, caller, args, list(frames[1:]))


def encode_reply(id_: int | None, result: Any = None, error: BaseException | None = None) -> bytes:
    """The header frame of a reply: ``result``, or ``error`` (a ptcfs error
    keeps its class name; anything else travels as PtcError)."""
    err = None
    if error is not None:
        kind = type(error).__name__ if isinstance(error, PtcError) else "PtcError"
        err = {"type": kind, "message": str(error)}
    try:
        return _pack({"v": PROTOCOL_VERSION, "id": id_, "ok": error is None,
                      "result": result, "error": err})
    except InvalidRequest as e:  # a handler returned something msgpack cannot hold
        return _pack({"v": PROTOCOL_VERSION, "id": id_, "ok": False, "result": None,
                      "error": {"type": "PtcError", "message": f"internal error: {e}"}})


def decode_reply(raw: bytes | memoryview) -> dict[str, Any]:
    """Parse and check a reply header; PeerError if it is not one."""
    try:
        h = _unpack(raw, "reply header")
    except InvalidRequest as e:
        raise PeerError(str(e)) from None
    if not isinstance(h, dict) or h.get("v") != PROTOCOL_VERSION:
        raise PeerError(f"not a protocol {PROTOCOL_VERSION} reply: {h!r:.100}")
    ok, id_, err = h.get("ok"), h.get("id"), h.get("error")
    if not isinstance(ok, bool) or not (id_ is None or _is_int(id_)):
        raise PeerError(f"malformed reply header (ok={ok!r:.20}, id={id_!r:.20})")
    if not ok and not (isinstance(err, dict) and isinstance(err.get("type"), str)
                       and isinstance(err.get("message"), str)):
        raise PeerError(f"malformed error in a reply: {err!r:.100}")
    return h


def error_from_wire(err: dict[str, Any], where: str) -> PtcError:
    """The ptcfs error a reply names, re-created on this side with
    ``where`` (host and op) in front of the message."""
    kind = getattr(errors, str(err.get("type")), None)
    message = f"{where}: {err.get('message')}"
    if isinstance(kind, type) and issubclass(kind, PtcError):
        return kind(message)
    return PeerError(message)


def _buffer(frame: Any) -> memoryview:
    """The bytes of a received frame (zmq.Frame or any buffer), not copied."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)
