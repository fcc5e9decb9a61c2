"""Daemon operation ``open_save``: open the job's next version for writing.

Called by ``ptcctl``/the client (:func:`ptcfs.client.control.saving.begin_save`) or
by this host's mount when a rank's state is written into it. The daemon
asks every host of the cluster for the job's versions; if a save is open
already (a staging version marked ``saving``, newer than the current one)
it answers with that version, else it opens the next unused version number
on every host that answers, with the current version's record. Two hosts
opening at once agree: ``begin_at`` of the same version is idempotent, and
a save found open on some hosts is begun on those that answer without it
(an ``open_save`` on another host may still be on its way to them), so the
version answered is open here and wherever a writer may put. On one host,
opens take turns. An
open save whose configuration is no longer the current one (a
reconfiguration committed since, under another number) is aborted first:
its bytes are in the old layout, and would otherwise be committed under
the new one wherever their keys match.

With ``step`` (a writer saving that step), nothing is opened once the job
has committed the step (on any host: a commit under way counts): the answer
is the committed version, ``committed`` true. A rank with nothing of its
own to put (a data-parallel replica) may come after rank 0 has committed
the save it belongs to, and must not open the next one, which no commit
would end.

Writers put into the version with ``saving`` (the mount does): a put is
refused (JobBusy: write again) once the version is no longer open for
saving, also when a reconfiguration dropped the save and took its number
for its own version, which would otherwise commit the writer's bytes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ptcfs.errors import JobBusy, JobNotFound, PeerError, PtcError
from ptcfs.jobstate import SAVE_MARK
from ptcfs.server.daemon import Daemon
from ptcfs.server.net.wire import Request
from ptcfs.server.ops.common import abort_version, arg, daemon_op
from ptcfs.server.ops.store import begin_version

__all__ = ["SAVE_MARK"]

log = logging.getLogger("ptcd.save")

#: One open at a time on this host: a second waits until the first has
#: begun its version on every host, instead of answering it half-begun.
_OPEN_LOCK = threading.Lock()


def _versions(d: Daemon, host: str, job: str) -> list[dict[str, Any]]:
    if host == d.host_id:
        return [{"version": v.version, "state": v.state, "meta": v.meta}
                for v in d.store.versions(job)]
    answer: list[dict[str, Any]] = d.peer(host).call("versions", job=job)
    return answer


def _drop(d: Daemon, job: str, stale: list[tuple[str, int]]) -> None:
    """Abort saves begun under another configuration than the current one
    (``(host, version)`` each; a reconfiguration committed since, under
    another version number): what they hold is the old layout's, and must
    not be committed under the new."""
    for h, version in stale:
        log.info("version %d of %s on %s was saved under an older configuration: dropped",
                 version, job, h)
        try:
            if h == d.host_id:
                abort_version(d, job, version)
            else:
                d.peer(h).call("abort", job=job, version=version)
        except PtcError as e:  # dropped at the next save instead
            log.warning("dropping version %d of %s on %s: %s", version, job, h, e)


@daemon_op("open_save")
def open_save(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    job = arg(req, "job", str)
    step = arg(req, "step", int, None)
    with _OPEN_LOCK:
        return _open(d, job, step), []


def _open(d: Daemon, job: str, step: int | None) -> dict[str, Any]:
    seen: dict[str, list[dict[str, Any]]] = {}
    for h in d.cluster.names:
        try:
            seen[h] = _versions(d, h, job)
        except PeerError:
            continue  # a host that is down: it aborts leftover staging when it returns
    committed = {v["version"]: v["meta"] for vs in seen.values() for v in vs
                 if v["state"] == "committed"}
    if not committed:
        raise JobNotFound(f"no host has a committed version of job {job!r}")
    current = max(committed)
    if step is not None and int(committed[current].get("step", 0)) >= step:
        return {"version": current, "opened": False, "committed": True}
    saves = [(h, v["version"], v["meta"]) for h, vs in seen.items() for v in vs
             if v["state"] == "staging" and v["meta"].get(SAVE_MARK) and v["version"] > current]
    stale = [(h, n) for h, n, meta in saves
             if meta.get("config") != committed[current].get("config")]
    if stale:
        _drop(d, job, stale)
    opened = {n: meta for h, n, meta in saves if (h, n) not in stale}
    if opened:
        version = max(opened)
        has = {h for h, n, _ in saves if n == version}
        _begin(d, job, version, opened[version], [h for h in seen if h not in has])
        return {"version": version, "opened": False, "committed": False}
    version = max(v["version"] for vs in seen.values() for v in vs) + 1
    _begin(d, job, version, {**committed[current], "version": version, SAVE_MARK: True},
           list(seen))
    return {"version": version, "opened": True, "committed": False}


def _begin(d: Daemon, job: str, version: int, meta: dict[str, Any], hosts: list[str]) -> None:
    """Begin the save ``version`` on ``hosts`` (idempotent where it is begun)."""
    failed: dict[str, PtcError] = {}
    for h in hosts:
        try:
            if h == d.host_id:
                begin_version(d, job, version, meta)
            else:
                d.peer(h).call("begin_at", job=job, version=version, meta=meta)
        except PtcError as e:
            failed[h] = e
    if failed:
        # a reconfiguration staging the number everywhere it failed: busy (EAGAIN), not an error
        kind = JobBusy if all(isinstance(e, JobBusy) for e in failed.values()) else PeerError
        raise kind("opening a save failed on " + "; ".join(f"{h}: {e}" for h, e in
                                                          sorted(failed.items())))
