"""Real daemons on loopback: jobs, reconfigurations, failures, counters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.errors import HostFailures
from ptcfs.jobstate import JobState
from ptcfs.server.buffers import whole_sizes
from ptcfs.server.testing.localcluster import free_port
from ptcfs.sharding import parse_config

pytestmark = pytest.mark.multihost

SMALL = "gpt:layers=4,hidden=128,heads=8,vocab=1000,seq=64"
#: Sub-tensors of 1-4 MiB: staged in pooled buffers.
MEDIUM = "gpt:layers=2,hidden=512,heads=8,vocab=4000,seq=64"


def ptcctl(cluster: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("ptcctl")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PTC_CLUSTER=str(cluster)))
    if check and r.returncode != 0:
        raise AssertionError(f"ptcctl {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def checksums(cluster: Path, job: str) -> dict[str, str]:
    return json.loads(ptcctl(cluster, "checksum", job, "--json").stdout)


def served_to_peers(co: Coordinator) -> int:
    """Bytes every daemon served to other daemons, by their own counters."""
    counters, _ = co.cluster.call_all("counters")
    return sum(c["sent"] for host, per in counters.items() for peer, c in per.items()
               if peer in co.cluster.hosts and peer != host)


def test_reconfigure_sequence_keeps_every_byte(local_cluster):
    lc = local_cluster(3)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--optimizer", "adam",
           "--config", "tp=2,dp=2", "--hosts", "h0:2,h1:2", "--seed", "7")
    before = checksums(cf, "j")
    assert ptcctl(cf, "verify", "j").returncode == 0
    co = Coordinator(Cluster.load(cf))
    try:
        steps = [("tp=4,dp=1", "h1:4"), ("tp=2,pp=2,dp=1", "h0:2,h2:2"),
                 ("tp=1,pp=1,dp=3", "h0:1,h1:1,h2:1"), ("tp=2,pp=2,dp=1", "h2:4")]
        for version, (to, hosts) in enumerate(steps, start=2):
            sent_before = served_to_peers(co)
            out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", to, "--hosts", hosts,
                                    "--json").stdout)
            assert out["version"] == version
            # measured cross-host bytes (the daemons' own counters) equal the plan's
            assert served_to_peers(co) - sent_before == out["bytes_cross_host"]
            assert out["bytes_cross_host_measured"] == out["bytes_cross_host"]
            # where the time went: phases, and each staging host's own account
            assert set(out["phases"]) == {"plan", "stage", "commit"}
            assert sum(out["phases"].values()) <= out["seconds"] + 0.01
            assert set(out["staged"]) == {"h0", "h1", "h2"}  # replicas live on the others
            for sec in out["staged"].values():
                assert {"wall", "copy", "fetch", "put"} <= set(sec)
                # a host with little or nothing to build may take under 0.1 ms (0.0)
                assert 0 <= sec["wall"] <= out["phases"]["stage"]
            assert max(sec["wall"] for sec in out["staged"].values()) > 0
            after = checksums(cf, "j")
            assert {k: after[k] for k in before} == before
            v = json.loads(ptcctl(cf, "verify", "j", "--json").stdout)
            assert v["ok"], v["problems"]
        state = co.state("j")
        assert state.version == 5 and state.config == parse_config("tp=2,pp=2", "h2:4")
        kept, _ = co.cluster.call_all("versions", job="j")
        assert all([v["version"] for v in vs] == [4, 5] for vs in kept.values())
    finally:
        co.cluster.close()


def tp2_on_two_hosts(local_cluster, job: str) -> tuple[Path, dict[str, str]]:
    """Two daemons, one replica, and ``job`` at tp=2 across them: the
    cluster file and the job's checksums."""
    cf = local_cluster(2, replicas=1).cluster_file
    ptcctl(cf, "job", "create", job, "--model", SMALL, "--config", "tp=2", "--hosts",
           "h0:1,h1:1", "--seed", "5")
    return cf, checksums(cf, job)


def test_local_regions_cross_store_chunks(local_cluster, monkeypatch):
    """With chunks of one page every sub-tensor spans many chunks, and the
    local regions a host copies (column halves, rows) cross chunk bounds."""
    monkeypatch.setenv("PTC_STORE_CHUNK_BYTES", "4096")
    cf, before = tp2_on_two_hosts(local_cluster, "c")
    for to in ("tp=1,pp=2", "tp=2,pp=1", "tp=1,pp=1,dp=2"):
        out = json.loads(ptcctl(cf, "reconfigure", "c", "--to", to, "--hosts", "h0:1,h1:1",
                                "--json").stdout)
        assert sum(s["copy"] for s in out["staged"].values()) > 0  # local regions copied
        after = checksums(cf, "c")  # pp > 1 adds the output layer's copy of the embedding
        assert {k: after[k] for k in before} == before
    co = Coordinator(Cluster.load(cf))
    try:
        health, _ = co.cluster.call_all("health")
        assert {h["store"]["chunk_bytes"] for h in health.values()} == {4096}
    finally:
        co.cluster.close()


def test_tensor_get_and_status(local_cluster, tmp_path):
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "g", "--model", SMALL, "--config", "tp=2", "--hosts", "h0:2",
           "--seed", "3")
    name = "encoder.layers.1.mlp.dense_4h_to_h.weight"  # split on columns
    whole, part = tmp_path / "w.npy", tmp_path / "p.npy"
    ptcctl(cf, "tensor", "get", "g", name, "--out", str(whole))
    ptcctl(cf, "tensor", "get", "g", name, "--slice", "3:9,100:300", "--out", str(part))
    w, p = np.load(whole), np.load(part)
    assert w.shape == (128, 512) and w.dtype == np.float16
    np.testing.assert_array_equal(p, w[3:9, 100:300])
    st = json.loads(ptcctl(cf, "status", "--json").stdout)
    assert st["hosts"]["h0"]["alive"] and st["jobs"]["g"]["version"] == 1
    r = ptcctl(cf, "tensor", "get", "g", "nope", "--out", str(part), check=False)
    assert r.returncode == 1 and "has no tensor 'nope'" in r.stderr
    r = ptcctl(cf, "tensor", "get", "g", name, "--slice", "0:1,x", "--out", str(part),
               check=False)
    assert r.returncode == 2 and "bad slice" in r.stderr


def test_kill_during_reconfigure_keeps_old_version(local_cluster):
    lc = local_cluster(3)
    cf = lc.cluster_file
    big = "gpt:layers=4,hidden=512,heads=8,vocab=8000,seq=64"
    ptcctl(cf, "job", "create", "k", "--model", big, "--optimizer", "adam",
           "--config", "tp=2,dp=1", "--hosts", "h0:2", "--seed", "1")
    before = checksums(cf, "k")
    new_cfg = parse_config("tp=1,pp=2,dp=1", "h1:1,h2:1")
    co = Coordinator(Cluster.load(cf))
    killed = []

    def kill_h2_once(_: int) -> None:  # first called once every host has begun staging
        if not killed:
            lc.kill("h2", signal.SIGKILL)
            killed.append("h2")

    try:
        with pytest.raises(HostFailures) as e:
            co.reconfigure("k", new_cfg, progress=kill_h2_once)
        assert "h2" in e.value.failures and "stays current" in str(e.value)
        assert killed
        assert co.state("k").version == 1
        assert checksums(cf, "k") == before
        lc.start("h2")
        r = co.reconfigure("k", new_cfg)
        assert r.new.version == 2
        assert {k: v for k, v in checksums(cf, "k").items() if k in before} == before
        assert co.verify(co.state("k")) == []
    finally:
        co.cluster.close()


def test_losing_a_host_for_good_loses_nothing(local_cluster):
    lc = local_cluster(3)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "f", "--model", SMALL, "--optimizer", "adam",
           "--config", "tp=2,pp=2,dp=1", "--hosts", "h0:2,h1:2", "--seed", "5")
    before = checksums(cf, "f")
    lc.kill("h1", signal.SIGKILL)
    out = ptcctl(cf, "reconfigure", "f", "--to", "tp=2,pp=1", "--hosts", "h2:2")
    assert "gave up on lost host(s): h1" in out.stdout
    after = checksums(cf, "f")
    assert {k: after[k] for k in after if k in before} == {k: before[k] for k in after}
    v = json.loads(ptcctl(cf, "verify", "f", "--json", check=False).stdout)
    assert any("h1 does not answer" in p for p in v["problems"])
    assert all("h1" in p for p in v["problems"])


def test_bad_reconfigure_input(local_cluster):
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "b", "--model", SMALL, "--config", "tp=1", "--hosts", "h0:1")
    for args, message in [
        (["--to", "tp=3", "--hosts", "h0:4"], "tp=3 does not divide heads=8"),
        (["--to", "tp=1", "--hosts", "h9:1"], "not in the cluster file: h9"),
        (["--to", "tp=4", "--hosts", "h0:2"], "only 2 GPUs"),
    ]:
        r = ptcctl(cf, "reconfigure", "b", *args, check=False)
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and "Traceback" not in r.stderr
    r = ptcctl(cf, "reconfigure", "nojob", "--to", "tp=1", check=False)
    assert r.returncode == 1 and "no host has a committed version of job 'nojob'" in r.stderr
    r = ptcctl(cf, "job", "create", "b", "--model", SMALL, "--config", "tp=1", "--hosts", "h0:1",
               check=False)
    assert r.returncode == 2 and "exists already" in r.stderr
    dry = json.loads(ptcctl(cf, "reconfigure", "b", "--to", "tp=2", "--hosts", "h1:2",
                            "--dry-run", "--json").stdout)
    # with 2 hosts and replicas = 2 both hosts hold a whole copy: nothing crosses
    assert dry["dry_run"] and dry["transfers"] > 0 and dry["bytes_cross_host"] == 0
    assert Coordinator(Cluster.load(cf)).state("b").version == 1
    assert JobState.from_meta(JobState("x", 1, SMALL, "fp16", "none",
                                       parse_config("tp=1", "h0:1")).to_meta()).job == "x"


def _settled(co: Coordinator) -> dict[str, dict]:
    """The daemons' health once none is making room in its store."""
    while True:
        health, _ = co.cluster.call_all("health")
        if not any(h["making_room"] for h in health.values()):
            return health
        time.sleep(0.05)  # polling the daemons' own report of their work


@pytest.mark.parametrize("keep", [None, "0"])
def test_staging_buffers_are_prepared_and_kept(local_cluster, monkeypatch, keep):
    """Between reconfigurations each daemon holds touched staging buffers as
    big as the model's biggest whole tensor, bigger than any it holds (none
    with PTC_STAGE_KEEP_BYTES=0)."""
    if keep is not None:
        monkeypatch.setenv("PTC_STAGE_KEEP_BYTES", keep)
    cf = local_cluster(2, replicas=1).cluster_file
    ptcctl(cf, "job", "create", "m", "--model", MEDIUM, "--config", "tp=2", "--hosts",
           "h0:1,h1:1", "--seed", "3")
    before = checksums(cf, "m")
    co = Coordinator(Cluster.load(cf))
    try:
        # tp=2 -> tp=1,pp=2 merges row-parallel halves: strided regions from the peer
        for version, to in ((1, None), (2, "tp=1,pp=2"), (3, "tp=2")):
            if to is not None:
                ptcctl(cf, "reconfigure", "m", "--to", to, "--hosts", "h0:1,h1:1")
            health = _settled(co)
            held, _ = co.cluster.call_all("entries", job="m", version=version)
            whole = max(whole_sizes(co.state("m").to_meta()))  # the padded embedding
            for h, es in held.items():
                biggest = max(e["nbytes"] for e in es)
                kept = health[h]["stage_buffers_largest"]
                assert kept >= whole >= biggest >= 1 << 20 if keep is None else kept == 0
                if "tp=2" in co.state("m").describe():  # ready for more than it holds
                    assert whole > biggest
            st = json.loads(ptcctl(cf, "status", "--json").stdout)["hosts"]
            assert {h: st[h]["stage_buffers_bytes"] for h in held} == {
                h: health[h]["stage_buffers_bytes"] for h in held}
            got = checksums(cf, "m")  # pp=2 adds the head's copy of the tied embedding
            assert {k: got[k] for k in before} == before
    finally:
        co.cluster.close()


@pytest.mark.parametrize("room", [True, False])
def test_daemons_make_room_for_the_next_version(local_cluster, monkeypatch, room):
    if not room:
        monkeypatch.setenv("PTC_STORE_ROOM", "0")
    cf, before = tp2_on_two_hosts(local_cluster, "r")
    co = Coordinator(Cluster.load(cf))
    try:
        held, _ = co.cluster.call_all("entries", job="r", version=1)
        health = _settled(co)
        for h, es in held.items():
            room_bytes = health[h]["store"]["room_bytes"]
            if room:  # room for as much as the host holds, pages of the trees aside
                assert room_bytes >= sum(e["nbytes"] for e in es) - (64 << 10)
            else:
                assert room_bytes < 64 << 10
        # the ranks trade places: each host gets a version as big as the one it had
        ptcctl(cf, "reconfigure", "r", "--to", "tp=2", "--hosts", "h1:1,h0:1")
        after = _settled(co)
        for h in held:
            was, now = health[h]["store"], after[h]["store"]
            if room:  # the new version was written into the room made before it (its
                # trees' new pages aside, as above)
                assert now["bytes_used"] <= was["bytes_used"] + was["room_bytes"] + (64 << 10)
            assert now["bytes_used"] > was["bytes_used"]
        got = checksums(cf, "r")
        assert {k: got[k] for k in before} == before
        st = json.loads(ptcctl(cf, "status", "--json").stdout)["hosts"]
        assert {h: (st[h]["room_bytes"], st[h]["making_room"]) for h in held} == {
            h: (after[h]["store"]["room_bytes"], False) for h in held}
        assert "room" in ptcctl(cf, "status").stdout
    finally:
        co.cluster.close()


def test_job_names_that_would_break_the_mount_are_refused(local_cluster, tmp_path):
    """``job create a/b`` succeeded and then every host's mount root failed with EIO."""
    lc = local_cluster(1)
    cf = lc.cluster_file
    for bad in ("a/b", "@x", ".hidden", "x" * 129, "sp ace"):
        r = ptcctl(cf, "job", "create", bad, "--model", SMALL, "--config", "tp=1",
                   "--hosts", "h0:1", check=False)
        assert r.returncode == 2 and "bad job name" in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr
    status = json.loads(ptcctl(cf, "status", "--json").stdout)
    assert status["jobs"] == {}


def test_job_delete_removes_every_version_and_the_dataset(local_cluster, tmp_path):
    lc = local_cluster(3, mount=True)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "gone", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "1")
    ptcctl(cf, "reconfigure", "gone", "--to", "tp=1", "--hosts", "h2:1")
    ptcctl(cf, "job", "create", "kept", "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "2")
    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.int32).reshape(10, 4))
    ptcctl(cf, "data", "ingest", "gone", str(tmp_path / "t.npy"), "--format", "npy",
           "--global-batch", "2")
    kept = checksums(cf, "kept")
    lc.kill("h1", signal.SIGKILL)
    r = ptcctl(cf, "job", "delete", "gone", check=False)
    assert r.returncode == 1 and "h1 do not answer" in r.stderr
    out = json.loads(ptcctl(cf, "job", "delete", "gone", "--force", "--json").stdout)
    assert set(out["deleted_versions"]) == {"h0", "h2"} and all(out["deleted_versions"].values())
    status = json.loads(ptcctl(cf, "status", "--json").stdout)
    assert set(status["jobs"]) == {"kept"}
    assert sorted(os.listdir(lc.mount_dir("h0"))) == ["kept"]  # the mount root lists
    assert checksums(cf, "kept") == kept
    r = ptcctl(cf, "job", "delete", "nojob", "--force", check=False)
    assert r.returncode == 1 and "no host has job 'nojob'" in r.stderr


def test_a_reconfiguration_stores_only_what_crosses_hosts(local_cluster):
    """Local regions become views of the old version: a host's store grows by
    the bytes it received from other hosts (plus metadata), and by next to
    nothing when the plan moves nothing across hosts."""
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", MEDIUM, "--optimizer", "adam",
           "--config", "tp=2,dp=2", "--hosts", "h0:2,h1:2", "--seed", "3")
    before = checksums(cf, "j")
    co = Coordinator(Cluster.load(cf))

    def stores() -> dict[str, dict]:
        health, _ = co.cluster.call_all("health")
        return {h: r["store"] for h, r in health.items()}

    def received() -> dict[str, int]:
        counters, _ = co.cluster.call_all("counters")
        return {h: sum(c["sent"] for src, per in counters.items() if src != h
                       for peer, c in per.items() if peer == h) for h in co.cluster.hosts}

    try:
        state = sum(s["stored_bytes"] for s in stores().values())
        for to, hosts in [("tp=4", "h0:2,h1:2"), ("tp=2,dp=2", "h1:2,h0:2"),
                          ("tp=1,dp=2", "h0:1,h1:1")]:
            s0, r0 = stores(), received()
            out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", to, "--hosts", hosts,
                                    "--json").stdout)
            s1, r1 = stores(), received()
            for h in s0:
                got = r1[h] - r0[h]
                grew = s1[h]["stored_bytes"] - s0[h]["stored_bytes"]
                assert grew <= got, (to, h, grew, got)
                assert s1[h]["bytes_used"] - s0[h]["bytes_used"] <= got + state // 100, (to, h)
                if out["bytes_cross_host"] == 0:
                    assert grew < state // 100, (to, h, grew)
                    assert s1[h]["referenced_bytes"] > 0
            after = checksums(cf, "j")
            assert {k: after[k] for k in before} == before
        assert json.loads(ptcctl(cf, "verify", "j", "--json").stdout)["ok"]
    finally:
        co.cluster.close()


def test_free_ports_are_never_handed_out_twice():
    """The OS may pick a port again before its first taker binds it (two
    hosts of a local cluster file got one address so, and the file was
    refused); 1000 picks repeat some ports without the guard."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_free_ports_are_none_an_outgoing_connection_could_get():
    """A port from the OS's range for outgoing connections could be given
    to any process's next connection before its taker binds it (a daemon
    restarted on its own address was refused so): none is handed out."""
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(200)]
    inside = [p for p in ports if lo <= p <= hi]
    assert not inside and min(ports) >= 1024, inside[:5]


def test_a_store_that_fills_while_staging_keeps_none_of_it(local_cluster):
    """A reconfiguration onto a host whose store fills part-way fails in
    one line, and the host keeps none of the staged bytes: the staging
    version is gone when the command returns, not at the next one."""
    lc = local_cluster(2, replicas=1)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "f", "--model", MEDIUM, "--optimizer", "adam", "--config",
           "tp=1", "--hosts", "h0:1", "--seed", "3")
    before = checksums(cf, "f")
    lc.kill("h1")
    lc.start("h1", env={"PTC_STORE_MAP_SIZE": str(24 << 20), "PTC_STORE_ROOM": "0"})
    co = Coordinator(Cluster.load(cf))
    try:
        r = ptcctl(cf, "reconfigure", "f", "--to", "tp=1", "--hosts", "h1:1", check=False)
        assert r.returncode == 1 and "full" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2
        versions, _ = co.cluster.call_all("versions", job="f")
        assert [v for v in versions["h1"] if v["state"] != "committed"] == []
        assert _settled(co)["h1"]["store"]["stored_bytes"] == 0
        assert co.state("f").version == 1 and checksums(cf, "f") == before
    finally:
        co.cluster.close()
