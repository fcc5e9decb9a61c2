"""Daemon operations of a reconfiguration: ``stage`` and its progress.

``stage`` is phase one of the coordinator's two-phase protocol (see
:mod:`ptcfs.client.coordinator`): the coordinator has already called
``begin_at`` for the new version; this builds every sub-tensor the host
must hold in it (:func:`ptcfs.server.executor.execute`), fetching remote
regions from the peers the plan names. ``commit`` or ``abort`` follow.
"""

from __future__ import annotations

from typing import Any

from ptcfs.server.daemon import Daemon, daemon_op
from ptcfs.server.executor import DstTensor, Move, execute
from ptcfs.server.ops_store import _arg
from ptcfs.server.wire import Request

from ptcfs.errors import InvalidRequest
from ptcfs.types import Box

__all__: list[str] = []


def _box(raw: Any) -> Box:
    return tuple((int(a), int(b)) for a, b in raw)


@daemon_op("stage")
def stage(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    job = _arg(req, "job", str)
    old_v, new_v = _arg(req, "old_version", int), _arg(req, "new_version", int)
    try:
        dst = [DstTensor(str(t), str(p), tuple(int(n) for n in shape), str(dt))
               for t, p, shape, dt in _arg(req, "dst", list)]
        moves = [Move(str(sh), str(st), str(sp), _box(sb), str(dt), str(dp), _box(db))
                 for sh, st, sp, sb, dt, dp, db in _arg(req, "moves", list)]
    except (TypeError, ValueError):
        raise InvalidRequest("stage: malformed dst or moves lists") from None
    key = (job, new_v)
    d.progress[key] = 0

    def fetch(host: str, job: str, version: int, tensor: str, part: str, box: Box) -> bytearray:
        data = d.peer(host).read_box(job, version, tensor, part, box)
        d.count(host, received=len(data))
        return data

    def advance(nbytes: int) -> None:
        d.progress[key] += nbytes

    result = execute(d.store, d.host_id, job, old_v, new_v, dst, moves, fetch, progress=advance)
    return {"tensors": result.tensors, "local_bytes": result.local_bytes,
            "received": dict(result.received)}, []


@daemon_op("stage_progress")
def stage_progress(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    return d.progress.get((_arg(req, "job", str), _arg(req, "version", int)), 0), []
