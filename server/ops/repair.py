"""Daemon operations that restore lost copies: ``repair``, ``repair_stage``,
``repair_status``.

``repair`` (any live host; ``ptcctl repair`` asks the first live host of
the cluster file, and a membership service whose leases expire may ask any)
names a job, or none for every job the live hosts hold, and the hosts
declared lost. It answers at once; a thread of this daemon then drives the
repair of each job, in order:

1. ``versions`` of every host (hosts that do not answer within
   QUICK_TIMEOUT_S are lost too): the current committed version and its
   record. A newer staging version of a save or reconfiguration makes the
   repair fail (run it again afterwards); one of an earlier repair whose
   driver died is aborted.
2. ``entries`` of that version on every live host (one that answers
   without it, its store wiped or replaced, or whose entries a scrub
   quarantined, holds nothing or less, and gets copies), then
   :func:`ptcfs.plan.repair.plan_repair`. Nothing to do: the run ends here.
3. ``begin_at`` of the next version on every live host, with the new
   record (marked REPAIR_MARK).
4. ``repair_stage`` on every host of the new version: it builds the version
   from its own copies (shared with the old version) and fetches the new
   copies from their holders with the executor, at most ``PTC_REPAIR_RATE``
   bytes per second, in chunks of ``PTC_WIRE_CHUNK``.
5. ``repair_status`` of those hosts until all are done (the run's pieces
   and bytes left follow them) or one fails.
6. ``commit`` on every live host, unless a newer version was committed
   meanwhile, then ``delete_version`` of the committed versions older than
   the newest ``PTC_KEEP_VERSIONS``. Any failure before the commit:
   ``abort`` everywhere; the old version stays current and whole.

``repair_status`` answers the runs this daemon drives and the repair
stages it runs, with their pieces and bytes left (``ptcctl status``).

With an etcd registry the cluster heals itself (:func:`heal_loop`): a host
whose lease stays expired for ``PTC_HEAL_AFTER_S`` is lost, and the first
host that is up, in cluster order, starts the repair of every job for the
hosts lost, once per set of lost hosts.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from ptcfs import settings
from ptcfs.errors import InvalidRequest, JobNotFound, PeerError, PtcError
from ptcfs.jobstate import SAVE_MARK, JobState, drop_foreign, identity_of, split_foreign
from ptcfs.plan.repair import plan_repair
from ptcfs.plan.stagework import HostWork, decode, encode
from ptcfs.server.daemon import Daemon
from ptcfs.server.executor import execute
from ptcfs.server.net.peer import PeerClient, split_box
from ptcfs.server.net.wire import Request
from ptcfs.server.ops.common import arg, daemon_op, daemon_task
from ptcfs.server.ops.reconfig import StageJob, peer_fetches
from ptcfs.types import Box, Endpoint, Entry, Transfer

__all__ = ["REPAIR_MARK", "Pace", "RepairRun"]

log = logging.getLogger("ptcd.repair")

#: Key in a staging version's metadata that marks a version a repair builds.
REPAIR_MARK = "repairing"
#: Seconds a host has to answer a quick call before it counts as lost.
QUICK_TIMEOUT_S = 3.0
#: Seconds between two looks at the repair stages' progress.
POLL_S = 0.2


class Pace:
    """At most ``rate`` bytes per second over all callers (0: no limit):
    :meth:`take` waits until ``n`` more bytes may go, or ``stop`` is set."""

    def __init__(self, rate: float):
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int, stop: threading.Event) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        stop.wait(start - now)


@dataclass
class RepairStage(StageJob):
    """A repair stage on this host: a stage (so that ``abort`` cancels it)
    that counts its new copies."""

    job: str = ""
    version: int = 0
    pieces: int = 0
    pieces_done: int = 0
    bytes_total: int = 0


@dataclass
class RepairRun:
    """One job's repair, as the driving daemon sees it."""

    job: str
    lost: list[str]
    state: str = "running"  # running, done, nothing, failed
    error: str = ""
    error_type: str = ""  # the class in ptcfs.errors of the failure
    old_version: int = 0
    new_version: int = 0
    pieces: int = 0
    bytes: int = 0
    pieces_left: int = 0
    bytes_left: int = 0
    hosts: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    seconds: float = 0.0


#: Each daemon's repair runs, by job (kept while the daemon lives).
_RUNS: weakref.WeakKeyDictionary[Daemon, dict[str, RepairRun]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _runs(d: Daemon) -> dict[str, RepairRun]:
    with _LOCK:
        return _RUNS.setdefault(d, {})


def _claim(d: Daemon, jobs: list[str], lost: list[str]) -> list[str]:
    """The jobs of ``jobs`` that no run of this daemon repairs now, now claimed."""
    runs = _runs(d)
    with _LOCK:
        free = [j for j in jobs if j not in runs or runs[j].state != "running"]
        for j in free:
            runs[j] = RepairRun(j, lost)
    return free


@daemon_op("repair")
def repair(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """Start repairing ``job`` (None: every job) with ``lost`` hosts declared
    lost, fetching at most ``rate`` bytes/s per host (None: PTC_REPAIR_RATE)."""
    job = arg(req, "job", (str, type(None)), None)
    lost = arg(req, "lost", list, [])
    if not all(isinstance(h, str) for h in lost):
        raise InvalidRequest("repair: lost must be a list of host names")
    rate = arg(req, "rate", (int, type(None)), None)
    if rate is not None and rate < 0:
        raise InvalidRequest(f"repair: rate must be >= 0 bytes/s, not {rate}")
    return start_repairs(d, job, lost, rate), []


def start_repairs(d: Daemon, job: str | None, lost: list[str], rate: int | None
                  ) -> dict[str, Any]:
    """Start repairing ``job`` (None: every job the other hosts hold) in a
    thread of this daemon; the jobs started and their runs."""
    if rate is None:
        rate = int(settings.get("PTC_REPAIR_RATE"))
    if job is not None:
        jobs = [job]
    else:
        hosts = _Hosts(d)
        try:
            listed, _ = hosts.each([h for h in d.cluster.names if h not in lost], "jobs")
        finally:
            hosts.close()
        jobs = sorted({j for js in listed.values() for j in js if "@" not in j})
    started = _claim(d, jobs, sorted(lost))
    if started:
        threading.Thread(target=_drive, args=(d, started, rate), name="repair",
                         daemon=True).start()
    runs = _runs(d)
    return {"started": started, "runs": [asdict(runs[j]) for j in jobs if j in runs]}


def foreign_here(d: Daemon) -> list[str]:
    """The jobs this host holds under another identity than most hosts
    (:func:`ptcfs.jobstate.split_foreign`): a store from elsewhere."""
    hosts = _Hosts(d)
    try:
        out = []
        for job in d.store.jobs():
            if "@" in job:
                continue
            seen, _ = hosts.each(list(d.cluster.names), "versions", job=job)
            if d.host_id in split_foreign(seen)[1]:
                out.append(job)
        return out
    finally:
        hosts.close()


@daemon_task
def heal_loop(d: Daemon) -> None:
    """With an etcd registry, every ``PTC_RECONCILE_S``: hosts whose lease
    has been expired for ``PTC_HEAL_AFTER_S`` are lost; if this is the first
    host that is up, repair every job for them (again only when the set of
    lost hosts changes)."""
    down_since: dict[str, float] = {}
    healed: frozenset[str] = frozenset()
    while not d.closing.wait(float(settings.get("PTC_RECONCILE_S"))):
        if not d.registry.atomic:
            return
        try:
            members = d.registry.members()
        except PtcError as e:
            log.warning("could not read the registry's hosts: %s", e)
            continue
        now = time.monotonic()
        down = {m.host.name for m in members if m.up is False}
        down_since = {h: down_since.get(h, now) for h in down}
        healed &= down  # a host that came back may be lost again later
        after = float(settings.get("PTC_HEAL_AFTER_S"))
        lost = frozenset(h for h, t in down_since.items() if now - t >= after)
        up = [m.host.name for m in members if m.up]
        if not lost or lost <= healed or not up or up[0] != d.host_id:
            continue
        try:
            d.refresh_hosts()
            out = start_repairs(d, None, sorted(lost), None)
        except PtcError as e:
            log.warning("could not start the repair of %s: %s", ", ".join(sorted(lost)), e)
            continue
        healed = lost
        log.info("hosts %s are lost (lease expired %.0f s ago or more): repairing %s",
                 ", ".join(sorted(lost)), after, ", ".join(out["started"]) or "no job")


@daemon_op("repair_stage")
def repair_stage(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """Build a repair's version on this host: step 4 of the module docstring."""
    job = arg(req, "job", str)
    old_v, new_v = arg(req, "old_version", int), arg(req, "new_version", int)
    rate = arg(req, "rate", (int, float), 0)
    work = decode(d.host_id, req.args)
    key = (job, new_v)
    running = d.stages.get(key)
    if running is not None and running.state == "running":
        raise InvalidRequest(f"a stage of {job!r} version {new_v} is running already")
    local, remote = _split(work)
    sj = RepairStage(job=job, version=new_v, pieces=len(remote.entries),
                     bytes_total=sum(t.nbytes for t in remote.transfers))
    d.stages[key] = sj
    pace = Pace(float(rate))

    def before(nbytes: int) -> None:
        pace.take(nbytes, sj.cancel.event)
        if sj.cancel.is_set():
            raise PtcError("repair cancelled by abort")

    fetch, fetch_many = peer_fetches(d, sj, before=before)

    def copied(nbytes: int) -> None:
        sj.pieces_done += 1
        sj.bytes += nbytes
        if sj.cancel.is_set():
            raise PtcError("repair cancelled by abort")

    def run() -> None:
        try:
            execute(d.store, d.host_id, job, old_v, new_v, remote, fetch, progress=copied,
                    pool=d.buffers, cancel=sj.cancel, fetch_many=fetch_many)
            execute(d.store, d.host_id, job, old_v, new_v, local, fetch, pool=d.buffers,
                    cancel=sj.cancel)
            sj.state = "done"
        except Exception as e:  # reported through repair_status
            if not isinstance(e, PtcError):
                log.exception("repair stage of %s version %d failed", job, new_v)
            sj.error = f"{type(e).__name__}: {e}"
            sj.state = "failed"
        finally:
            sj.ended.set()

    threading.Thread(target=run, name=f"repair-{job}-{new_v}", daemon=True).start()
    return {"started": True}, []


def _split(work: HostWork) -> tuple[HostWork, HostWork]:
    """``work`` as its entries built from local copies, and those fetched
    (their transfers cut into chunks so that the pace holds)."""
    fetched = {(t.dst.tensor, t.dst.slice.key()) for t in work.transfers
               if t.src.host != work.host}
    chunk = int(settings.get("PTC_WIRE_CHUNK"))
    local: list[Entry] = []
    remote: list[Entry] = []
    moves: list[Transfer] = []
    for e in work.entries:
        (remote if (e.tensor, e.slice.key()) in fetched else local).append(e)
    for t in work.transfers:
        if t.src.host == work.host:
            continue
        itemsize = t.nbytes // max(1, _volume(t.dst.box))
        for b in split_box(t.dst.box, itemsize, chunk):
            moves.append(Transfer(Endpoint(t.src.host, -1, t.src.tensor, t.src.slice, b),
                                  Endpoint(work.host, -1, t.dst.tensor, t.dst.slice, b),
                                  itemsize * _volume(b)))
    keep = [t for t in work.transfers if t.src.host == work.host]
    return (HostWork(work.host, tuple(local), tuple(keep)),
            HostWork(work.host, tuple(remote), tuple(moves)))


def _volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


@daemon_op("repair_status")
def repair_status(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """The repairs this daemon drives and the repair stages it runs (of ``job``, or all)."""
    job = arg(req, "job", (str, type(None)), None)
    runs = [asdict(r) for j, r in sorted(_runs(d).items()) if job in (None, j)]
    stages = [{"job": s.job, "version": s.version, "state": s.state, "error": s.error,
               "pieces": s.pieces, "pieces_done": s.pieces_done, "bytes": s.bytes_total,
               "bytes_done": s.bytes}
              for s in list(d.stages.values())
              if isinstance(s, RepairStage) and job in (None, s.job)]
    return {"host": d.host_id, "runs": runs, "stages": stages}, []


# --- the driver ------------------------------------------------------------------------


class _Hosts:
    """Clients of every host of the cluster, for one run."""

    def __init__(self, d: Daemon):
        self.d = d
        self.quick: dict[str, PeerClient] = {}

    def ask(self, host: str, op: str, **args: Any) -> Any:
        """A quick call; PeerError when the host does not answer in time."""
        if host not in self.quick:
            spec = self.d.cluster.host(host)
            self.quick[host] = PeerClient(spec.address, host_id=self.d.host_id,
                                          curve=self.d.keys, timeout_s=QUICK_TIMEOUT_S,
                                          peer_name=host)
        return self.quick[host].call(op, **args)

    def each(self, hosts: list[str], op: str, quick: bool = True, **args: Any
             ) -> tuple[dict[str, Any], list[str]]:
        """``op`` on ``hosts``: answers, and the hosts that did not answer."""
        answers, down = {}, []
        for h in hosts:
            try:
                answers[h] = self.ask(h, op, **args) if quick else \
                    self.d.peer(h).call(op, **args)
            except PeerError as e:
                if not e.timed_out:
                    raise
                down.append(h)
        return answers, down

    def close(self) -> None:
        for c in self.quick.values():
            c.close()


def _drive(d: Daemon, jobs: list[str], rate: int) -> None:
    """Repair ``jobs`` (claimed by this daemon) one after the other."""
    hosts = _Hosts(d)
    try:
        for job in jobs:
            _repair_job(d, hosts, _runs(d)[job], rate)
    finally:
        hosts.close()


def _repair_job(d: Daemon, hosts: _Hosts, run: RepairRun, rate: int) -> None:
    t0 = time.perf_counter()
    live: list[str] = []
    new_version = 0
    try:
        names = [h for h in d.cluster.names if h not in run.lost]
        seen, down = hosts.each(names, "versions", job=run.job)
        live = [h for h in names if h in seen]
        # a host back with another job of this name (a store from elsewhere) holds
        # nothing of it: that job's versions go, and the host gets copies
        seen, foreign = split_foreign(seen)
        for h, op, version in drop_foreign(run.job, seen, foreign, hosts.ask):
            log.warning("%s held another job named %s (identity %s): %s %s", h, run.job,
                        identity_of(foreign[h][0]), op, version or "")
        state = _current(run.job, seen, live, hosts)
        have: dict[str, set[tuple[str, str]]] = {}
        for h in live:
            # a host that answers without the version (a store wiped, set aside or
            # another's) lost its copies: it holds nothing, and gets them again
            held = any(v["version"] == state.version and v["state"] == "committed"
                       for v in seen[h])
            have[h] = {(e["tensor"], e["part"]) for e in hosts.ask(
                h, "entries", job=run.job, version=state.version)} if held else set()
        rp = plan_repair(state, live, have, sorted(set(run.lost) | set(down)))
        run.old_version = state.version
        if rp is None:
            run.state = "nothing"
            return
        new_version = rp.new.version
        run.new_version, run.hosts = new_version, sorted(rp.work)
        run.pieces = run.pieces_left = len(rp.copies)
        run.bytes = run.bytes_left = rp.bytes
        run.lost = list(rp.new.lost)
        meta = rp.new.to_meta()
        hosts.each(live, "begin_at", quick=False, job=run.job, version=new_version,
                   meta={**meta, REPAIR_MARK: True})
        for h, work in rp.work.items():
            d.peer(h).call("repair_stage", job=run.job, old_version=state.version,
                           new_version=new_version, rate=rate, **encode(work))
        _follow(run, hosts, sorted(rp.work))
        again, _ = hosts.each(live, "versions", job=run.job)
        again, _ = split_foreign(again)
        newer = [v["version"] for vs in again.values() for v in vs
                 if v["state"] == "committed" and v["version"] > state.version]
        if newer:
            raise PtcError(f"version {max(newer)} of {run.job!r} was committed during the "
                           "repair; run it again")
        hosts.each(live, "commit", quick=False, job=run.job, version=new_version,
                   meta={**meta, REPAIR_MARK: False})
        run.state = "done"
        try:
            _prune(hosts, run.job, live)
        except PtcError as e:  # the repair is committed; the next reconfiguration prunes
            log.warning("could not delete old versions of %s: %s", run.job, e)
        log.info("repaired %s: %d copies, %d bytes, version %d", run.job, run.pieces,
                 run.bytes, new_version)
    except Exception as e:  # reported through repair_status
        if not isinstance(e, PtcError):
            log.exception("repair of %s failed", run.job)
        run.error, run.error_type = str(e), type(e).__name__
        run.state = "failed"
        if new_version:
            for h in live:
                try:
                    hosts.ask(h, "abort", job=run.job, version=new_version)
                except PtcError:
                    pass  # a host that does not answer aborts leftovers later
    finally:
        run.seconds = round(time.perf_counter() - t0, 3)


def _prune(hosts: _Hosts, job: str, live: list[str]) -> None:
    """Delete the committed versions older than the newest PTC_KEEP_VERSIONS."""
    keep = int(settings.get("PTC_KEEP_VERSIONS"))
    seen, _ = hosts.each(live, "versions", job=job)
    committed = sorted({v["version"] for vs in seen.values() for v in vs
                        if v["state"] == "committed"})
    old = set(committed[:-keep])
    for h, vs in seen.items():
        for v in vs:
            if v["version"] in old:
                hosts.ask(h, "delete_version", job=job, version=v["version"])


def _current(job: str, seen: dict[str, Any], live: list[str], hosts: _Hosts) -> JobState:
    """Step 1: the current version's record; a repair's leftover staging is aborted."""
    committed = {v["version"]: v["meta"] for h in live for v in seen[h]
                 if v["state"] == "committed"}
    if not committed:
        raise JobNotFound(f"no live host has a committed version of job {job!r}")
    current = max(committed)
    for h in live:
        for v in seen[h]:
            if v["state"] != "staging" or v["version"] <= current:
                continue
            if v["meta"].get(SAVE_MARK):
                raise PtcError(f"version {v['version']} of {job!r} is a save open on {h}: "
                               f"repair once it is committed (`ptcctl commit {job} --step N`) "
                               f"or dropped (`ptcctl discard {job}`)")
            if not v["meta"].get(REPAIR_MARK):
                raise PtcError(f"version {v['version']} of {job!r} is staging on {h} (a "
                               "reconfiguration); repair once it ends")
            hosts.ask(h, "abort", job=job, version=v["version"])
    return JobState.from_meta(committed[current])


def _follow(run: RepairRun, hosts: _Hosts, on: list[str]) -> None:
    """Step 5: wait for every repair stage to end; raise when one fails."""
    while True:
        answers, down = hosts.each(on, "repair_status", job=run.job)
        if down:
            raise PeerError(f"{', '.join(down)} stopped answering during the repair")
        stages = {h: next((s for s in a["stages"] if s["version"] == run.new_version), None)
                  for h, a in answers.items()}
        failed = {h: (s["error"] if s else "lost its repair stage (restarted?)")
                  for h, s in stages.items() if s is None or s["state"] == "failed"}
        if failed:
            raise PtcError("repair failed on " + "; ".join(f"{h}: {m}" for h, m in
                                                           sorted(failed.items())))
        run.pieces_left = sum(s["pieces"] - s["pieces_done"] for s in stages.values() if s)
        run.bytes_left = sum(s["bytes"] - s["bytes_done"] for s in stages.values() if s)
        if all(s and s["state"] == "done" for s in stages.values()):
            return
        time.sleep(POLL_S)  # the stages report progress only when asked
