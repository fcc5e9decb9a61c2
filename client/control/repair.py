"""Repairs from ``ptcctl``: start one, follow it, read its progress.

The daemons do the work (:mod:`ptcfs.server.ops.repair`); this side asks
the first live host of the cluster file to drive a repair, and reads the
``repair_status`` of the hosts. Call order of :func:`repair` with ``wait``:

1. ``ping`` every host; the first that answers drives the repair;
2. ``repair`` on it (job, lost hosts): it answers at once;
3. ``repair_status`` on it until the job's run ends; a failed run raises
   its error, re-created here as the same ptcfs error class.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ptcfs.client.control.conn import Cluster, ping_timeout
from ptcfs.errors import PeerError
from ptcfs.server.net.wire import error_from_wire

__all__ = ["repair", "start_repair", "wait_repair", "repairs_in_progress", "POLL_S"]

#: Seconds between two looks at a repair's progress.
POLL_S = 0.2


def start_repair(cluster: Cluster, job: str | None, lost: tuple[str, ...] = (),
                 rate: int | None = None, live: list[str] | None = None
                 ) -> tuple[str, dict[str, Any]]:
    """Steps 1–2: the driving host and its answer (``live``: the hosts known
    to answer, to skip the pings). Also what a membership service calls when
    hosts' leases expire (``job=None``: every job)."""
    if live is None:
        answers, _ = cluster.call_all("ping")
        live = [h for h in cluster.hosts if h in answers]
    live = [h for h in live if h not in lost]
    if not live:
        raise PeerError("no host of the cluster answers; nothing can repair")
    host = live[0]
    return host, cluster.client(host).call("repair", job=job, lost=list(lost), rate=rate)


def wait_repair(cluster: Cluster, host: str, job: str,
                progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Step 3: the run's record once it ends (``progress`` gets it while it runs)."""
    while True:
        try:
            runs = cluster.client(host, 10.0).call("repair_status", job=job)["runs"]
        except PeerError as e:
            raise PeerError(f"{host}, which drives the repair of {job!r}, stopped "
                            f"answering: {e}") from None
        run = next((r for r in runs if r["job"] == job), None)
        if run is None:
            raise PeerError(f"{host} has no repair of {job!r} (restarted?)")
        if run["state"] == "failed":
            raise error_from_wire({"type": run["error_type"], "message": run["error"]},
                                  f"repair of {job!r}")
        if run["state"] != "running":
            return run
        if progress is not None:
            progress(run)
        time.sleep(POLL_S)  # the driver reports progress only when asked


def repair(cluster: Cluster, job: str, lost: tuple[str, ...] = (), wait: bool = True,
           progress: Callable[[dict[str, Any]], None] | None = None,
           rate: int | None = None) -> dict[str, Any]:
    """Start repairing ``job`` and, with ``wait``, follow it to its end
    (``rate``: bytes/s each host may fetch; None: the driver's PTC_REPAIR_RATE)."""
    host, answer = start_repair(cluster, job, lost, rate)
    run = dict(answer["runs"][0]) if answer["runs"] else {"job": job, "state": "running"}
    run["driver"] = host
    if wait:
        run = {**wait_repair(cluster, host, job, progress), "driver": host}
    return run


def repairs_in_progress(cluster: Cluster, hosts: list[str]) -> dict[str, dict[str, Any]]:
    """Job → the run that repairs it now, with its driving host."""
    answers, _ = cluster.call_all("repair_status", hosts=hosts, timeout_s=ping_timeout())
    out = {}
    for h, a in answers.items():
        for r in a["runs"]:
            if r["state"] == "running":
                out[r["job"]] = {**r, "driver": h}
    return out
