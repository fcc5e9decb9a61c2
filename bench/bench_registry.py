"""The registry's costs and reaction times, with a real etcd and real daemons.

1. **Lock and decision**: a job lock taken and released, and a decision
   recorded, in etcd and with the file registry (a majority of 3 daemons);
   median of ``--repeat``.
2. **A reconfiguration's overhead**: ``Coordinator.reconfigure`` of a small
   GPT (tp=2,dp=2 ↔ tp=4,dp=1) on 3 hosts, etcd registry against the file's,
   median of ``--repeat``.
3. **A dead host**: seconds from ``kill -9`` of a daemon to the registry
   showing it down (its lease, ``PTC_REGISTRY_TTL_S``).
4. **A dead coordinator**: seconds from ``kill -9`` of ``ptcctl`` after the
   decision to every host having committed on its own (``PTC_RECONCILE_S``),
   and, before the decision, to every host having aborted (the lock's lease,
   ``PTC_LOCK_TTL_S``, then a reconcile).

    python bench/bench_registry.py [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.server.net.registry import holder_name
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.server.testing.localetcd import LocalEtcd
from ptcfs.sharding import parse_config

SMALL = "gpt:layers=4,hidden=128,heads=8,vocab=1000,seq=64"
CONFIGS = [("tp=4,dp=1", "h1:4"), ("tp=2,dp=2", "h0:2,h2:2")]


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def until(ok: Callable[[], bool], timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"not within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def ptcctl(cf: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(Path(sys.executable).with_name("ptcctl")), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PTC_CLUSTER=str(cf), **env))


def states(co: Coordinator) -> list[tuple[int, str]]:
    per_host, _ = co.host_versions("j")
    return [(v["version"], v["state"]) for vs in per_host.values() for v in vs]


def one_cluster(tmp: Path, registry: str | None, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with LocalCluster(tmp / ("etcd" if registry else "file")) as lc:
        lc.up(3, keys=False, registry=registry)
        cf = lc.cluster_file
        subprocess.run([str(Path(sys.executable).with_name("ptcctl")), "job", "create", "j",
                        "--model", SMALL, "--optimizer", "adam", "--config", "tp=2,dp=2",
                        "--hosts", "h0:2,h1:2"], check=True, capture_output=True,
                       env=dict(os.environ, PTC_CLUSTER=str(cf)))
        co = Coordinator(Cluster.load(cf))
        reg = co.cluster.registry

        def lock_cycle() -> None:
            with reg.lock("bench", holder_name()) as lock:
                reg.decide("bench", {"job": "bench", "new": 0, "hosts": []}, lock)

        out["lock_decide_release_s"] = median_s(lock_cycle, repeat)
        n = [0]

        def reconfigure() -> None:
            to, hosts = CONFIGS[n[0] % 2]
            n[0] += 1
            co.reconfigure("j", parse_config(to, hosts))

        out["reconfigure_s"] = median_s(reconfigure, repeat)
        if registry:
            p = ptcctl(cf, "reconfigure", "j", "--to", *_next(n), PTC_TEST_PAUSE_AT="decided")
            assert p.stderr is not None and p.stderr.readline().startswith("paused")
            p.kill()
            p.wait()
            t0 = time.monotonic()
            until(lambda: all(s == "committed" for _, s in states(co)))
            out["roll_forward_after_kill_s"] = time.monotonic() - t0
            p = ptcctl(cf, "reconfigure", "j", "--to", *_next(n), PTC_TEST_PAUSE_AT="staged")
            assert p.stderr is not None and p.stderr.readline().startswith("paused")
            p.kill()
            p.wait()
            t0 = time.monotonic()
            until(lambda: all(s == "committed" for _, s in states(co)))
            out["abort_after_kill_s"] = time.monotonic() - t0
            lc.kill("h2")
            t0 = time.monotonic()
            until(lambda: any(m.host.name == "h2" and m.up is False for m in reg.members()))
            out["host_down_after_kill_s"] = time.monotonic() - t0
        co.cluster.close()
    return out


def _next(n: list[int]) -> tuple[str, str, str]:
    to, hosts = CONFIGS[n[0] % 2]
    n[0] += 1
    return to, "--hosts", hosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, LocalEtcd(Path(d) / "registry") as etcd:
        results = {"file": one_cluster(Path(d), None, args.repeat),
                   "etcd": one_cluster(Path(d), etcd.url, args.repeat)}
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    settings = {k: os.environ.get(k, "default") for k in
                ("PTC_REGISTRY_TTL_S", "PTC_LOCK_TTL_S", "PTC_RECONCILE_S")}
    print(f"registry costs and reaction times ({settings})")
    for kind, r in results.items():
        for k, v in r.items():
            print(f"  {kind:<5} {k:<28} {v * 1000:9.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
