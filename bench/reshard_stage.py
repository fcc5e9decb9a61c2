"""The stage phase of a reshard that moves nothing across hosts, with views
and with copies, at several state sizes (part of bench_reshard.py).

For each model, on the reshard bench's 2-host cluster: a job of that model
at tp=2,dp=2 is resharded to tp=4 on the same hosts (no byte crosses
hosts), and back, ``runs`` times, once with the daemons started with
``PTC_STAGE_VIEWS=1`` (the default: every local region becomes a view of
the old version's entry) and once with ``PTC_STAGE_VIEWS=0`` (every local
region copied into a new entry, as before views). Both modes restart the
daemons and do one unmeasured round trip first, so that each starts from
the same state (staging buffers and store pages prepared).

Per run it reads the coordinator's stage phase (``ReconfigureResult.phases
["stage"]``: from ``begin`` to every host staged) and each host's own stage
time, and how much each host's store grew: ``stored_bytes`` of the daemons'
``health`` (the bytes of chunks, each counted once however many entries
refer to it), and ``bytes_used`` (the store's pages up to the last in use:
chunks and records together, though pages freed earlier may be reused).
The job is pruned to its current version before each measured reshard and
the reshard keeps two versions, so nothing is freed during it: the growth
is what the new version added.
"""

from __future__ import annotations

import signal
from typing import Any

from common import put, ratio

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.jobstate import JobState
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import parse_config

__all__ = ["STAGE_JOB", "FROM", "TO", "stage_bench"]

STAGE_JOB = "reshard-stage"
FROM, TO = "tp=2,dp=2", "tp=4"


def _restart(lc: LocalCluster, hosts: list[str], views: bool) -> Coordinator:
    """Restart every daemon with PTC_STAGE_VIEWS set; a new coordinator."""
    for h in hosts:
        lc.kill(h, signal.SIGTERM)
        lc.start(h, env={"PTC_STAGE_VIEWS": "1" if views else "0"})
    return Coordinator(Cluster.load(lc.cluster_file))


def _stored(co: Coordinator) -> dict[str, tuple[int, int]]:
    """host → (stored_bytes, bytes_used) of its store."""
    health, _ = co.cluster.call_all("health")
    return {h: (int(r["store"]["stored_bytes"]), int(r["store"]["bytes_used"]))
            for h, r in health.items()}


def _mode(lc: LocalCluster, hosts_arg: str, runs: int, views: bool, state_bytes: int
          ) -> dict[str, Any]:
    hosts = [h.split(":")[0] for h in hosts_arg.split(",")]
    co = _restart(lc, hosts, views)
    a, b = parse_config(FROM, hosts_arg), parse_config(TO, hosts_arg)
    out: dict[str, Any] = {"views": views}
    stage: list[float] = []
    host_wall: list[float] = []
    grew: dict[str, list[int]] = {h: [] for h in hosts}
    pages: dict[str, list[int]] = {h: [] for h in hosts}
    try:
        co.reconfigure(STAGE_JOB, b)  # warm up: buffers, store pages
        co.reconfigure(STAGE_JOB, a)
        for _ in range(runs):
            co.prune(STAGE_JOB, hosts, keep=1)
            before = _stored(co)
            r = co.reconfigure(STAGE_JOB, b)
            after = _stored(co)
            if r.plan.bytes_cross_host:
                raise RuntimeError(f"{FROM} -> {TO} moved {r.plan.bytes_cross_host} bytes "
                                   f"across hosts; the stage bench wants none")
            stage.append(r.phases["stage"])
            host_wall.append(max(s.get("wall", 0.0) for s in r.staged.values()))
            for h in hosts:
                grew[h].append(after[h][0] - before[h][0])
                pages[h].append(after[h][1] - before[h][1])
            co.reconfigure(STAGE_JOB, a)
    finally:
        co.cluster.close()
    put(out, "stage_s", stage, 4)
    put(out, "host_stage_s", host_wall, 4)
    out["grew_bytes"] = {h: max(v) for h, v in grew.items()}
    out["grew_share"] = {h: round(max(v) / state_bytes, 6) for h, v in grew.items()}
    out["pages_grew_bytes"] = {h: max(v) for h, v in pages.items()}
    return out


def stage_bench(lc: LocalCluster, model: str, hosts_arg: str, runs: int) -> dict[str, Any]:
    """Views against copies for one model (see the module docstring). The
    daemons are left running with views on, the job deleted."""
    state = JobState(STAGE_JOB, 1, model, "fp32", "adam", parse_config(FROM, hosts_arg), 0, 1,
                     tuple(h.split(":")[0] for h in hosts_arg.split(",")))
    state_bytes = sum(s.nbytes for s in state.model_spec().tensors_for(1))
    co = Coordinator(Cluster.load(lc.cluster_file))
    try:
        co.create(state, seed=0)
    finally:
        co.cluster.close()
    try:
        copies = _mode(lc, hosts_arg, runs, False, state_bytes)
        views = _mode(lc, hosts_arg, runs, True, state_bytes)
    finally:
        co = Coordinator(Cluster.load(lc.cluster_file))
        try:
            co.delete_job(STAGE_JOB, force=True)
        finally:
            co.cluster.close()
    out: dict[str, Any] = {"model": model, "case": f"{FROM} -> {TO} on {hosts_arg}",
                           "state_bytes": state_bytes, "runs": runs}
    for name, m in (("views", views), ("copies", copies)):
        out[f"{name}_stage_s"] = m["stage_s"]
        out[f"{name}_host_stage_s"] = m["host_stage_s"]
        out.setdefault("spread", {})[f"{name}_stage_s"] = m["spread"]["stage_s"]
        out["spread"][f"{name}_host_stage_s"] = m["spread"]["host_stage_s"]
        out[f"{name}_grew_bytes"] = m["grew_bytes"]
        out[f"{name}_grew_share"] = m["grew_share"]
        out[f"{name}_pages_grew_bytes"] = m["pages_grew_bytes"]
    out["views_vs_copies"] = ratio(views["stage_s"], copies["stage_s"])
    out["views_max_grew_share"] = max(views["grew_share"].values())
    out["views_max_pages_grew_share"] = round(
        max(views["pages_grew_bytes"].values()) / state_bytes, 6)
    return out
