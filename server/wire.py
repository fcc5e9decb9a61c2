"""The ptcd wire protocol (version 1), over ZeroMQ multipart messages.

A request is ``[header, *payload]``; the header is a msgpack map::

    {"v": 1, "id": <int>, "op": <str>, "from": <host id or "ctl">, "args": {...}}

A reply is ``[header, *payload]`` with the header::

    {"v": 1, "id": <the request's id>, "ok": <bool>, "result": ...,
     "error": None | {"type": <ptcfs error class name>, "message": <str>}}

Tensor bytes travel only as payload frames, never inside msgpack, and are
sent with ``copy=False``. One reply carries at most ``MAX_PAYLOAD`` bytes:
a client reads big ranges as several requests (see ``PeerClient.read``),
so a large transfer never blocks the small requests of others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from ptcfs import errors
from ptcfs.errors import InvalidRequest, PtcError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_HEADER",
    "MAX_FRAMES",
    "MAX_PAYLOAD",
    "Request",
    "encode_request",
    "decode_request",
    "encode_reply",
    "decode_reply",
    "error_from_wire",
]

PROTOCOL_VERSION = 1
MAX_HEADER = 1 << 20  # bytes of one msgpack header
MAX_FRAMES = 64  # payload frames of one message
MAX_PAYLOAD = 8 << 20  # bytes of payload in one reply (a chunk)
MAX_REQUEST_PAYLOAD = 1 << 30  # bytes a put may upload in one request


@dataclass
class Request:
    """A decoded request."""

    id: int
    op: str
    caller: str
    args: dict[str, Any]
    frames: list[Any] = field(default_factory=list)


def _unpack(raw: bytes | memoryview) -> Any:
    if len(raw) > MAX_HEADER:
        raise InvalidRequest(f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    try:
        return msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except Exception as e:
        raise InvalidRequest(f"malformed msgpack header: {e}") from None


def encode_request(id_: int, op: str, caller: str, args: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "id": id_, "op": op, "from": caller,
                          "args": args}, use_bin_type=True)


def decode_request(frames: list[Any]) -> Request:
    """Parse and check a request; InvalidRequest says what is wrong."""
    if not frames:
        raise InvalidRequest("empty message")
    if len(frames) > MAX_FRAMES + 1:
        raise InvalidRequest(f"{len(frames)} frames exceeds {MAX_FRAMES + 1}")
    h = _unpack(frames[0])
    if not isinstance(h, dict):
        raise InvalidRequest("header is not a map")
    if h.get("v") != PROTOCOL_VERSION:
        raise InvalidRequest(f"protocol version {h.get('v')!r} is not supported "
                             f"(this daemon speaks {PROTOCOL_VERSION})")
    id_, op, caller, args = h.get("id"), h.get("op"), h.get("from", "?"), h.get("args", {})
    if not isinstance(id_, int) or not isinstance(op, str) or not isinstance(args, dict) \
            or not isinstance(caller, str):
        raise InvalidRequest("header needs id (int), op (str), from (str), args (map)")
    size = sum(len(f) for f in frames[1:])
    if size > MAX_REQUEST_PAYLOAD:
        raise InvalidRequest(f"payload of {size} bytes exceeds {MAX_REQUEST_PAYLOAD}")
    return Request(id_, op, caller, args, list(frames[1:]))


def encode_reply(id_: int | None, result: Any = None, error: BaseException | None = None) -> bytes:
    err = None
    if error is not None:
        kind = type(error).__name__ if isinstance(error, PtcError) else "PtcError"
        err = {"type": kind, "message": str(error)}
    return msgpack.packb({"v": PROTOCOL_VERSION, "id": id_, "ok": error is None,
                          "result": result, "error": err}, use_bin_type=True)


def decode_reply(raw: bytes | memoryview) -> dict[str, Any]:
    h = _unpack(raw)
    if not isinstance(h, dict) or h.get("v") != PROTOCOL_VERSION or "ok" not in h:
        raise InvalidRequest("malformed reply header")
    return h


def error_from_wire(err: dict[str, Any], where: str) -> PtcError:
    """The ptcfs error a reply names, re-created on this side."""
    kind = getattr(errors, str(err.get("type")), None)
    message = f"{where}: {err.get('message')}"
    if isinstance(kind, type) and issubclass(kind, PtcError):
        return kind(message)
    return errors.PeerError(message)
