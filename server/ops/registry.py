"""Daemon operations of the registry (:mod:`ptcfs.server.net.registry`), and the
reconciler that rolls this host's staging versions forward or back.

Operations:

- ``lock_job`` (job, holder, ttl_s): grant the job's lock to ``holder`` if no
  one else holds it (or the other's lease has run out), renewing it when
  ``holder`` holds it already; answers ``{"granted", "holder"}``. A file
  registry takes a job's lock on a majority of hosts this way.
- ``unlock_job`` (job, holder), ``lock_holder`` (job).
- ``decide`` (record): the coordinator's decision on a job (job, old and
  new version, hosts, the new version's record), kept in the store's
  directory (``decisions.json``) so that it outlives a restart;
  ``decision`` (job) answers it (None: none); ``forget_decision`` (job)
  drops it (the job was deleted: a job made again under its name starts
  at version 1, and an old decision must not commit its versions).

The reconciler (a daemon thread, every ``PTC_RECONCILE_S``) looks at each
job with a staging version on this host: a decision for that version (this
host's own, or the registry's) → commit it with the decision's record; none,
a registry whose decisions are atomic, a version this daemon staged, and no
coordinator holding the job's lock → abort it. Saves still open (their
record says so: ``SAVE_MARK``) are never aborted by it: the ranks' writes
wait there for ``ptcctl commit``; nor are repairs (``REPAIR_MARK``), which
their driving daemon aborts itself.

The catch-up (a daemon thread, every ``PTC_CATCH_UP_S``) brings this host
forward when the cluster went on without it: for each job it holds, it asks
one other host in turn (``versions`` with ``committed_after``: its committed
versions newer than this host's newest, mostly none). A newer one of the same
job (its identity) that gives this host no copies (a reconfiguration or a
repair made while this host was down, out of its ring) → its record is
committed here (a staging version of that number that is another, a save
this host had open while down, goes first), and this host's mount shows it as
the job's current version, reading its bytes from its holders. One that
gives this host copies it lacks is left to a repair (``ptcctl verify`` names
it). The next command that reads the job's state does the same
(:meth:`~ptcfs.client.control.coordinator.Coordinator.state`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ptcfs import settings
from ptcfs.errors import InvalidRequest, PtcError, StoreDamaged
from ptcfs.jobstate import SAVE_MARK, JobState, same_version
from ptcfs.server.daemon import Daemon
from ptcfs.server.net.peer import PeerClient
from ptcfs.server.net.registry import save_decisions
from ptcfs.server.net.wire import Request
from ptcfs.server.ops.common import abort_version, arg, cancel_stage, daemon_op, daemon_task
from ptcfs.server.ops.repair import QUICK_TIMEOUT_S, REPAIR_MARK
from ptcfs.server.ops.store import begin_version

__all__ = ["reconcile", "catch_up", "Peers"]

log = logging.getLogger("ptcd.registry")

Reply = tuple[Any, list[Any]]
_locks_guard = threading.Lock()


@daemon_op("lock_job")
def lock_job(d: Daemon, req: Request) -> Reply:
    job, holder = arg(req, "job", str), arg(req, "holder", str)
    ttl = arg(req, "ttl_s", (int, float))
    if not 0 < ttl <= 3600:
        raise InvalidRequest(f"lock_job: ttl_s must be in (0, 3600], not {ttl!r}")
    now = time.monotonic()
    with _locks_guard:
        held = d.locks.get(job)
        if held is None or held[1] < now or held[0] == holder:
            d.locks[job] = (holder, now + ttl)
            return {"granted": True, "holder": holder}, []
        return {"granted": False, "holder": held[0]}, []


@daemon_op("unlock_job")
def unlock_job(d: Daemon, req: Request) -> Reply:
    job, holder = arg(req, "job", str), arg(req, "holder", str)
    with _locks_guard:
        if d.locks.get(job, ("",))[0] == holder:
            del d.locks[job]
    return None, []


@daemon_op("lock_holder")
def lock_holder(d: Daemon, req: Request) -> Reply:
    job = arg(req, "job", str)
    with _locks_guard:
        held = d.locks.get(job)
    return (held[0] if held is not None and held[1] >= time.monotonic() else None), []


@daemon_op("decide")
def decide(d: Daemon, req: Request) -> Reply:
    record = arg(req, "record", dict)
    if not isinstance(record.get("job"), str) or type(record.get("new")) is not int:
        raise InvalidRequest("decide: the record needs a job (text) and a new version")
    with d.decisions_lock:
        d.decisions[record["job"]] = record
        save_decisions(d.host.store, d.decisions, record["job"])
    return None, []


@daemon_op("forget_decision")
def forget_decision(d: Daemon, req: Request) -> Reply:
    """Drop the job's decision (the job is deleted, or made anew)."""
    with d.decisions_lock:
        if d.decisions.pop(arg(req, "job", str), None) is not None:
            save_decisions(d.host.store, d.decisions)
    return None, []


@daemon_op("decision")
def decision(d: Daemon, req: Request) -> Reply:
    with d.decisions_lock:
        return d.decisions.get(arg(req, "job", str)), []


def reconcile(d: Daemon) -> list[str]:
    """One pass of the reconciler; what it did, one line each."""
    done = []
    for job in d.store.jobs():
        # saves still open are the writers' and the next commit's, repairs their
        # driver's (it aborts its own): never aborted here
        saves = {v.version for v in d.store.versions(job)
                 if v.meta.get(SAVE_MARK) or v.meta.get(REPAIR_MARK)}
        staging = [v.version for v in d.store.versions(job) if v.state != "committed"]
        if not staging:
            continue
        with d.decisions_lock:
            rec = d.decisions.get(job)
        holder = None
        if d.registry.atomic and (rec is None or rec.get("new") not in staging):
            holder = d.registry.holder(job)  # first: a decision is written before release
            rec = d.registry.decision(job)
        for v in staging:
            if rec is not None and rec.get("new") == v and d.host_id in rec.get("hosts", ()):
                with d.metrics.commit_seconds.time():
                    d.store.commit(job, v, rec.get("meta"))
                done.append(f"committed {job} version {v} (decided by {rec.get('by', '?')})")
            elif d.registry.atomic and holder is None and (job, v) in d.stages \
                    and v not in saves:
                cancel_stage(d, job, v)
                d.store.abort(job, v)
                d.stages.pop((job, v), None)
                done.append(f"aborted {job} version {v}: no decision and no coordinator")
    for line in done:
        log.info("%s", line)
    return done


@daemon_task
def reconcile_loop(d: Daemon) -> None:
    """Run :func:`reconcile` every ``PTC_RECONCILE_S`` until the daemon closes."""
    while not d.closing.wait(float(settings.get("PTC_RECONCILE_S"))):
        try:
            d.refresh_hosts()
            reconcile(d)
        except PtcError as e:
            log.warning("could not reconcile staging versions: %s", e)


class Peers:
    """The other hosts of the cluster, one per :meth:`newer` in turn, asked
    with a quick timeout (a host that does not answer costs one call)."""

    def __init__(self, d: Daemon):
        self.d = d
        self.turn = 0
        self.clients: dict[str, PeerClient] = {}

    def newer(self, job: str, version: int) -> list[dict[str, Any]]:
        """The next host's committed versions of ``job`` newer than ``version``."""
        others = [h for h in self.d.cluster.names if h != self.d.host_id]
        if not others:
            return []
        host = others[self.turn % len(others)]
        self.turn += 1
        if host not in self.clients:
            spec = self.d.cluster.host(host)
            self.clients[host] = PeerClient(spec.address, host_id=self.d.host_id,
                                            curve=self.d.keys, timeout_s=QUICK_TIMEOUT_S,
                                            peer_name=host)
        try:
            answer: list[dict[str, Any]] = self.clients[host].call(
                "versions", job=job, committed_after=version)
            return answer
        except PtcError as e:
            log.debug("catch-up: %s did not answer for %s: %s", host, job, e)
            return []

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()


def catch_up(d: Daemon, peers: Peers) -> list[str]:
    """One pass of the catch-up (module docstring); what it did, one line each."""
    done: list[str] = []
    try:
        jobs = d.store.jobs()
    except StoreDamaged:  # nothing here can be read: a repair's (health says why)
        return done
    for job in jobs:
        if "@" in job:  # a dataset's store-job: its job's record says where it is
            continue
        try:
            line = _catch_up_job(d, peers, job)
        except PtcError as e:
            log.warning("could not catch up with job %s: %s", job, e)
            continue
        if line:
            log.info("%s", line)
            done.append(line)
    return done


def _catch_up_job(d: Daemon, peers: Peers, job: str) -> str | None:
    held = d.store.versions(job)
    committed = [v for v in held if v.state == "committed"]
    if not committed:
        return None
    mine = max(committed, key=lambda v: v.version)
    identity = str(mine.meta.get("identity") or "")
    newer = [v for v in peers.newer(job, mine.version)  # (a daemon of before
             # committed_after answers every version: the same filter here)
             if v["state"] == "committed" and v["version"] > mine.version
             and str(v["meta"].get("identity") or "") == identity]
    if not newer:
        return None
    meta = max(newer, key=lambda v: v["version"])["meta"]
    try:
        state = JobState.from_meta(meta)
    except InvalidRequest:
        return None  # not a job's record (a version put by hand, without one)
    if d.host_id in state.copy_hosts():
        return None  # it should hold copies: a repair's
    old = next((v for v in held if v.version == state.version), None)
    if old is not None and not same_version(old.meta, meta):
        abort_version(d, job, state.version)  # another's number: a save open while down
        old = None
    if old is None:
        begin_version(d, job, state.version, meta)
    d.store.commit(job, state.version, meta)
    return (f"took the record of {job} version {state.version}, made while this host was "
            "down; it holds no copies of it")


@daemon_task
def catch_up_loop(d: Daemon) -> None:
    """Run :func:`catch_up` every ``PTC_CATCH_UP_S`` (0: never) until the daemon closes."""
    period = float(settings.get("PTC_CATCH_UP_S"))
    if period <= 0:
        return
    peers = Peers(d)
    try:
        while not d.closing.wait(period):
            try:
                d.refresh_hosts()
                catch_up(d, peers)
            except PtcError as e:
                log.warning("could not catch up with the cluster: %s", e)
    finally:
        peers.close()
