"""Damage at rest and lost stores on real daemons: bytes flipped in a
stopped host's data file found by ``verify --deep`` and repaired from the
copy (the mount then reads the right bytes), a truncated data file refused
at start in one line, a wiped store healed by ``repair`` without
``--lost`` and by the registry's self-healing, and a data file deleted
under a running daemon named by ``status``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.errors import PtcError
from ptcfs.fuse.reading import READER_RENEW_S
from ptcfs.jobstate import foreign_drops, split_foreign
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.server.testing.localetcd import LocalEtcd, etcd_binary
from ptcfs.store.lmdb_store import LmdbStore
from tests.test_cluster import SMALL, checksums, ptcctl

pytestmark = pytest.mark.multihost

#: tp=2, dp=2 on one GPU per host: tp rank 0 on h0 and h2, tp rank 1 on h1 and h3
CONFIG = ("tp=2,dp=2", "h0:1,h1:1,h2:1,h3:1")
NO_SCRUB = {"PTC_SCRUB_RATE": "0", "PTC_MOUNT_WARM_BYTES": "0"}
WAIT_S = 60.0
#: How long a daemon back from down may take to catch up (its peers asked in
#: turn every 0.2 s, each within the repair's quick timeout).
CATCH_UP_WAIT_S = 30.0


def _create(cf: Path, job: str = "g", config: tuple[str, str] = CONFIG) -> dict[str, str]:
    ptcctl(cf, "job", "create", job, "--model", SMALL, "--optimizer", "adam",
           "--config", config[0], "--hosts", config[1], "--seed", "3")
    return checksums(cf, job)


def _flip(store_dir: Path, job: str, version: int) -> tuple[str, str]:
    """Flip bytes in the middle of the largest entry of a (closed) store; its name."""
    store = LmdbStore(store_dir, readonly=True)
    try:
        e = max(store.entries(job, version), key=lambda e: e.nbytes)
        with store.reader() as r:
            view = next(r.ranges(job, version, e.tensor, e.part, e.nbytes // 2, 8))
            where = r.file_range(view)
        assert where is not None
        at = where[1]
    finally:
        store.close()
    with open(store_dir / "data.mdb", "r+b") as f:
        f.seek(at)
        old = f.read(8)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old))
    return e.tensor, e.part


def _truncate(store_dir: Path) -> None:
    """Cut a (closed) store's data file to half the pages it uses (a file
    written with writemap is as long as its map, most of it holes)."""
    store = LmdbStore(store_dir, readonly=True)
    try:
        used = store.stats()["bytes_used"]
    finally:
        store.close()
    os.truncate(store_dir / "data.mdb", used // 2)


def _wipe(store_dir: Path) -> None:
    for name in ("data.mdb", "lock.mdb"):
        (store_dir / name).unlink(missing_ok=True)


def _wait(what: str, ok: object, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.2)


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.fuse
def test_flipped_bytes_are_found_quarantined_and_repaired_from_the_copy(local_cluster):
    lc: LocalCluster = local_cluster(4, gpus=1, mount=True)
    cf = lc.cluster_file
    before = _create(cf)
    lc.kill("h1", signal.SIGTERM)
    tensor, part = _flip(lc.dir / "h1", "g", 1)
    lc.start("h1", env=NO_SCRUB)
    # the checksums of whole tensors read through h1 are not those of before
    r = ptcctl(cf, "verify", "g", "--deep", "--json", check=False)
    out = json.loads(r.stdout)
    assert r.returncode == 1 and not out["ok"]
    assert [(d["host"], d["tensor"], d["part"], d["version"]) for d in out["damaged"]] == \
        [("h1", tensor, part, 1)]
    text = ptcctl(cf, "verify", "g", "--deep", check=False).stdout
    assert f"h1: {tensor} [{part}] of job 'g' version 1 is damaged" in text
    # never served again: h1 says it lacks it, readers go to the other holder
    assert checksums(cf, "g") == before
    co = Coordinator(Cluster.load(cf))
    try:
        want = co.fetch_tensor(co.state("g"), tensor)
    finally:
        co.cluster.close()
    # h1's mount too (its snapshots are renewed after READER_RENEW_S: a read
    # in one older than the scrub still sees the entry; nothing warmed it)
    time.sleep(2 * READER_RENEW_S)
    path = lc.mount_dir("h1") / "g" / "tensors" / f"{tensor}.npy"
    assert np.array_equal(np.load(path).view(np.uint8), want.view(np.uint8))
    run = json.loads(ptcctl(cf, "repair", "g", "--wait", "--json").stdout)
    assert run["state"] == "done" and run["pieces"] >= 1 and run["lost"] == []
    assert ptcctl(cf, "verify", "g", "--deep").returncode == 0
    assert checksums(cf, "g") == before
    # h1's mount reads the repaired version, from its own store again
    assert np.array_equal(np.load(path).view(np.uint8), want.view(np.uint8))


def test_a_truncated_store_is_refused_in_one_line_then_restored(local_cluster):
    lc: LocalCluster = local_cluster(3, gpus=1)
    cf = lc.cluster_file
    # tp rank 1 lives on h1 alone as its primary; h2 keeps the ring's second copy
    before = _create(cf, config=("tp=2", "h0:1,h1:1"))
    lc.kill("h1", signal.SIGTERM)
    _truncate(lc.dir / "h1")
    with pytest.raises(PtcError) as e:
        lc.start("h1")
    tail = [ln for ln in str(e.value).splitlines() if "ptcd: error" in ln]
    assert len(tail) == 1 and "cut short" in tail[0] and "--fresh-store" in tail[0] \
        and "ptcctl repair" in tail[0], str(e.value)
    assert "Traceback" not in (lc.dir / "h1.log").read_text()
    lc.start("h1", flags=("--fresh-store",))
    assert list((lc.dir / "h1").glob("data.mdb.damaged-*"))
    r = ptcctl(cf, "verify", "g", check=False)
    assert r.returncode == 1 and "host h1 holds nothing of version 1 (its store is empty)" \
        in r.stdout, r.stdout
    run = json.loads(ptcctl(cf, "repair", "g", "--wait", "--json").stdout)
    assert run["state"] == "done" and run["lost"] == [] and run["pieces"] > 0
    assert ptcctl(cf, "verify", "g").returncode == 0
    assert checksums(cf, "g") == before
    lc.kill("h2", signal.SIGKILL)  # the copy that healed h1: h1 serves its own again
    assert checksums(cf, "g") == before


def _left_out_while_down(local_cluster, catch_up_s: str) -> tuple[LocalCluster, Path, Path]:
    """Job ``j`` at tp=2 on h0, h1, reconfigured to tp=1,pp=2 on h1, h2 while
    h0 is down, then h0 started again (its catch-up every ``catch_up_s``):
    the cluster, its file, and h0's link to the job's current tensors."""
    lc = local_cluster(3, gpus=2, mount=True)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "9")
    lc.kill("h0", signal.SIGKILL)
    r = ptcctl(cf, "reconfigure", "j", "--to", "tp=1,pp=2", "--hosts", "h1:1,h2:1")
    assert "gave up on lost host(s): h0" in r.stdout
    lc.start("h0", env={"PTC_CATCH_UP_S": catch_up_s})
    return lc, cf, lc.mount_dir("h0") / "j" / "tensors"


def _log(lc: LocalCluster, host: str) -> str:
    return (lc.dir / f"{host}.log").read_text(errors="replace")


def _holds_the_record_and_reads_the_new_version(cf: Path, link: Path) -> None:
    r = ptcctl(cf, "verify", "j", "--json", check=False)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    assert os.readlink(link) == "versions/2/tensors"
    co = Coordinator(Cluster.load(cf))
    try:
        state = co.state("j")
        assert state.version == 2 and "h0" not in state.ring
        held = co.cluster.client("h0").call("versions", job="j")
        assert {v["version"]: v["state"] for v in held} == {1: "committed", 2: "committed"}
        for spec in state.model_spec().tensors_for(state.config.pp):
            np.testing.assert_array_equal(np.load(link / f"{spec.name}.npy"),
                                          co.fetch_tensor(state, spec.name))
    finally:
        co.cluster.close()


def test_a_host_down_through_a_reconfiguration_gets_the_new_record_back(local_cluster):
    """A host down for a whole reconfiguration is left out of the new
    version (not in its ring, it holds nothing of it). Back, with its
    daemon's catch-up off, its mount shows the old version as current until
    the next command, which gives it the new version's record: verify is
    clean (it said the host had lost its copies, and a repair found nothing
    to do), and its mount reads the new version's bytes from the hosts that
    hold them."""
    _, cf, link = _left_out_while_down(local_cluster, "0")
    assert os.readlink(link) == "versions/1/tensors"  # what h0's store knows
    _holds_the_record_and_reads_the_new_version(cf, link)


def test_a_host_back_from_down_catches_up_with_no_command(local_cluster):
    """The same host, its daemon's catch-up on: with no command run, it asks
    its peers in turn, takes the new version's record, and its mount shows
    the new version (the link moves within a bounded wait)."""
    lc, cf, link = _left_out_while_down(local_cluster, "0.2")
    start = time.monotonic()
    while os.readlink(link) != "versions/2/tensors":
        assert time.monotonic() < start + CATCH_UP_WAIT_S, (os.readlink(link),
                                                           _log(lc, "h0")[-2000:])
        time.sleep(0.1)
    print(f"h0's mount showed version 2 {time.monotonic() - start:.2f} s after its start")
    assert "took the record of j version 2" in _log(lc, "h0")
    _holds_the_record_and_reads_the_new_version(cf, link)


def test_a_wiped_store_is_lost_copies_repair_and_reconfigure_go_on(local_cluster):
    lc: LocalCluster = local_cluster(4, gpus=1)
    cf = lc.cluster_file
    before = _create(cf)
    other = _create(cf, "k", ("tp=2", "h0:1,h1:1"))
    lc.kill("h1", signal.SIGTERM)
    _wipe(lc.dir / "h1")
    lc.start("h1")
    r = ptcctl(cf, "verify", "g", check=False)
    assert r.returncode == 1 and "h1 holds nothing" in r.stdout and "Traceback" not in r.stderr
    # a reconfiguration takes h1 for a host without copies, and goes on
    ptcctl(cf, "reconfigure", "k", "--to", "tp=2", "--hosts", "h1:1,h2:1")
    assert checksums(cf, "k") == other
    assert ptcctl(cf, "verify", "k").returncode == 0
    run = json.loads(ptcctl(cf, "repair", "g", "--wait", "--json").stdout)
    assert run["state"] == "done" and run["lost"] == [] and run["pieces"] > 0
    assert ptcctl(cf, "verify", "g").returncode == 0
    lc.kill("h3", signal.SIGKILL)  # the other holder of tp rank 1
    assert checksums(cf, "g") == before


@pytest.mark.fuse
def test_a_store_file_cut_short_under_the_daemon_is_refused_not_a_crash(local_cluster):
    """A data file cut to half under a running daemon and its mount: reads
    of it are refused in one line (no SIGBUS), readers get the copies,
    ``status`` and ``verify`` name it, and both processes live on."""
    lc: LocalCluster = local_cluster(3, gpus=1, mount=True)
    cf = lc.cluster_file
    before = _create(cf, config=("tp=2", "h0:1,h1:1"))
    tensor = next(iter(before))
    path = lc.mount_dir("h1") / "g" / "tensors" / f"{tensor}.npy"
    want = np.load(path)
    time.sleep(2 * READER_RENEW_S)  # the mount's snapshots from the read above end
    _truncate(lc.dir / "h1")
    r = ptcctl(cf, "verify", "g", check=False)
    assert r.returncode == 1 and "h1" in r.stdout and "cut short" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
    assert checksums(cf, "g") == before  # from h1's copies on h2
    try:
        got = np.load(path)
    except OSError as e:  # the mount refuses what its store cannot give
        assert e.errno == errno.EIO, e
    else:
        assert np.array_equal(got, want)
    st = ptcctl(cf, "status").stdout
    assert "STORE DAMAGED" in st and "cut short" in st, st
    assert lc.procs["h1"].poll() is None, (lc.dir / "h1.log").read_text()[-2000:]
    assert os.path.ismount(lc.mount_dir("h1"))
    assert "Traceback" not in (lc.dir / "h1.log").read_text()


def test_a_store_file_deleted_under_the_daemon_is_named_by_status(local_cluster):
    lc: LocalCluster = local_cluster(2, gpus=1)
    cf = lc.cluster_file
    _create(cf, config=("tp=2", "h0:1,h1:1"))
    (lc.dir / "h1" / "data.mdb").unlink()
    r = ptcctl(cf, "status")
    lines = [ln for ln in r.stdout.splitlines() if "STORE DAMAGED" in ln]
    assert len(lines) == 1 and "data.mdb was deleted" in lines[0], r.stdout
    out = json.loads(ptcctl(cf, "status", "--json").stdout)
    assert "was deleted" in out["hosts"]["h1"]["store_problem"]
    assert out["hosts"]["h0"]["store_problem"] is None


@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed "
                    "(apt-get install etcd-server; deploy/setup.sh does)")
@pytest.mark.parametrize("lost", ["wiped", "foreign"])
def test_a_lost_store_heals_itself_with_a_registry(tmp_path: Path, local_cluster, lost: str,
                                                   monkeypatch: pytest.MonkeyPatch):
    """A host back on an empty store, or on a store that holds another job
    of the same name (another cluster's), repairs the job with no command."""
    for k, v in {"PTC_REGISTRY_TTL_S": "2", "PTC_LOCK_TTL_S": "2",
                 "PTC_RECONCILE_S": "0.2", "PTC_HEAL_AFTER_S": "60"}.items():
        monkeypatch.setenv(k, v)
    with LocalEtcd(tmp_path / "registry") as etcd:
        lc = LocalCluster(tmp_path / "cluster")
        try:
            lc.up(4, gpus=1, keys=False, registry=etcd.url)
            cf = lc.cluster_file
            before = _create(cf)
            lc.kill("h1", signal.SIGTERM)
            _wipe(lc.dir / "h1")
            if lost == "foreign":
                other = local_cluster(2, gpus=1, replicas=1)
                ptcctl(other.cluster_file, "job", "create", "g", "--model", SMALL, "--optimizer",
                       "adam", "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "9")
                other.kill("h1", signal.SIGTERM)
                shutil.copy(other.dir / "h1" / "data.mdb", lc.dir / "h1" / "data.mdb")
            lc.start("h1")

            def healed() -> bool:
                co = Coordinator(Cluster.load(cf))
                try:
                    st = co.state("g")
                    return st.version > 1 and co.verify(st) == []
                finally:
                    co.cluster.close()

            # no command: h1 started on a store it made, and repairs what it lost
            _wait("h1's copies restored", healed)
            lc.kill("h3", signal.SIGKILL)
            assert checksums(cf, "g") == before
        finally:
            lc.down()


def test_a_reconfiguration_before_the_repair_takes_quarantined_entries_from_the_copy(
        local_cluster):
    """A host whose scrub quarantined an entry is no source of the version
    until a repair (it used to be planned as one: the new version lacked the
    entry, or the change failed); it stays a destination."""
    lc: LocalCluster = local_cluster(4, gpus=1)
    cf = lc.cluster_file
    before = _create(cf)
    lc.kill("h1", signal.SIGTERM)
    _flip(lc.dir / "h1", "g", 1)
    lc.start("h1", env=NO_SCRUB)
    assert ptcctl(cf, "verify", "g", "--deep", check=False).returncode == 1
    ptcctl(cf, "reconfigure", "g", "--to", "tp=2", "--hosts", "h1:1,h3:1")
    assert ptcctl(cf, "verify", "g").returncode == 0
    assert checksums(cf, "g") == before


def test_split_foreign_takes_the_identity_most_hosts_hold() -> None:
    def v(version: int, ident: str | None, state: str = "committed") -> dict:
        return {"version": version, "state": state,
                "meta": {} if ident is None else {"identity": ident}}

    ours = {"h0": [v(1, "a"), v(2, "a")], "h2": [v(2, "a")], "h3": []}
    kept, foreign = split_foreign({**ours, "h1": [v(1, "b"), v(3, "b"), v(4, "b", "staging")]})
    assert kept == {**ours, "h1": []} and list(foreign) == ["h1"]
    assert foreign_drops(kept, foreign) == [("h1", "delete_job", 0)]
    # a host holding both: each version of the other job goes, one by one
    kept, foreign = split_foreign({**ours, "h1": [v(2, "a"), v(3, "b"), v(4, "b", "staging")]})
    assert kept["h1"] == [v(2, "a")]
    assert foreign_drops(kept, foreign) == [("h1", "delete_version", 3), ("h1", "abort", 4)]
    # as many hosts on each side: nothing tells which is the job
    assert split_foreign({"h0": [v(1, "a")], "h1": [v(1, "b")]})[1] == {}
    # records without an identity (older jobs, datasets) are never foreign
    assert split_foreign({"h0": [v(1, None)], "h1": [v(1, None)], "h2": [v(1, "a")]})[1] == {}


def test_a_store_holding_another_job_of_the_name_is_lost_copies(local_cluster):
    """A host back with another cluster's store that holds a job of the same
    name and version: every command takes it for a host that lost its copies
    (verify names it, reads never come from it, a reconfiguration goes on
    and puts copies there), and repair replaces them without --lost."""
    lc: LocalCluster = local_cluster(4, gpus=1)
    cf = lc.cluster_file
    before = _create(cf)
    other = local_cluster(2, gpus=1, replicas=1)
    ptcctl(other.cluster_file, "job", "create", "g", "--model", SMALL, "--optimizer", "adam",
           "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "9")
    assert checksums(other.cluster_file, "g") != before
    lc.kill("h1", signal.SIGTERM)
    other.kill("h1", signal.SIGTERM)
    _wipe(lc.dir / "h1")
    shutil.copy(other.dir / "h1" / "data.mdb", lc.dir / "h1" / "data.mdb")
    lc.start("h1")
    r = ptcctl(cf, "verify", "g", check=False)
    assert r.returncode == 1 and "h1 holds another job named 'g'" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
    assert checksums(cf, "g") == before  # h1's bytes are another job's: not read
    run = json.loads(ptcctl(cf, "repair", "g", "--wait", "--json").stdout)
    assert run["state"] == "done" and run["lost"] == [] and run["pieces"] > 0
    assert ptcctl(cf, "verify", "g").returncode == 0
    lc.kill("h3", signal.SIGKILL)  # the other holder of tp rank 1: h1 serves its own
    assert checksums(cf, "g") == before
    lc.start("h3")
    # a reconfiguration onto a host back with another job of the name goes on
    lc.kill("h2", signal.SIGTERM)
    other_h0 = other.dir / "h0" / "data.mdb"
    other.kill("h0", signal.SIGTERM)
    _wipe(lc.dir / "h2")
    shutil.copy(other_h0, lc.dir / "h2" / "data.mdb")
    lc.start("h2")
    ptcctl(cf, "reconfigure", "g", "--to", "tp=2", "--hosts", "h1:1,h2:1")
    assert checksums(cf, "g") == before
    assert ptcctl(cf, "verify", "g").returncode == 0
