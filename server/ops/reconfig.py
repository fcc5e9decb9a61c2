"""Daemon operations of a reconfiguration: ``stage`` and ``stage_status``.

``stage`` is phase one of the coordinator's two-phase protocol (see
:mod:`ptcfs.client.control.coordinator`). The coordinator has called ``begin_at``
for the new version; ``stage`` starts building, in the background, every
sub-tensor the host must hold in it (:func:`ptcfs.server.executor.execute`),
fetching remote regions from the peers the plan names, and answers at once.
The coordinator then asks ``stage_status`` until the state is ``done`` or
``failed``, and sends ``commit`` or ``abort``; with ``wait`` (seconds, at
most MAX_WAIT_S) the answer comes as soon as the stage ends, or after that
long with the bytes done so far.

An ``abort`` (or ``delete_job``) cancels a stage wherever it is
(:func:`cancel_stage`): the stage's flag wakes a fetch waiting on a peer,
dead or slow, and no put runs after it; the stage is forgotten at once,
so a new stage of the same version can start as soon as ``abort``
returns. A fetch from a peer that stops answering fails in a few seconds
(the liveness pings of :class:`~ptcfs.server.net.peer.PeerClient`), and with
it the stage, naming that peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ptcfs.errors import InvalidRequest, PtcError
from ptcfs.plan.stagework import decode
from ptcfs.server.daemon import Daemon
from ptcfs.server.executor import CancelFlag, Fetch, FetchMany, execute
from ptcfs.server.net.wire import Request
from ptcfs.server.ops.common import arg, daemon_op
from ptcfs.types import Box

__all__: list[str] = []

log = logging.getLogger("ptcd.stage")

#: The longest a ``stage_status`` call may wait for the stage to end.
MAX_WAIT_S = 1.0


@dataclass
class StageJob:
    state: str = "running"  # running, done, failed
    bytes: int = 0
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    cancel: CancelFlag = field(default_factory=CancelFlag)
    ended: threading.Event = field(default_factory=threading.Event)


@daemon_op("stage")
def stage(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    job = arg(req, "job", str)
    old_v, new_v = arg(req, "old_version", int), arg(req, "new_version", int)
    work = decode(d.host_id, req.args)
    key = (job, new_v)
    running = d.stages.get(key)
    if running is not None and running.state == "running":
        raise InvalidRequest(f"a stage of {job!r} version {new_v} is running already")
    sj = d.stages[key] = StageJob()

    fetch, fetch_many = peer_fetches(d, sj, staging_of=new_v)

    def advance(nbytes: int) -> None:
        sj.bytes += nbytes
        sj.cancel.check()

    def run() -> None:
        try:
            t0 = time.perf_counter()
            r = execute(d.store, d.host_id, job, old_v, new_v, work, fetch,
                        progress=advance, pool=d.buffers, cancel=sj.cancel,
                        fetch_many=fetch_many)
            wall = time.perf_counter() - t0
            d.metrics.stage_seconds.observe(wall)
            sj.result = {"tensors": r.tensors, "local_bytes": r.local_bytes,
                         "viewed_bytes": r.viewed_bytes,
                         "received": dict(r.received),
                         "seconds": {"wall": round(wall, 4),
                                     **{k: round(v, 4) for k, v in r.seconds.items()}}}
            sj.state = "done"
        except Exception as e:  # reported to the coordinator through stage_status
            if not isinstance(e, PtcError):
                log.exception("stage of %s version %d failed", job, new_v)
            sj.error = f"{type(e).__name__}: {e}"
            sj.state = "failed"
        finally:
            sj.ended.set()

    threading.Thread(target=run, name=f"stage-{job}-{new_v}", daemon=True).start()
    return {"started": True}, []


def peer_fetches(d: Daemon, sj: StageJob, staging_of: int | None = None,
                 before: Callable[[int], None] | None = None) -> tuple[Fetch, FetchMany]:
    """The executor's ``fetch`` and ``fetch_many`` for the stage ``sj``:
    from the daemon's peers, ended by the stage's cancel flag, counted as
    received. ``before(nbytes)`` runs first (default: the flag's check);
    reads of version ``staging_of`` may find it staging on the peer (a
    save's bytes, copied to their replicas before the commit)."""
    check = before or (lambda _: sj.cancel.check())

    def fetch(host: str, job: str, version: int, tensor: str, part: str, box: Box,
              itemsize: int, out: np.ndarray) -> memoryview:
        check(out.nbytes)
        data = d.peer(host).read_box(job, version, tensor, part, box, itemsize, out,
                                     cancel=sj.cancel.event, staging=version == staging_of)
        d.count(host, received=data.nbytes)
        return data

    def fetch_many(host: str, job: str, version: int, boxes: list[tuple[str, str, Box]],
                   out: np.ndarray) -> None:
        check(out.nbytes)
        d.peer(host).read_boxes(job, version, boxes, out, cancel=sj.cancel.event,
                                staging=version == staging_of)
        d.count(host, received=out.nbytes)

    return fetch, fetch_many


@daemon_op("stage_status")
def stage_status(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    sj = d.stages.get((arg(req, "job", str), arg(req, "version", int)))
    wait = req.args.get("wait", 0)
    if not isinstance(wait, int | float) or isinstance(wait, bool) or wait < 0:
        raise InvalidRequest(f"stage_status: wait must be a number of seconds >= 0, not {wait!r}")
    if sj is not None and wait:
        sj.ended.wait(min(float(wait), MAX_WAIT_S))
    if sj is None:
        return {"state": "unknown", "bytes": 0, "error": "", "result": {}}, []
    return {"state": sj.state, "bytes": sj.bytes, "error": sj.error, "result": sj.result}, []

