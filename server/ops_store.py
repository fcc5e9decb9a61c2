"""Daemon operations on the host's own store: health, listing, reads, writes.

Every handler checks its arguments (``_arg``) and raises ptcfs errors; the
daemon turns them into error replies.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np

from ptcfs.errors import InvalidRequest
from ptcfs.server.daemon import Daemon, daemon_op
from ptcfs.server.executor import read_box
from ptcfs.server.wire import MAX_PAYLOAD, PROTOCOL_VERSION, Request

__all__: list[str] = []


def _arg(req: Request, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in req.args:
        if default is ...:
            raise InvalidRequest(f"{req.op}: missing argument {name!r}")
        return default
    value = req.args[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise InvalidRequest(f"{req.op}: argument {name!r} has the wrong type")
    return value


def _box(req: Request) -> tuple[tuple[int, int], ...]:
    raw = _arg(req, "box", list)
    try:
        box = tuple((int(a), int(b)) for a, b in raw)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{req.op}: box must be a list of [start, stop] pairs") from None
    return box


@daemon_op("ping")
def ping(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    return {"host": d.host_id}, []


@daemon_op("health")
def health(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    return {"host": d.host_id, "pid": os.getpid(), "uptime_s": round(time.time() - d.started, 1),
            "protocol": PROTOCOL_VERSION, "address": d.host.address,
            "store": d.store.stats()}, []


@daemon_op("counters")
def counters(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    peers = set(d.sent) | set(d.received)
    return {p: {"sent": d.sent.get(p, 0), "received": d.received.get(p, 0)} for p in peers}, []


@daemon_op("jobs")
def jobs(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    return {j: d.store.current(j) for j in d.store.jobs()}, []


@daemon_op("versions")
def versions(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    job = _arg(req, "job", str)
    return [{"version": v.version, "state": v.state, "meta": v.meta}
            for v in d.store.versions(job)], []


@daemon_op("entries")
def entries(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    es = d.store.entries(_arg(req, "job", str), _arg(req, "version", int))
    return [{"tensor": e.tensor, "part": e.part, "shape": list(e.shape), "dtype": e.dtype,
             "nbytes": e.nbytes} for e in es], []


@daemon_op("info")
def info(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    e = d.store.info(_arg(req, "job", str), _arg(req, "version", int),
                     _arg(req, "tensor", str), _arg(req, "part", str))
    return {"shape": list(e.shape), "dtype": e.dtype, "nbytes": e.nbytes}, []


@daemon_op("read")
def read(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """Bytes ``[offset, offset+length)`` of an entry, at most MAX_PAYLOAD."""
    length = _arg(req, "length", int)
    if not 0 <= length <= MAX_PAYLOAD:
        raise InvalidRequest(f"read: length must be 0..{MAX_PAYLOAD}; read big ranges in pieces")
    with d.store.reader() as r:
        data = r.read(_arg(req, "job", str), _arg(req, "version", int), _arg(req, "tensor", str),
                      _arg(req, "part", str), _arg(req, "offset", int, 0), length)
    return None, [data]


@daemon_op("read_box")
def read_box_op(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """The C-order bytes of a box of an entry, at most MAX_PAYLOAD."""
    box = _box(req)
    arr = read_box(d.store, _arg(req, "job", str), _arg(req, "version", int),
                   _arg(req, "tensor", str), _arg(req, "part", str), box)
    if arr.nbytes > MAX_PAYLOAD:
        raise InvalidRequest(f"read_box: {arr.nbytes} bytes is more than {MAX_PAYLOAD}; "
                             "ask for smaller boxes")
    return None, [memoryview(arr.reshape(-1).view(np.uint8))]


@daemon_op("begin_at")
def begin_at(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    d.store.begin_at(_arg(req, "job", str), _arg(req, "version", int),
                     _arg(req, "meta", dict, None))
    return None, []


@daemon_op("put")
def put(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    if len(req.frames) != 1:
        raise InvalidRequest("put: needs exactly one payload frame")
    shape = _arg(req, "shape", list)
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise InvalidRequest("put: shape must be a list of whole numbers")
    d.store.put(_arg(req, "job", str), _arg(req, "version", int), _arg(req, "tensor", str),
                _arg(req, "part", str), memoryview(req.frames[0]), tuple(shape),
                _arg(req, "dtype", str))
    return None, []


@daemon_op("commit")
def commit(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    d.store.commit(_arg(req, "job", str), _arg(req, "version", int), _arg(req, "meta", dict, None))
    return None, []


@daemon_op("abort")
def abort(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    from ptcfs.server.ops_reconfig import cancel_stage

    job, version = _arg(req, "job", str), _arg(req, "version", int)
    cancel_stage(d, job, version)
    d.store.abort(job, version)
    return None, []


@daemon_op("delete_version")
def delete_version(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    d.store.delete_version(_arg(req, "job", str), _arg(req, "version", int))
    return None, []


@daemon_op("digest")
def digest(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """sha256 of every entry of a version: ``{"tensor\\0part": hex}``."""
    job, version = _arg(req, "job", str), _arg(req, "version", int)
    out = {}
    with d.store.reader() as r:
        for e in d.store.entries(job, version):
            h = hashlib.sha256()
            for view in r.ranges(job, version, e.tensor, e.part):
                h.update(view)
            out[f"{e.tensor}\0{e.part}"] = h.hexdigest()
    return out, []
