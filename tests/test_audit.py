"""The audit trail: each change of a job is one JSON line in its daemon's
log and an entry that ``ptcctl audit`` merges from every host by time:
after a create, a save through the mount, a commit, a reconfiguration,
and a change a key was refused."""

from __future__ import annotations

import json
import signal

import pytest

from ptcfs.server.testing.localcluster import LocalCluster
from tests.test_cluster import SMALL, ptcctl

pytestmark = [pytest.mark.fuse, pytest.mark.multihost]


@pytest.fixture
def cluster(tmp_path):
    lc = LocalCluster(tmp_path / "audit")
    try:
        lc.up(2, gpus=1, replicas=1, mount=True)
        yield lc
    finally:
        lc.down()


def audit(lc: LocalCluster, *extra: str) -> list[dict]:
    out = json.loads(ptcctl(lc.cluster_file, "audit", "j", "--json", *extra).stdout)
    assert out["down"] == []
    entries: list[dict] = out["entries"]
    assert [e["t"] for e in entries] == sorted(e["t"] for e in entries)
    return entries


def test_create_save_commit_reconfigure_and_a_refusal_are_audited(cluster, monkeypatch):
    cf = cluster.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1")
    made = audit(cluster, "--last", "1000")
    assert {e["host"] for e in made} == {"h0", "h1"}
    assert {(e["op"], e["key"], e["version"]) for e in made if e["op"] != "put"} >= {
        ("begin_at", "client", 1), ("commit", "client", 1)}
    puts = [e for e in made if e["op"] == "put"]
    assert puts and all(e["key"] == "client" and e["bytes"] > 0 and e["tensor"] for e in puts)
    assert all(e["error"] is None for e in made)
    # rank 0 saves through h0's mount, rank 1 through h1's
    for r in (0, 1):
        path = cluster.mount_dir(f"h{r}") / "j" / "ranks" / str(r) / "state.safetensors"
        path.write_bytes(path.read_bytes())
    saved = [e for e in audit(cluster, "--last", "1000") if e["op"] == "put" and
             e["version"] == 2]
    assert {(e["host"], e["rank"], e["uid"], e["key"]) for e in saved} == {
        ("h0", 0, 0, "@daemon"), ("h1", 1, 0, "@daemon")}
    ptcctl(cf, "commit", "j", "--step", "7")
    ptcctl(cf, "reconfigure", "j", "--to", "tp=1,dp=2", "--hosts", "h0:1,h1:1")
    ptcctl(cf, "keys", "new", "bob")
    monkeypatch.setenv("PTC_CLIENT_KEY", "bob")
    assert ptcctl(cf, "job", "delete", "j", check=False).returncode == 1
    monkeypatch.delenv("PTC_CLIENT_KEY")
    last = audit(cluster, "--last", "12")
    assert len(last) == 12
    ops = [(e["op"], e["version"]) for e in audit(cluster, "--last", "1000")]
    assert ("commit", 2) in ops and ("stage", 3) in ops and ("commit", 3) in ops
    refused = [e for e in audit(cluster, "--last", "1000") if e["error"]]
    assert refused and all(e["key"] == "bob" and "NotAllowed" in e["error"] for e in refused)
    # each entry is one JSON line in its daemon's log
    logged = [json.loads(line.split(" audit ", 1)[1])
              for line in (cluster.dir / "h0.log").read_text().splitlines() if " audit {" in line]
    assert {e["op"] for e in logged} >= {"begin_at", "put", "commit", "stage"}
    assert all(e["host"] == "h0" for e in logged)
    text = ptcctl(cf, "audit", "j", "--last", "5").stdout.splitlines()
    assert len(text) == 5 and all(" h0 " in t or " h1 " in t for t in text)
    # a restarted daemon has its trail still (the store's audit.jsonl)
    before = [e for e in audit(cluster, "--last", "1000") if e["host"] == "h0"]
    cluster.kill("h0", signal.SIGTERM)
    cluster.start("h0")
    after = [e for e in audit(cluster, "--last", "1000") if e["host"] == "h0"]
    assert after == before
