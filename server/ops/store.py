"""Daemon operations on the host's own store: health, listing, reads, writes.

Every handler checks its arguments with :func:`arg` and raises ptcfs
errors; the daemon turns them into error replies. Reads answer with
memoryviews of a store reader opened through ``req.hold`` (zero-copy: the
daemon closes the reader once ZeroMQ has sent them), at most
``MAX_PAYLOAD`` bytes per reply; clients ask for big ranges in pieces
(:meth:`ptcfs.server.net.peer.PeerClient.read_into`).

Writing a version, in order: ``begin_at`` (the coordinator picks the
version number for every host), ``put`` per sub-tensor, then ``commit`` or
``abort``; ``delete_version`` drops an old committed version.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import os
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from ptcfs.boxes import contiguous_range
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidRequest, JobBusy, PtcError, StoreDamaged
from ptcfs.fuse.warming import read_status
from ptcfs.jobstate import SAVE_MARK
from ptcfs.server.daemon import Daemon
from ptcfs.server.net.wire import MAX_PAYLOAD, PROTOCOL_VERSION, Request
from ptcfs.server.ops.common import OPS, Reply, abort_version, arg, cancel_stage, daemon_op
from ptcfs.store.base import PutEntry, Reader
from ptcfs.store.boxes import gather_box
from ptcfs.types import Box

__all__ = ["begin_version"]

log = logging.getLogger("ptcd.store")


#: Boxes one ``read_boxes`` request may name.
MAX_BOXES = 4096




def _box(req: Request, raw: Any = ...) -> Box:
    """The box a request names: its ``box`` argument, or ``raw``."""
    raw = arg(req, "box", list) if raw is ... else raw
    if not isinstance(raw, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in raw):
        raise InvalidRequest(f"{req.op}: box must be a list of [start, stop] integer pairs")
    return tuple((a, b) for a, b in raw)


def _key(req: Request) -> tuple[str, int, str, str]:
    return arg(req, "job", str), arg(req, "version", int), arg(req, "tensor", str), \
        arg(req, "part", str)


@daemon_op("ping")
def ping(d: Daemon, req: Request) -> Reply:
    """The host's name, ``boot``: new at each start of the daemon, and
    ``up_s``: seconds since that start (a caller tells from it whether the
    daemon started after its request was sent, with no clock shared)."""
    return {"host": d.host_id, "boot": d.boot, "up_s": time.monotonic() - d.up_since}, []


@daemon_op("health")
def health(d: Daemon, req: Request) -> Reply:
    return {"host": d.host_id, "pid": os.getpid(), "uptime_s": round(time.time() - d.started, 1),
            "protocol": PROTOCOL_VERSION, "address": d.host.address, "workers": d.workers,
            "ops": sorted(OPS), "store": d.store.stats(), "making_room": d.making_room,
            # what is wrong with the store's file under the daemon (deleted...), or None
            "store_problem": d.store.check_file(),
            "request_bytes_held": d.held_bytes,
            # the sealed channel's port (None: none) and the sessions it keeps
            "sealed": {"port": d.bulk_port, "sessions": len(d.sessions)},
            "stage_buffers_bytes": d.buffers.kept_bytes,
            "stage_buffers_largest": d.buffers.largest,
            # the cyclic collector: objects frozen at start-up, passes per generation
            "gc": {"frozen": gc.get_freeze_count(),
                   "collections": [g["collections"] for g in gc.get_stats()]},
            # the state of this host's mount (warming), None where none runs
            "mount": read_status(d.host.store)}, []


@daemon_op("counters")
def counters(d: Daemon, req: Request) -> Reply:
    """Payload bytes ``{peer: {"sent", "received"}}`` since the daemon started."""
    return d.counters(), []


@daemon_op("jobs")
def jobs(d: Daemon, req: Request) -> Reply:
    """``{job: current version or None}`` (none where the data file was cut
    short: as ``versions``, such a host holds nothing it can serve)."""
    try:
        return {j: d.store.current(j) for j in d.store.jobs()}, []
    except StoreDamaged:
        return {}, []


@daemon_op("versions")
def versions(d: Daemon, req: Request) -> Reply:
    """The job's versions on this host, with their records; ``committed_after``
    (a version): only the committed ones newer than it (a daemon catching up,
    :func:`ptcfs.server.ops.registry.catch_up`: mostly none)."""
    job = arg(req, "job", str)
    after = arg(req, "committed_after", int, None)
    _release(d)
    out = []
    try:
        held = d.store.versions(job)
        if after is not None:
            held = [v for v in held if v.state == "committed" and v.version > after]
        # entries a scrub quarantined, by version: this host's copies of them are gone
        damaged = Counter(e.version for e in d.store.damaged() if e.job == job) if held \
            else Counter()
    except StoreDamaged:  # its data file was cut short: no copy here can be read, so
        return [], []     # it holds none (health says why; repair asks for a fresh store)
    for v in held:
        info = {"version": v.version, "state": v.state, "meta": v.meta}
        if damaged[v.version]:
            info["damaged"] = damaged[v.version]
        readers = d.pins.readers(job, v.version)
        if readers:
            info["readers"] = readers
            info["deleting"] = d.pins.doomed(job, v.version)
        out.append(info)
    return out, []


@daemon_op("entries")
def entries(d: Daemon, req: Request) -> Reply:
    es = d.store.entries(arg(req, "job", str), arg(req, "version", int))
    return [{"tensor": e.tensor, "part": e.part, "shape": list(e.shape), "dtype": e.dtype,
             "nbytes": e.nbytes, "written": e.written} for e in es], []


@daemon_op("bulk_open")
def bulk_open(d: Daemon, req: Request) -> Reply:
    """A session of the sealed channel for the caller's key
    (:mod:`ptcfs.server.net.sealed`): ``{sid, key, port}``. Only on the CURVE
    socket, so only an admitted key gets one."""
    if d.bulk_port is None:
        raise InvalidRequest("this daemon has no sealed channel (no keys, or PTC_BULK=0)")
    if req.sealed:
        raise InvalidRequest("bulk_open is asked on the CURVE socket")
    s = d.sessions.new(req.key, req.fp)
    return {"sid": s.sid, "key": s.key, "port": d.bulk_port, "boot": d.boot}, []


@daemon_op("info")
def info(d: Daemon, req: Request) -> Reply:
    e = d.store.info(*_key(req))
    return {"shape": list(e.shape), "dtype": e.dtype, "nbytes": e.nbytes}, []


def _committed_reader(d: Daemon, req: Request, job: str, version: int) -> Reader:
    """A snapshot of the store, held for the reply, in which the version a
    read names is committed. A staging version of that number is someone
    else's bytes (a stage or roll-forward under way, a save that a
    reconfiguration dropped): the reader is told VersionNotCommitted and tries
    another holder, never given them. Only a save's copy to its replicas
    reads a staging version (``staging``): the one its ranks wrote."""
    r = req.hold(d.store.reader())
    if not arg(req, "staging", bool, False):
        r.check_committed(job, version)
    return r


@daemon_op("read")
def read(d: Daemon, req: Request) -> Reply:
    """Bytes ``[offset, offset+length)`` of an entry (length at most
    MAX_PAYLOAD), as zero-copy views of the store, or one copy where they
    are many runs (a view's rows: :meth:`~ptcfs.store.base.Reader.gathered`)."""
    length = arg(req, "length", int)
    offset = arg(req, "offset", int, 0)
    if not 0 <= length <= MAX_PAYLOAD:
        raise InvalidRequest(f"read: length must be 0..{MAX_PAYLOAD}; read big ranges in pieces")
    key = _key(req)
    r = _committed_reader(d, req, key[0], key[1])
    return None, r.gathered(*key, offset, length)


@daemon_op("read_box")
def read_box_op(d: Daemon, req: Request) -> Reply:
    """The C-order bytes of a box of an entry, at most MAX_PAYLOAD: as
    ``read`` gives them when the box is one contiguous byte range, else one copy."""
    key = _key(req)
    r = _committed_reader(d, req, key[0], key[1])
    return None, _box_bytes(req, r, key, _box(req), MAX_PAYLOAD)


@daemon_op("read_boxes")
def read_boxes(d: Daemon, req: Request) -> Reply:
    """The C-order bytes of several boxes of entries of one version, one
    after another, at most MAX_PAYLOAD in all: ``boxes`` is a list of
    ``[tensor, part, box]``. A stage asks a peer for its small regions this
    way, many to a request, instead of one request each."""
    job, version = arg(req, "job", str), arg(req, "version", int)
    items = arg(req, "boxes", list)
    if len(items) > MAX_BOXES:
        raise InvalidRequest(f"read_boxes: {len(items)} boxes; at most {MAX_BOXES} to a request")
    r = _committed_reader(d, req, job, version)
    out: list[Any] = []
    left = MAX_PAYLOAD
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], str)):
            raise InvalidRequest("read_boxes: each of boxes is [tensor, part, box]")
        got = _box_bytes(req, r, (job, version, item[0], item[1]), _box(req, item[2]), left)
        left -= sum(memoryview(b).nbytes for b in got)
        out += got
    return None, out


def _box_bytes(req: Request, r: Reader, key: tuple[str, int, str, str], box: Box,
               most: int) -> list[Any]:
    """The C-order bytes of ``box`` of entry ``key`` (at most ``most``): as
    ``read`` gives them when the box is one contiguous byte range, else one copy."""
    e = r.info(*key)
    itemsize = numpy_dtype(e.dtype).itemsize
    nbytes = itemsize * math.prod(max(b - a, 0) for a, b in box)
    if nbytes > most:
        raise InvalidRequest(f"{req.op}: {nbytes} bytes is more than a reply holds ({most} of "
                             f"its {MAX_PAYLOAD} left); ask for smaller boxes")
    span = contiguous_range(box, e.shape, itemsize)
    if span is not None:
        return r.gathered(*key, span[0], span[1])
    out = np.empty(nbytes, dtype=np.uint8)
    gather_box(r, key, e.shape, itemsize, box, out)
    return [out.data]


@daemon_op("begin_at")
def begin_at(d: Daemon, req: Request) -> Reply:
    begin_version(d, arg(req, "job", str), arg(req, "version", int), arg(req, "meta", dict, None))
    return None, []


_BEGIN_LOCK = threading.Lock()


def begin_version(d: Daemon, job: str, version: int, meta: dict[str, Any] | None) -> None:
    """Begin a staging version (idempotent). A save and a reconfiguration
    never share one (a save that lost a race with a reconfiguration for a
    version number would have its writes committed as the old step): a
    version open for saving that is begun for something else loses what the
    save wrote first; a save never takes over a version staged for something
    else (JobBusy)."""
    with _BEGIN_LOCK:
        old = next((v for v in d.store.versions(job) if v.version == version), None)
        if meta is not None and old is not None and old.state == "staging" and \
                bool(old.meta.get(SAVE_MARK)) != bool(meta.get(SAVE_MARK)):
            if meta.get(SAVE_MARK):
                raise JobBusy(f"job {job!r} version {version} is being staged by a "
                              "reconfiguration: save again once it is done")
            log.info("version %d of %s was open for saving: its writes are dropped",
                     version, job)
            d.store.abort(job, version)
        d.store.begin_at(job, version, meta)


@daemon_op("put")
def put(d: Daemon, req: Request) -> Reply:
    """One sub-tensor into a staging version; its bytes are the payload
    frames, concatenated (a client sends one frame unless it exceeds max_frame()).
    With ``saving``: only into a version open for saving, else JobBusy (a
    reconfiguration dropped the save, maybe taking its version number).
    ``sent``: when the writer sent it, by its clock (the client's ``put``
    sets it): a put older than the entry already there is dropped."""
    if not req.frames:
        raise InvalidRequest("put: the sub-tensor's bytes must follow as payload frames")
    shape = arg(req, "shape", list)
    if not all(type(n) is int and n >= 0 for n in shape):
        raise InvalidRequest("put: shape must be a list of whole numbers")
    data = _joined(req.frames)
    # a save's put (``saving``) goes only into a version still open for saving
    mark = SAVE_MARK if arg(req, "saving", bool, False) else None
    d.store.put(*_key(req), data, tuple(shape), arg(req, "dtype", str), mark=mark,
                written=arg(req, "sent", float, None))
    return None, []


@daemon_op("put_many")
def put_many(d: Daemon, req: Request) -> Reply:
    """Several small sub-tensors of one version in one request (a rank's
    small save: one round trip instead of one a sub-tensor). ``items``:
    ``[tensor, part, shape, dtype, frames]`` each, whose bytes are the next
    ``frames`` payload frames, in order; each is put as by ``put``."""
    items = arg(req, "items", list)
    if not all(isinstance(i, list) and len(i) == 5 and isinstance(i[0], str)
               and isinstance(i[1], str) and isinstance(i[2], list)
               and all(type(n) is int and n >= 0 for n in i[2]) and isinstance(i[3], str)
               and type(i[4]) is int and i[4] >= 1 for i in items):
        raise InvalidRequest("put_many: items must be [tensor, part, shape, dtype, frames] each")
    if sum(i[4] for i in items) != len(req.frames):
        raise InvalidRequest(f"put_many: the items name {sum(i[4] for i in items)} payload "
                             f"frames, {len(req.frames)} came")
    job, version = arg(req, "job", str), arg(req, "version", int)
    mark = SAVE_MARK if arg(req, "saving", bool, False) else None
    sent = arg(req, "sent", float, None)
    entries, at = [], 0
    for tensor, part, shape, dtype, n in items:
        entries.append(PutEntry(tensor, part, _joined(req.frames[at:at + n]), tuple(shape),
                                dtype))
        at += n
    d.store.put_many(job, version, entries, mark=mark, written=sent)
    return None, []


def _joined(frames: list[Any]) -> memoryview:
    """A sub-tensor's bytes from its payload frames."""
    views = [memoryview(f) for f in frames]
    return views[0] if len(views) == 1 else memoryview(b"".join(views))


@daemon_op("commit")
def commit(d: Daemon, req: Request) -> Reply:
    job, version = arg(req, "job", str), arg(req, "version", int)
    meta = arg(req, "meta", dict, None)
    with d.metrics.commit_seconds.time():
        d.store.commit(job, version, meta)
    return None, []


@daemon_op("abort")
def abort(d: Daemon, req: Request) -> Reply:
    abort_version(d, arg(req, "job", str), arg(req, "version", int))
    return None, []


@daemon_op("delete_version")
def delete_version(d: Daemon, req: Request) -> Reply:
    """Drop an old committed version; deferred while a file of it is open on
    this host's mount (:mod:`ptcfs.server.pins`): it goes when the last
    reader closes."""
    job, version = arg(req, "job", str), arg(req, "version", int)
    if d.pins.defer(job, version):
        return {"deferred": True}, []
    d.store.delete_version(job, version)
    return {"deferred": False}, []


@daemon_op("pins")
def pins(d: Daemon, req: Request) -> Reply:
    """The versions whose files a mount of this host (process ``owner``)
    has open: ``[[store job, version, open files], ...]``, the whole set."""
    owner = arg(req, "owner", int)
    held: dict[tuple[str, int], int] = {}
    for item in arg(req, "pins", list):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and all(type(n) is int and n >= 0 for n in item[1:])):
            raise InvalidRequest("pins: each pin must be [job, version, open files]")
        held[(item[0], item[1])] = item[2]
    for key in d.pins.set(owner, held):
        _delete_deferred(d, key)
    return None, []


def _release(d: Daemon) -> None:
    """Deferred deletions whose readers' mounts are gone."""
    for key in d.pins.released():
        _delete_deferred(d, key)


def _delete_deferred(d: Daemon, key: tuple[str, int]) -> None:
    d.pins.forget(key)
    try:
        d.store.delete_version(*key)
    except PtcError:
        pass  # deleted already, or current again: nothing to drop


@daemon_op("delete_job")
def delete_job(d: Daemon, req: Request) -> Reply:
    """Drop every version of a job (cancelling its stages first)."""
    job = arg(req, "job", str)
    for v in d.store.versions(job):
        if v.state != "committed":
            cancel_stage(d, job, v.version)
    return {"versions": d.store.delete_job(job)}, []


@daemon_op("make_room")
def make_room(d: Daemon, req: Request) -> Reply:
    """Have the store make room for the next version, in the background
    (see :mod:`ptcfs.server.daemon`); ``health`` says when it is done."""
    d.want_room()
    return {"making_room": d.making_room}, []


@daemon_op("digest")
def digest(d: Daemon, req: Request) -> Reply:
    """sha256 of every entry of a version: ``{"tensor\\0part": hex}``."""
    job, version = arg(req, "job", str), arg(req, "version", int)
    out = {}
    with d.store.reader() as r:
        for e in d.store.entries(job, version):
            h = hashlib.sha256()
            for view in r.ranges(job, version, e.tensor, e.part):
                h.update(view)
            out[f"{e.tensor}\0{e.part}"] = h.hexdigest()
    return out, []
