"""A real multi-host cluster on this machine: every ptcd in its own network
namespace, links shaped with tc (ptcfs.server.testing.netnscluster). Needs root and
iproute2; skips itself otherwise."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.jobstate import JobState
from ptcfs.server.testing.localetcd import etcd_binary
from ptcfs.server.testing.netnscluster import NetnsCluster, netns_problem
from ptcfs.sharding import parse_config

pytestmark = [pytest.mark.multihost,
              pytest.mark.skipif(netns_problem() is not None, reason=str(netns_problem()))]

MODEL = "gpt:layers=2,hidden=256,heads=4,vocab=2048,seq=256"


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[NetnsCluster]:
    nc = NetnsCluster(tmp_path / "cluster", rate="1gbit")
    try:
        yield nc
    finally:
        nc.down()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _hosts(first: int, n: int) -> str:
    return ",".join(f"h{i}:1" for i in range(first, first + n))


@pytest.mark.slow
def test_16_hosts_scale_out_and_a_lost_host_keep_the_bytes(netns: NetnsCluster) -> None:
    netns.up(16, gpus=1)
    co = Coordinator(Cluster.load(netns.cluster_file))
    try:
        state = JobState("j", 1, MODEL, "fp32", "adam", parse_config("tp=2,dp=2", _hosts(0, 4)),
                         0, 2, tuple(f"h{i}" for i in range(16)))
        co.create(state, seed=3)
        before = co.checksums(co.state("j"))
        out = co.reconfigure("j", parse_config("tp=2,dp=8", _hosts(0, 16)))
        assert out.new.config.world == 16 and out.plan.bytes_cross_host > 0
        assert co.checksums(co.state("j")) == before
        rss = {h: _rss_mib(p.pid) for h, p in netns.procs.items()}
        print("ptcd RSS MiB after the scale-out: " + ", ".join(
            f"{h} {m:.0f}" for h, m in sorted(rss.items(), key=lambda x: int(x[0][1:]))))
        netns.kill("h15", signal.SIGKILL)
        out = co.reconfigure("j", parse_config("tp=2,dp=7", _hosts(0, 14)))
        assert out.lost == ("h15",)
        assert co.checksums(co.state("j")) == before
        assert co.verify(co.state("j")) == ["host h15 does not answer"]
    finally:
        co.cluster.close()


def test_down_after_an_interrupted_up_leaves_nothing(tmp_path: Path) -> None:
    d = tmp_path / "cluster"
    nc = NetnsCluster(d)
    up = subprocess.Popen([sys.executable, "-m", "ptcfs.server.testing.netnscluster", "up", "4",
                           str(d), "--no-mount"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        # interrupt it once the first host namespace exists: bridge made, hosts half-way
        while not any(n.endswith("-h0") for n in nc._namespaces()):
            assert up.poll() is None, "up ended before it was interrupted"
            assert time.monotonic() < deadline, "no host namespace after 30 s"
            time.sleep(0.01)
        up.send_signal(signal.SIGKILL)
        up.wait()
        assert nc._namespaces()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        nc.down()
    assert nc._namespaces() == []
    assert subprocess.run(["ip", "link", "show", f"{nc.prefix}c"],
                          capture_output=True).returncode != 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(d) not in ps
    assert not (d / "netns.json").exists()


@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (deploy/setup.sh)")
def test_registry_in_its_own_namespace_a_host_joins_and_a_dead_one_is_down(
        netns: NetnsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"PTC_REGISTRY_TTL_S": "2", "PTC_LOCK_TTL_S": "2",
                 "PTC_RECONCILE_S": "0.2"}.items():
        monkeypatch.setenv(k, v)
    netns.up(3, gpus=1, etcd=True, storage=False)
    assert netns.etcd is not None and netns.etcd.url.startswith("etcd://10.77.")
    co = Coordinator(Cluster.load(netns.cluster_file))
    try:
        state = JobState("j", 1, MODEL, "fp32", "adam", parse_config("tp=2", _hosts(0, 2)),
                         0, 2, ("h0", "h1", "h2"))
        co.create(state, seed=5)
        before = co.checksums(co.state("j"))
        netns.add_host("h3", gpus=1)  # joins through etcd; no daemon restarts
    finally:
        co.cluster.close()
    co = Coordinator(Cluster.load(netns.cluster_file))
    try:
        assert co.cluster.hosts == ["h0", "h1", "h2", "h3"]
        out = co.reconfigure("j", parse_config("tp=2,dp=2", _hosts(0, 4)))
        assert "h3" in {t.dst.host for t in out.plan.transfers}
        assert co.checksums(co.state("j")) == before
        netns.kill("h2", signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # its lease runs out in PTC_REGISTRY_TTL_S
            fresh = Cluster.load(netns.cluster_file)
            down = fresh.leased.get("h2") is False
            fresh.close()
            if down:
                break
            assert time.monotonic() < deadline, "h2 not down within 30 s of its kill"
            time.sleep(0.2)
    finally:
        co.cluster.close()
