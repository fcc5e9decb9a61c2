"""The cluster's registry with a real etcd and real daemons: hosts joining,
hosts down after their lease, the per-job lock, and the decision record
that daemons roll forward from (a coordinator killed before or after it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.errors import JobBusy, StoreError
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.server.testing.localetcd import LocalEtcd, etcd_binary
from ptcfs.sharding import parse_config
from tests.daemons import client, paused

pytestmark = [pytest.mark.multihost,
              pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed "
                                 "(apt-get install etcd-server; deploy/setup.sh does)")]

SMALL = "gpt:layers=4,hidden=128,heads=8,vocab=1000,seq=64"
#: Short leases, so that tests see a dead host or coordinator within seconds.
FAST = {"PTC_REGISTRY_TTL_S": "2", "PTC_LOCK_TTL_S": "2", "PTC_RECONCILE_S": "0.2"}
WAIT_S = 30.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path / "registry") as e:
        yield e


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in FAST.items():
        monkeypatch.setenv(k, v)


def _three_hosts(tmp_path: Path, etcd: LocalEtcd) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path / "cluster")
    try:
        lc.up(3, keys=False, registry=etcd.url)
        yield lc
    finally:
        lc.down()


@pytest.fixture
def registry_cluster(tmp_path: Path, etcd: LocalEtcd) -> Iterator[LocalCluster]:
    """Three daemons in an etcd registry, with the default leases: a test
    that waits for none to run out should not lose one either (a lock's
    lease of 2 s has run out on a loaded machine, and its stage was aborted)."""
    yield from _three_hosts(tmp_path, etcd)


@pytest.fixture
def fast_registry_cluster(tmp_path: Path, etcd: LocalEtcd, fast: None) -> Iterator[LocalCluster]:
    """The same with the short leases of FAST, for tests that wait one out."""
    yield from _three_hosts(tmp_path, etcd)


def ptcctl(cluster: Path, *args: str, check: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("ptcctl")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PTC_CLUSTER=str(cluster), **(env or {})))
    if check and r.returncode != 0:
        raise AssertionError(f"ptcctl {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def wait_for(what: str, ok: object, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def status(cf: Path) -> dict[str, object]:
    return json.loads(ptcctl(cf, "status", "--json").stdout)


def create(cf: Path, hosts: str = "h0:2,h1:2") -> dict[str, str]:
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--optimizer", "adam",
           "--config", "tp=2,dp=2", "--hosts", hosts, "--seed", "7")
    return json.loads(ptcctl(cf, "checksum", "j", "--json").stdout)


def versions(co: Coordinator, job: str = "j") -> dict[str, list[tuple[int, str]]]:
    per_host, _ = co.host_versions(job)
    return {h: sorted((v["version"], v["state"]) for v in vs) for h, vs in per_host.items()}


def test_hosts_register_in_join_order_and_a_new_host_is_used(registry_cluster: LocalCluster):
    lc = registry_cluster
    cf = lc.cluster_file
    before = create(cf)
    st = status(cf)
    assert list(st["hosts"]) == ["h0", "h1", "h2"]  # type: ignore[call-overload]
    assert all(h["alive"] and h["lease"] for h in st["hosts"].values())  # type: ignore[attr-defined]
    lc.add_host("h3", gpus=2)  # no restart of the others
    assert list(status(cf)["hosts"]) == ["h0", "h1", "h2", "h3"]  # type: ignore[call-overload]
    out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=2", "--hosts",
                            "h2:2,h3:2", "--json").stdout)
    assert out["version"] == 2
    assert json.loads(ptcctl(cf, "checksum", "j", "--json").stdout) == before
    assert json.loads(ptcctl(cf, "verify", "j", "--json").stdout)["ok"]
    co = Coordinator(Cluster.load(cf))
    try:
        assert ("h3", 2) in [(h, v) for h, vs in versions(co).items() for v, s in vs
                             if s == "committed"]
    finally:
        co.cluster.close()


@pytest.mark.fuse
def test_a_joined_host_mounts_the_cluster(registry_cluster: LocalCluster):
    lc = registry_cluster
    cf = lc.cluster_file
    create(cf)
    lc.add_host("h3", gpus=2, mount=True)
    ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=2", "--hosts", "h0:2,h3:2")
    config = lc.mount_dir("h3") / "j" / "config.json"
    wait_for("h3's mount shows version 2",
             lambda: config.exists() and json.loads(config.read_text())["version"] == 2,
             timeout_s=10)
    # a whole tensor, served from h3's store and from h0 (found through the registry)
    name = "encoder.layers.1.mlp.dense_h_to_4h.weight"
    served = np.load(lc.mount_dir("h3") / "j" / "tensors" / f"{name}.npy")
    co = Coordinator(Cluster.load(cf))
    try:
        assert served.tobytes() == co.fetch_tensor(co.state("j"), name).tobytes()
    finally:
        co.cluster.close()


def test_a_killed_daemon_is_down_after_its_lease(fast_registry_cluster: LocalCluster):
    lc = fast_registry_cluster
    cf = lc.cluster_file
    lc.kill("h1")  # SIGKILL: no goodbye, the lease runs out

    def h1_down() -> bool:
        h1 = status(cf)["hosts"]["h1"]  # type: ignore[index]
        return h1["lease"] is False and not h1["alive"]

    wait_for("h1 shown down", h1_down, timeout_s=float(FAST["PTC_REGISTRY_TTL_S"]) + 10)
    out = ptcctl(cf, "status").stdout
    assert "h1" in out and "DOWN (lease expired)" in out
    lc.start("h1")  # it comes back in its old place
    wait_for("h1 up again", lambda: status(cf)["hosts"]["h1"]["lease"])  # type: ignore[index]
    assert list(status(cf)["hosts"]) == ["h0", "h1", "h2"]  # type: ignore[call-overload]


def test_two_coordinators_never_reconfigure_one_job_at_once(registry_cluster: LocalCluster,
                                                             monkeypatch: pytest.MonkeyPatch):
    cf = registry_cluster.cluster_file
    before = create(cf)
    # the first stops after staging, holding the lock
    with paused(cf, "staged", "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts",
                "h1:4") as first:
        co = Coordinator(Cluster.load(cf))
        try:
            monkeypatch.setenv("PTC_LOCK_WAIT_S", "1")
            with pytest.raises(JobBusy, match=f"ptcctl pid {first.pid} on"):
                co.reconfigure("j", parse_config("tp=2,dp=2", "h0:2,h2:2"))
            monkeypatch.delenv("PTC_LOCK_WAIT_S")
            r = ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=2", "--hosts", "h0:2,h2:2",
                       check=False, env={"PTC_LOCK_WAIT_S": "1"})
            assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
            assert f"being changed by ptcctl pid {first.pid}" in r.stderr
        finally:
            co.cluster.close()
    # the second waits out the dead one's lease, and its own reconfiguration runs whole
    out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=2", "--hosts",
                            "h0:2,h2:2", "--json").stdout)
    assert out["version"] == 2
    assert json.loads(ptcctl(cf, "checksum", "j", "--json").stdout) == before


def test_concurrent_reconfigurations_in_threads_run_one_at_a_time(
        registry_cluster: LocalCluster):
    two_at_once(registry_cluster.cluster_file)


def test_concurrent_reconfigurations_with_the_file_registry(local_cluster):
    two_at_once(local_cluster(3, keys=False).cluster_file)


def two_at_once(cf: Path) -> None:
    """Two coordinators of one process reconfigure one job at once: both
    succeed, one after the other (the second waits for the lock and plans
    from the first's version), and every byte is kept."""
    before = create(cf)
    targets = [("tp=4,dp=1", "h1:4"), ("tp=2,dp=2", "h0:2,h2:2")]
    results: list[object] = [None, None]

    def run(i: int) -> None:
        co = Coordinator(Cluster.load(cf))
        try:
            to, hosts = targets[i]
            results[i] = co.reconfigure("j", parse_config(to, hosts)).new.version
        except Exception as e:  # compared below
            results[i] = e
        finally:
            co.cluster.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(r for r in results if isinstance(r, int)) == [2, 3], results
    assert json.loads(ptcctl(cf, "checksum", "j", "--json").stdout) == before


def test_coordinator_killed_after_the_decision_daemons_roll_forward(
        registry_cluster: LocalCluster):
    cf = registry_cluster.cluster_file
    before = create(cf)
    with paused(cf, "decided", "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts", "h2:4"):
        pass
    co = Coordinator(Cluster.load(cf))
    try:
        # no command: the daemons commit version 2 themselves, from etcd's record
        def all_committed() -> bool:
            return all((2, "committed") in vs for vs in versions(co).values())

        wait_for("every host committed version 2 on its own", all_committed, timeout_s=10)
        assert co.state("j").version == 2
        assert co.checksums(co.state("j")) == before
    finally:
        co.cluster.close()
    assert json.loads(ptcctl(cf, "verify", "j", "--json").stdout)["ok"]


def test_coordinator_killed_before_the_decision_is_aborted(registry_cluster: LocalCluster):
    cf = registry_cluster.cluster_file
    # a job of the same name, reconfigured to version 2 and deleted: its decision goes too
    create(cf)
    ptcctl(cf, "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts", "h2:4")
    ptcctl(cf, "job", "delete", "j")
    before = create(cf)
    with paused(cf, "staged", "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts", "h2:4"):
        pass
    co = Coordinator(Cluster.load(cf))
    try:
        # once the dead coordinator's lock runs out, the daemons drop version 2
        def none_staging() -> bool:
            return all(s == "committed" for vs in versions(co).values() for _, s in vs)

        wait_for("version 2 aborted on every host", none_staging, timeout_s=15)
        assert co.state("j").version == 1
        assert co.checksums(co.state("j")) == before
    finally:
        co.cluster.close()
    out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts", "h2:4",
                            "--json").stdout)
    assert out["version"] == 2
    assert json.loads(ptcctl(cf, "checksum", "j", "--json").stdout) == before


def test_file_registry_lock_names_the_holder(local_cluster, monkeypatch: pytest.MonkeyPatch):
    """Without etcd the lock is held on a majority of the file's hosts."""
    lc = local_cluster(3, keys=False)
    cf = lc.cluster_file
    before = create(cf)
    with paused(cf, "told", "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts", "h1:4",
                env=FAST) as first:
        r = ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=2", "--hosts", "h0:2,h2:2",
                   check=False, env={"PTC_LOCK_WAIT_S": "1"})
        assert r.returncode != 0 and f"being changed by ptcctl pid {first.pid}" in r.stderr
    # the decision reached every host before any commit: they commit it themselves
    co = Coordinator(Cluster.load(cf))
    try:
        wait_for("every host committed version 2",
                 lambda: all((2, "committed") in vs for vs in versions(co).values()))
        assert co.checksums(co.state("j")) == before
    finally:
        co.cluster.close()


def test_a_save_is_kept_open_and_its_commit_rolls_forward(fast_registry_cluster: LocalCluster):
    from tests.test_saving import new_values, save_ranks

    cf = fast_registry_cluster.cluster_file
    create(cf)
    co = Coordinator(Cluster.load(cf))
    try:
        version = save_ranks(co, "j", step=10)
        # the reconciler leaves an open save alone: it is the writers'
        time.sleep(5 * float(FAST["PTC_RECONCILE_S"]) + float(FAST["PTC_LOCK_TTL_S"]))
        assert all((version, "staging") in vs for h, vs in versions(co).items()
                   if h in ("h0", "h1"))
        with paused(cf, "decided", "commit", "j", "--step", "10"):
            pass
        wait_for("the save committed on every host",
                 lambda: all((version, "committed") in vs for vs in versions(co).values()),
                 timeout_s=10)
        state = co.state("j")
        assert (state.version, state.step) == (version, 10)
        for spec in state.model_spec().tensors_for(1):
            assert np.array_equal(co.fetch_tensor(state, spec.name), new_values(spec, 10))
    finally:
        co.cluster.close()


def test_file_registry_next_command_aborts_an_undecided_version(local_cluster):
    """Without etcd no daemon aborts on its own: the next command does,
    once the dead coordinator's lock has run out, and then runs whole."""
    cf = local_cluster(3, keys=False).cluster_file
    before = create(cf)
    with paused(cf, "staged", "reconfigure", "j", "--to", "tp=4,dp=1", "--hosts", "h2:4"):
        pass
    out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=2", "--hosts",
                            "h0:2,h2:2", "--json").stdout)
    assert out["version"] == 2  # the dead one's version 2 was aborted, not kept
    co = Coordinator(Cluster.load(cf))
    try:
        assert all(s == "committed" for vs in versions(co).values() for _, s in vs)
        assert co.checksums(co.state("j")) == before
    finally:
        co.cluster.close()


def test_ptcd_refuses_to_join_in_one_line(tmp_path: Path):
    from ptcfs.server.testing.localcluster import free_port, ptcd_command

    cf = tmp_path / "cluster.toml"
    cf.write_text(f'[cluster]\ninsecure = true\nregistry = "etcd://127.0.0.1:{free_port()}"\n')

    def ptcd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ptcd_command(), "--cluster", str(cf), "--host-id", "h9", *args],
                              capture_output=True, text=True, timeout=60)

    r = ptcd("--store", str(tmp_path / "h9"))  # no address, and none in the file
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"ptcd: error: host 'h9' is not in {cf}: give its --address tcp://HOST:PORT and "
        "--store DIR to join the registry"]
    r = ptcd("--address", f"tcp://127.0.0.1:{free_port()}", "--store", str(tmp_path / "h9"))
    assert r.returncode == 1  # no etcd there
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ptcd: error: the registry etcd://127.0.0.1:") and \
        "does not answer" in last and "Traceback" not in r.stderr


#: Where the coordinator is killed → the version every mount shows after,
#: with etcd and with the file registry (whose decision is the hosts' own
#: record: a coordinator killed before telling any host leaves no decision).
KILL_POINTS = {"staged": (1, 1), "decided": (2, 1), "told": (2, 2), "committing": (2, 2)}


@pytest.mark.fuse
@pytest.mark.parametrize("registry, point", [
    # the file registry's kill points before the commit are the etcd cases' twins, and
    # "told" ends as "committing" does
    pytest.param(r, p, marks=pytest.mark.extended)
    if (r == "file" and p != "committing") or p == "told"
    else (r, p) for r in ("etcd", "file") for p in KILL_POINTS])
def test_mounts_agree_within_seconds_of_a_killed_coordinator(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: str, point: str):
    # the daemons look at decisions often; the leases stay the default (the rerun's
    # lock must not run out on a loaded machine)
    monkeypatch.setenv("PTC_RECONCILE_S", FAST["PTC_RECONCILE_S"])
    want = KILL_POINTS[point][0 if registry == "etcd" else 1]
    with contextlib.ExitStack() as stack:
        url = None
        if registry == "etcd":
            url = stack.enter_context(LocalEtcd(tmp_path / "registry")).url
        lc = LocalCluster(tmp_path / "cluster")
        stack.callback(lc.down)
        lc.up(3, keys=False, registry=url, mount=True)
        cf = lc.cluster_file
        before = create(cf)
        with paused(cf, point, "reconfigure", "j", "--to", "tp=2,dp=3", "--hosts",
                    "h0:2,h1:2,h2:2"):
            pass
        killed = time.monotonic()

        def shown() -> set[str]:
            return {os.readlink(lc.mount_dir(h) / "j" / "config.json") for h in lc.mounted}

        wait_for(f"every mount shows version {want}",
                 lambda: shown() == {f"versions/{want}/config.json"}, timeout_s=15)
        print(f"{registry}, killed at {point}: mounts agree on version {want} "
              f"{time.monotonic() - killed:.2f} s after")
        # the next command finds a whole job, and a rerun succeeds
        assert json.loads(ptcctl(cf, "checksum", "j", "--json").stdout) == before
        out = json.loads(ptcctl(cf, "reconfigure", "j", "--to", "tp=2,dp=1", "--hosts", "h2:2",
                                "--json").stdout)
        assert out["version"] == want + 1
        assert json.loads(ptcctl(cf, "checksum", "j", "--json").stdout) == before


def test_a_host_whose_lease_ran_out_is_healed_without_a_command(
        tmp_path: Path, etcd: LocalEtcd, fast: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PTC_HEAL_AFTER_S", "1")
    lc = LocalCluster(tmp_path / "cluster")
    try:
        lc.up(4, gpus=1, keys=False, registry=etcd.url)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "g", "--model", SMALL, "--optimizer", "adam",
               "--config", "tp=2,dp=2", "--hosts", "h0:1,h1:1,h2:1,h3:1", "--seed", "3")
        before = json.loads(ptcctl(cf, "checksum", "g", "--json").stdout)
        lc.kill("h1", signal.SIGKILL)

        def healed() -> bool:
            co = Coordinator(Cluster.load(cf))
            try:
                st = co.state("g")
                return st.lost == ("h1",) and co.verify(st) == []
            finally:
                co.cluster.close()

        # no ptcctl command: h0, the first host up, repairs once h1's lease is out
        wait_for("the copies h1 held restored on the others", healed, timeout_s=60)
        lc.kill("h0", signal.SIGKILL)  # a second loss, after the repair: nothing lost
        assert json.loads(ptcctl(cf, "checksum", "g", "--json").stdout) == before
    finally:
        lc.down()


def test_a_decision_a_full_store_cannot_record_is_a_store_error(tmp_path: Path):
    """``decide`` on a host whose store's filesystem is full fails with a
    StoreError that says so (it was an internal error with a traceback in
    the daemon's log)."""
    lc = LocalCluster(tmp_path / "c")
    lc.write(1)
    store = lc.dir / "h0"
    store.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "ptcfs-test", str(store)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        lc.start("h0", env={"PTC_STORE_ROOM": "0"})
        with open(store / "filler", "wb") as f:
            try:
                for _ in range(8):
                    f.write(bytes(1 << 20))
                    f.flush()
            except OSError:
                pass  # full
        c = client(lc, "h0")
        try:
            with pytest.raises(StoreError, match="cannot record the decision of job 'j'.*"
                                                 "No space left"):
                c.call("decide", record={"job": "j", "new": 2})
        finally:
            c.close()
    finally:
        lc.down()
        subprocess.run(["umount", "-l", str(store)], check=True)
