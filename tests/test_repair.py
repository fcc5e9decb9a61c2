"""Repairs on real daemons: lost copies restored, a second loss survived."""

from __future__ import annotations

import json
import signal
import time

import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.repair import repair, repairs_in_progress, start_repair, wait_repair
from ptcfs.jobstate import JobState
from ptcfs.plan.repair import RepairPlan, plan_repair
from ptcfs.sharding import parse_config
from tests.test_cluster import SMALL, checksums, ptcctl

pytestmark = pytest.mark.multihost

#: tp=2, dp=2 on one GPU per host: tp rank 0 on h0 and h2, tp rank 1 on h1 and h3
CONFIG = ("tp=2,dp=2", "h0:1,h1:1,h2:1,h3:1")


def _create(cf, job: str = "g") -> dict[str, str]:
    ptcctl(cf, "job", "create", job, "--model", SMALL, "--optimizer", "adam",
           "--config", CONFIG[0], "--hosts", CONFIG[1], "--seed", "3")
    return checksums(cf, job)


def _repaired_on(state: JobState) -> set[str]:
    return {h for _, _, hosts in state.holders for h in hosts}


def test_repair_restores_copies_and_a_second_loss_loses_nothing(local_cluster):
    lc = local_cluster(4)
    cf = lc.cluster_file
    before = _create(cf)
    lc.kill("h1", signal.SIGKILL)
    out = json.loads(ptcctl(cf, "repair", "g", "--wait", "--json").stdout)
    assert out["state"] == "done" and out["lost"] == ["h1"] and out["pieces"] > 0
    assert out["new_version"] == 2
    co = Coordinator(Cluster.load(cf))
    try:
        st = co.state("g")
        assert st.version == 2 and st.lost == ("h1",)
        on = _repaired_on(st)
        # least-loaded: the copies of tp rank 1 are spread over both hosts without it
        assert on == {"h0", "h2"}
        assert ptcctl(cf, "verify", "g").returncode == 0
        assert co.verify(st) == []
        assert checksums(cf, "g") == before
        # the copies that the repair placed are read by placement's users
        assert all("h1" not in hosts for spec in st.model_spec().tensors_for(1)
                   for hosts in st.placement(spec).values())
        lc.kill("h0", signal.SIGKILL)  # held repaired copies
        assert checksums(cf, "g") == before
        # the planner finds the repaired copies too: onto the two hosts left
        co.cluster.down.clear()
        r = co.reconfigure("g", parse_config("tp=2", "h2:1,h3:1"))
        assert set(r.lost) == {"h0", "h1"}
        assert {k: v for k, v in checksums(cf, "g").items() if k in before} == before
    finally:
        co.cluster.close()


def test_giving_up_on_a_host_repairs_the_other_jobs(local_cluster):
    lc = local_cluster(4)
    cf = lc.cluster_file
    before = _create(cf)
    ptcctl(cf, "job", "create", "k", "--model", SMALL, "--config", "tp=2", "--hosts",
           "h0:1,h2:1")
    lc.kill("h1", signal.SIGKILL)
    out = ptcctl(cf, "reconfigure", "k", "--to", "tp=2", "--hosts", "h2:1,h3:1").stdout
    assert "gave up on lost host(s): h1" in out
    cluster = Cluster.load(cf)
    try:
        run = wait_repair(cluster, "h0", "g")  # the first live host drives it
        assert run["state"] == "done" and run["lost"] == ["h1"]
        assert Coordinator(cluster).state("g").lost == ("h1",)
    finally:
        cluster.close()
    assert ptcctl(cf, "verify", "g").returncode == 0
    assert checksums(cf, "g") == before


def test_repair_of_a_healthy_job_does_nothing(local_cluster):
    lc = local_cluster(4)
    cf = lc.cluster_file
    _create(cf)
    out = json.loads(ptcctl(cf, "repair", "g", "--wait", "--json").stdout)
    assert out["state"] == "nothing" and out["pieces"] == 0
    text = ptcctl(cf, "repair", "g", "--wait").stdout
    assert "nothing to repair" in text
    r = ptcctl(cf, "repair", "nojob", "--wait", check=False)
    assert r.returncode == 1 and "no live host has a committed version of job 'nojob'" \
        in r.stderr and len(r.stderr.strip().splitlines()) == 1
    co = Coordinator(Cluster.load(cf))
    try:
        assert co.state("g").version == 1
    finally:
        co.cluster.close()


def test_repair_without_a_live_copy_fails_naming_the_piece(local_cluster):
    lc = local_cluster(4)
    cf = lc.cluster_file
    _create(cf)
    lc.kill("h1", signal.SIGKILL)
    lc.kill("h3", signal.SIGKILL)  # both holders of tp rank 1
    r = ptcctl(cf, "repair", "g", "--wait", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no live copy" in lines[0] and "[" in lines[0], r.stderr
    co = Coordinator(Cluster.load(cf))
    try:
        assert co.state("g").version == 1
    finally:
        co.cluster.close()


def test_repair_in_progress_shows_in_status_and_is_throttled(local_cluster):
    lc = local_cluster(4)
    cf = lc.cluster_file
    before = _create(cf)
    lc.kill("h3", signal.SIGKILL)
    cluster = Cluster.load(cf)
    try:
        # paced to last ~20 s, so that two ptcctl status calls see it running (each
        # starts a process: seconds on a busy machine; 10 s was seen to be too short)
        total = _plan(Coordinator(cluster).state("g"), ["h0", "h1", "h2"]).bytes
        host, answer = start_repair(cluster, "g", rate=total // 20)
        assert answer["started"] == ["g"]
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = repairs_in_progress(cluster, ["h0", "h1", "h2"])
            if "g" not in runs:
                break
            seen.append(runs["g"])
            if len(seen) == 1:  # ptcctl status shows it too
                status = json.loads(ptcctl(cf, "status", "--json").stdout)
                shown = status["jobs"]["g"]["repair"]
                assert shown["lost"] == ["h3"] and shown["pieces"] > 0
                text = ptcctl(cf, "status").stdout
                assert "repairing (lost: h3)" in text and "left" in text
            time.sleep(0.1)  # polling the driver's own report of its progress
        seen = [r for r in seen if r["bytes"]]  # planned
        assert seen, "the repair ended before any status call saw it"
        assert seen[0]["bytes"] == total and seen[0]["bytes_left"] > 0
        assert seen[-1]["bytes_left"] <= seen[0]["bytes_left"]
        run = wait_repair(cluster, host, "g")
        assert run["state"] == "done"
        # a second repair finds nothing left to do
        assert repair(cluster, "g")["state"] == "nothing"
    finally:
        cluster.close()
    assert ptcctl(cf, "verify", "g").returncode == 0
    assert checksums(cf, "g") == before


def _held(st: JobState, live: list[str]) -> dict[str, set[tuple[str, str]]]:
    """What each live host holds when every copy of ``st`` is in place."""
    return {h: {(spec.name, sl.key()) for spec in st.model_spec().tensors_for(st.config.pp)
                for sl, hosts in st.placement(spec).items() if h in hosts} for h in live}


def _plan(st: JobState, live: list[str]) -> RepairPlan:
    rp = plan_repair(st, live, _held(st, live))
    assert rp is not None
    return rp


def test_plan_repair_is_least_loaded_and_complete():
    st = JobState("p", 1, SMALL, "fp16", "adam", parse_config(*CONFIG), replicas=2,
                  ring=("h0", "h1", "h2", "h3"))
    live = ["h0", "h2", "h3"]
    have = _held(st, live)
    rp = plan_repair(st, live, have)
    assert rp is not None and rp.new.lost == ("h1",) and rp.new.version == 2
    for spec in st.model_spec().tensors_for(1):
        for hosts in rp.new.placement(spec).values():
            assert len(hosts) >= 2 and "h1" not in hosts
    got = {h: sum(c.nbytes for c in rp.copies if c.dst == h) for h in live}
    assert got["h3"] == 0 and abs(got["h0"] - got["h2"]) <= max(c.nbytes for c in rp.copies)
    assert all(c.src == "h3" for c in rp.copies)  # the only live holder of tp rank 1
    st2 = rp.new
    have2 = {h: have[h] | {(c.tensor, c.part) for c in rp.copies if c.dst == h} for h in live}
    assert plan_repair(st2, live, have2) is None


@pytest.mark.parametrize("config,hosts,lost,replicas", [
    ("tp=2,dp=2", "h0:1,h1:1,h2:1,h3:1", ("h1",), 2),
    ("tp=2,pp=2", "h0:2,h1:2", ("h0",), 2),
    ("tp=1,pp=2", "h0:1,h1:1", ("h1", "h2"), 3),
    ("fsdp=4", "h0:1,h1:1,h2:1,h3:1", ("h1", "h3"), 2),
    ("tp=2", "h0:2", ("h2",), 3),
])
def test_plan_repair_gives_every_piece_its_copies(config, hosts, lost, replicas):
    ring = ("h0", "h1", "h2", "h3", "h4")
    st = JobState("p", 4, SMALL, "fp16", "adam", parse_config(config, hosts),
                  replicas=replicas, ring=ring)
    live = [h for h in ring if h not in lost]
    have = _held(st, live)
    rp = plan_repair(st, live, have)
    assert rp is not None and set(rp.new.lost) <= set(lost)
    for c in rp.copies:
        assert (c.tensor, c.part) in have[c.src] and (c.tensor, c.part) not in have[c.dst]
    for spec in st.model_spec().tensors_for(st.config.pp):
        for hosts_of in rp.new.placement(spec).values():
            assert len(hosts_of) >= min(replicas, len(live)) and not set(hosts_of) & set(lost)
    done = {h: have[h] | {(c.tensor, c.part) for c in rp.copies if c.dst == h} for h in live}
    assert plan_repair(rp.new, live, done) is None
    # each live host builds exactly what the new record places on it
    for h, work in rp.work.items():
        placed = {(spec.name, sl.key()) for spec in st.model_spec().tensors_for(st.config.pp)
                  for sl, on in rp.new.placement(spec).items() if h in on}
        assert {(e.tensor, e.slice.key()) for e in work.entries} == placed
