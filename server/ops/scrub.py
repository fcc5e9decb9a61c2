"""Damage at rest: the scrubber, ``scrub`` on demand, and a fresh store's healing.

The scrubber (:func:`scrub_loop`) reads the host's store back against the
checksums written with each chunk (:mod:`ptcfs.store.integrity`), at most
``PTC_SCRUB_RATE`` bytes per second, pass after pass. A damaged chunk's
entries are quarantined by the store (no read serves them again: peers that
ask are told this host lacks them, and fetch from another holder) and each
is logged with host, job, version, tensor and box. ``scrub`` (``ptcctl
verify --deep``) runs one whole pass at once and answers what it found.

Healing. ``ptcctl repair JOB`` restores quarantined entries and the copies
of a host whose store came back empty (a wiped disk, a store set aside with
``ptcd --fresh-store``) without ``--lost``: such a host answers, holds
nothing, and the repair gives it copies. With an etcd registry the daemon
starts that repair itself (:func:`heal_store_loop`): once it quarantined entries
of a job, and once after a start on a store it made (when other hosts hold
jobs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from ptcfs import settings
from ptcfs.errors import PtcError
from ptcfs.server.daemon import Daemon
from ptcfs.server.net.wire import Request
from ptcfs.server.ops.common import arg, daemon_op, daemon_task
from ptcfs.server.ops.repair import foreign_here, start_repairs
from ptcfs.store.integrity import describe_damage
from ptcfs.types import DamagedEntry

__all__ = ["scrub_pass"]

log = logging.getLogger("ptcd.scrub")

#: Seconds of reading at PTC_SCRUB_RATE that one step of the scrubber takes.
STEP_S = 0.5
#: Bytes one step of an unpaced scrub reads (one read transaction).
UNPACED_STEP = 256 << 20


def _found(d: Daemon, entries: list[DamagedEntry]) -> None:
    for e in entries:
        log.warning("%s", describe_damage(d.host_id, e))
    if entries:
        d.scrub_jobs.update(e.job for e in entries)


def scrub_pass(d: Daemon, rate: int = 0) -> tuple[list[DamagedEntry], int]:
    """One whole pass over the store, at most ``rate`` bytes/s (0: at once):
    the entries quarantined and the bytes read."""
    out: list[DamagedEntry] = []
    after: bytes | None = None
    total = 0
    while not d.closing.is_set():
        budget = max(1, int(rate * STEP_S)) if rate else UNPACED_STEP
        t0 = time.monotonic()
        found, after, read = d.store.scrub(after, budget)
        _found(d, found)
        out += found
        total += read
        if after is None:
            break
        if rate:
            d.closing.wait(max(0.0, read / rate - (time.monotonic() - t0)))
    return out, total


@daemon_op("scrub")
def scrub(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    """One whole pass now (``rate`` bytes/s, 0: at once): what it
    quarantined, and every entry quarantined so far whose version is here."""
    rate = arg(req, "rate", int, 0)
    found, read = scrub_pass(d, max(0, rate))
    return {"host": d.host_id, "bytes": read, "found": [asdict(e) for e in found],
            "damaged": [asdict(e) for e in d.store.damaged()],
            "store_problem": d.store.check_file()}, []


@daemon_task
def scrub_loop(d: Daemon) -> None:
    """A pass at PTC_SCRUB_RATE every PTC_SCRUB_INTERVAL_S (none while the
    rate is 0)."""
    while not d.closing.is_set():
        rate = int(settings.get("PTC_SCRUB_RATE"))
        if rate <= 0:
            d.closing.wait(float(settings.get("PTC_RECONCILE_S")) * 10)
            continue
        started = time.monotonic()
        try:
            scrub_pass(d, rate)
        except PtcError as e:
            log.warning("the scrub of the store stopped: %s", e)
        interval = float(settings.get("PTC_SCRUB_INTERVAL_S"))
        d.closing.wait(max(0.0, started + interval - time.monotonic()))


@daemon_task
def heal_store_loop(d: Daemon) -> None:
    """With an etcd registry: repair the jobs whose entries were quarantined
    here; after a start on a store this daemon made, every job the other
    hosts hold; after a start on a store that holds another job of the name
    of one the other hosts hold, that job (retried each PTC_RECONCILE_S
    until it starts)."""
    fresh = bool(d.store.created)
    looked = fresh  # whether the store's jobs were compared with the other hosts'
    while not d.closing.wait(float(settings.get("PTC_RECONCILE_S"))):
        if not d.registry.atomic:
            return
        jobs = sorted(d.scrub_jobs)
        if not jobs and not fresh and looked:
            continue
        try:
            d.refresh_hosts()
            if not looked:
                for job in foreign_here(d):
                    d.scrub_jobs.add(job)
                    jobs.append(job)
                    log.warning("this host started on a store holding another job named %s: "
                                "repairing it", job)
                looked = True
            if fresh:
                out = start_repairs(d, None, [], None)
                fresh = False
                if out["started"]:
                    log.info("this host started on a new store: repairing %s",
                             ", ".join(out["started"]))
            for job in jobs:
                start_repairs(d, job, [], None)
                d.scrub_jobs.discard(job)
                log.info("repairing %s: entries of it were quarantined here, or it is "
                         "another job of its name", job)
        except PtcError as e:
            log.warning("could not start a repair yet: %s", e)
