"""Reconfigurations on a real multi-host cluster with shaped links, against
the network's limit and against PyTorch DCP loading from shared storage, in
the same run.

A netns cluster (``deploy/netns-cluster.sh``; needs root): every host a
``ptcd`` in its own network namespace with one rank slot (``gpus = 1``,
``replicas = 2``), every host's link shaped to ``--rate`` both ways, and a
storage namespace behind its own link (``--storage-rate``, default the
same) serving a DCP checkpoint over HTTP. The job: a GPT with fp32
parameters and Adam, created at ``tp=2,dp=1`` on h0,h1. Cases:

- scale-out: ``tp=2,dp=1`` on 2 hosts -> ``tp=2,dp=N/2`` on N hosts
  (N = 4, 6, 8; the plot of time vs hosts);
- scale-in: ``tp=2,dp=2`` on h0-h3 -> ``tp=1,dp=2`` on h0,h1;
- replace: ``tp=2,dp=2`` on h0-h3 -> the same on h0,h1,h4,h5;
- lose a host: ``tp=2,dp=2`` on h0-h3, ``kill -9`` of h3's daemon, then
  ``tp=2,dp=2`` on h0,h1,h2,h4 (h3 is restarted after the run).

Figures per case (medians of ``--runs``; before each run the job goes back
to the old layout, untimed, and the daemons settle):

- **ptcfs**: ``Coordinator.reconfigure`` end to end (what ``ptcctl
  reconfigure`` runs, from the root namespace; with a lost host, finding
  it lost is part of it), up to the committed new version on every host.
  Not included: each rank's load into training memory from its own host
  (a local copy, no link).
- **limit**: the most bytes one host's link carried in or out (the stage's
  received counters; replicas included) / the link rate. ``vs limit`` is
  limit / ptcfs (1 = the link's speed).
- **DCP**: every host of the new layout loads its ranks' DTensors with
  ``dcp.load`` from a checkpoint saved by the old layout's ranks, reading
  it over HTTP (byte ranges) from the storage namespace through its own
  link, all hosts at once (loaders started and torch imported beforehand).
  Its own limit: the bytes through the storage link / its rate, or the
  most one host received / its rate, whichever is more.
- **cores**: CPU seconds per second of wall time used by the run's own
  processes (the daemons and this process for ptcfs; the loaders and the
  storage server for DCP), out of the machine's cores; and **idle**, the
  machine's idle CPU share (``/proc/stat``; other users of the machine count
  there). Cores well below the machine's, with idle time left, mean the
  links, not the cores, set the pace.

Checks: the job's checksums are unchanged after each case, and every
tensor DCP loaded equals the job's values (first run of each case).

    sudo .venv/bin/python bench/bench_cluster.py [--quick] [--rate 200mbit] [--runs 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_reconfigure import settle
from cluster_dcp import SaveRank
from common import ROOT, fmt_fig, put, ratio, table
from ranks import Ranks

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator, ReconfigureResult
from ptcfs.jobstate import JobState
from ptcfs.server.testing.netnscluster import NetnsCluster, netns_problem
from ptcfs.sharding import parse_config
from ptcfs.types import ParallelConfig

JOB, SEED = "cluster", 7
MODELS = {"full": "gpt:layers=2,hidden=768,heads=12,vocab=8192,seq=1024",
          "quick": "gpt:layers=2,hidden=512,heads=8,vocab=8192,seq=1024",
          "smoke": "gpt:layers=1,hidden=128,heads=4,vocab=1024,seq=128"}
SCALE_OUT = {"full": (4, 6, 8), "quick": (4, 6), "smoke": (4,)}
RATES = {"full": "200mbit", "quick": "200mbit", "smoke": "100mbit"}


def _hosts(names: list[int]) -> str:
    return ",".join(f"h{i}:1" for i in names)


def cases(mode: str) -> list[dict[str, Any]]:
    """(name, old layout, new layout, host killed first)."""
    out = [{"case": f"scale-out 2 -> {n} hosts", "hosts": n,
            "old": ("tp=2,dp=1", _hosts([0, 1])),
            "new": (f"tp=2,dp={n // 2}", _hosts(list(range(n)))), "kill": None}
           for n in SCALE_OUT[mode]]
    base = ("tp=2,dp=2", _hosts([0, 1, 2, 3]))
    out += [{"case": "scale-in 4 -> 2 hosts (tp 2 -> 1)", "hosts": 2, "old": base,
             "new": ("tp=1,dp=2", _hosts([0, 1])), "kill": None},
            {"case": "replace h2,h3 by h4,h5", "hosts": 4, "old": base,
             "new": ("tp=2,dp=2", _hosts([0, 1, 4, 5])), "kill": None},
            {"case": "lose h3 (kill -9), h4 takes its place", "hosts": 4, "old": base,
             "new": ("tp=2,dp=2", _hosts([0, 1, 2, 4])), "kill": "h3"}]
    return out


def cpu_times() -> tuple[int, int]:
    """(idle incl. iowait, total) jiffies of the whole machine so far."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def idle_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return round((after[0] - before[0]) / total, 3) if total else 0.0


def busy_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by this process and by ``pids`` (all threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    t = os.times()
    total = t.user + t.system
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone (a killed host)
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def link_bytes(received: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per host, the bytes its link carried in and out (copies on one host
    cross no link)."""
    out: dict[str, dict[str, int]] = {}
    for dst, srcs in received.items():
        for src, n in srcs.items():
            if src != dst:
                out.setdefault(dst, {"in": 0, "out": 0})["in"] += n
                out.setdefault(src, {"in": 0, "out": 0})["out"] += n
    return out


class Loaders:
    """One DCP loader process per host, in the host's network namespace."""

    def __init__(self, nc: NetnsCluster, hosts: list[str]):
        self.procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for h in hosts:
                self.procs[h] = subprocess.Popen(
                    nc.enter(h) + [sys.executable, str(ROOT / "bench" / "cluster_dcp.py")],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for h, p in self.procs.items():
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the DCP loader of {h} did not start")
        except BaseException:
            self.close()
            raise

    def load(self, url: str, model: str, cfg: ParallelConfig, degrees: str, hosts: str,
             verify: bool) -> tuple[float, dict[str, dict[str, Any]]]:
        """Every host of ``cfg`` loads its ranks at once: (wall seconds, per host)."""
        ranks: dict[str, list[int]] = {}
        r = 0
        for h in cfg.hosts:
            ranks[h.name] = list(range(r, r + h.gpus))
            r += h.gpus
        seed = str(SEED) if verify else "-"
        t0 = time.perf_counter()
        for h, rs in ranks.items():
            p = self.procs[h]
            assert p.stdin is not None
            p.stdin.write(f"load {url} {model} {degrees} {hosts} "
                          f"{','.join(map(str, rs))} {seed}\n")
            p.stdin.flush()
        out = {}
        for h in ranks:
            stdout = self.procs[h].stdout
            assert stdout is not None
            out[h] = json.loads(stdout.readline() or '{"error": "the loader died"}')
        wall = time.perf_counter() - t0
        bad = {h: o["error"] for h, o in out.items() if "error" in o}
        if bad:
            raise RuntimeError(f"DCP load failed: {bad}")
        return wall, out

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def close(self) -> None:
        for p in self.procs.values():
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _to(co: Coordinator, nc: NetnsCluster, degrees: str, hosts: str) -> None:
    """The job at ``degrees`` on ``hosts`` (untimed), every host up and settled."""
    for h in co.cluster.hosts:
        if h not in nc.procs:
            nc.start(h)
    co.cluster.call_all("ping")  # hosts restarted answer again
    cfg = parse_config(degrees, hosts)
    if co.state(JOB).config != cfg:
        co.reconfigure(JOB, cfg)
    settle(co)


def run_case(co: Coordinator, nc: NetnsCluster, loaders: Loaders, model: str, c: dict[str, Any],
             runs: int, before: dict[str, str]) -> dict[str, Any]:
    rate_bps = nc.rate_bps / 8
    storage_bps = nc.storage_rate_bps / 8
    new_cfg = parse_config(*c["new"])
    t: dict[str, list[float]] = {k: [] for k in ("ptcfs_s", "limit_s", "dcp_s", "dcp_limit_s",
                                                 "ptcfs_idle", "dcp_idle", "ptcfs_cores",
                                                 "dcp_cores")}
    out: dict[str, Any] = {"case": c["case"], "hosts": c["hosts"], "old": " on ".join(c["old"]),
                           "new": " on ".join(c["new"])}
    for i in range(runs):
        _to(co, nc, *c["old"])
        if c["kill"]:
            nc.kill(c["kill"], signal.SIGKILL)
        ours = [p.pid for p in nc.procs.values()]
        cpu0, busy0 = cpu_times(), busy_seconds(ours)
        t0 = time.perf_counter()
        r: ReconfigureResult = co.reconfigure(JOB, new_cfg)
        t["ptcfs_s"].append(time.perf_counter() - t0)
        t["ptcfs_idle"].append(idle_share(cpu0, cpu_times()))
        t["ptcfs_cores"].append((busy_seconds(ours) - busy0) / t["ptcfs_s"][-1])
        links = link_bytes(r.received)
        worst = max((max(v["in"], v["out"]) for v in links.values()), default=0)
        t["limit_s"].append(worst / rate_bps)
        if i == 0:
            out["ptcfs_link_bytes_max"] = worst
            out["ptcfs_bytes_cross_host"] = sum(v["in"] for v in links.values())
            out["lost"] = list(r.lost)
            out["phases_s"] = r.phases
            out["checksums_same"] = co.checksums(co.state(JOB)) == before
        settle(co)
        ours = loaders.pids() + ([nc.storage_proc.pid] if nc.storage_proc else [])
        cpu0, busy0 = cpu_times(), busy_seconds(ours)
        wall, per_host = loaders.load(nc.storage_url + "/ckpt", model, new_cfg, *c["new"],
                                      verify=i == 0)
        t["dcp_idle"].append(idle_share(cpu0, cpu_times()))
        t["dcp_cores"].append((busy_seconds(ours) - busy0) / wall)
        t["dcp_s"].append(wall)
        got = sum(o["received"] for o in per_host.values())
        t["dcp_limit_s"].append(max(got / storage_bps,
                                    max(o["received"] for o in per_host.values()) / rate_bps))
        if i == 0:
            out["dcp_bytes_read"] = got
            out["dcp_same"] = all(o["same"] for o in per_host.values())
    for k, v in t.items():
        put(out, k, v, 3)
    print(f"[bench_cluster] {c['case']}: ptcfs {out['ptcfs_s']:.2f} s, limit "
          f"{out['limit_s']:.2f} s, DCP {out['dcp_s']:.2f} s", file=sys.stderr, flush=True)
    out["vs_limit"] = ratio(out["limit_s"], out["ptcfs_s"])
    out["ratio_vs_dcp"] = ratio(out["ptcfs_s"], out["dcp_s"])
    out["dcp_vs_limit"] = ratio(out["dcp_limit_s"], out["dcp_s"])
    return out


def run(mode: str = "full", runs: int = 1, rate: str | None = None,
        storage_rate: str | None = None, directory: str | None = None,
        png: Path | None = ROOT / "bench" / "cluster.png") -> dict[str, Any]:
    model = MODELS[mode]
    rate = rate or RATES[mode]
    todo = cases(mode)
    n_hosts = max(6, max(c["hosts"] for c in todo))
    out: dict[str, Any] = {"mode": mode, "model": model, "dtype": "fp32", "optimizer": "adam",
                           "rate": rate, "storage_rate": storage_rate or rate,
                           "hosts": n_hosts, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="ptc-bench-cluster-", dir=directory) as d:
        nc = NetnsCluster(Path(d) / "cluster", rate=rate, storage_rate=storage_rate)
        loaders = None
        try:
            spec = nc.up(n_hosts, gpus=1)
            co = Coordinator(Cluster.load(nc.cluster_file))
            state = JobState(JOB, 1, model, "fp32", "adam", parse_config("tp=2,dp=1",
                                                                        _hosts([0, 1])),
                             0, co.cluster.replicas, tuple(h.name for h in spec.hosts))
            t0 = time.perf_counter()
            co.create(state, seed=SEED)
            out["create_s"] = round(time.perf_counter() - t0, 2)
            out["state_bytes"] = sum(s.nbytes for s in state.model_spec().tensors_for(1))
            before = co.checksums(co.state(JOB))
            t0 = time.perf_counter()
            with Ranks(2, SaveRank, model, "tp=2,dp=1", _hosts([0, 1]), SEED,
                       str(nc.storage_dir / "ckpt")):
                pass
            out["dcp_save_s"] = round(time.perf_counter() - t0, 2)
            loaders = Loaders(nc, [h.name for h in spec.hosts])
            # untimed: each loader's first load pays for lazy imports and set-up
            every = _hosts(list(range(n_hosts)))
            loaders.load(nc.storage_url + "/ckpt", model, parse_config(f"tp=2,dp={n_hosts // 2}",
                         every), f"tp=2,dp={n_hosts // 2}", every, verify=False)
            out["cases"] = [run_case(co, nc, loaders, model, c, runs, before) for c in todo]
            co.cluster.close()
        finally:
            if loaders is not None:
                loaders.close()
            nc.down()
    out["identical"] = all(c["checksums_same"] and c["dcp_same"] for c in out["cases"])
    if png is not None:
        out["png"] = plot(out, png)
    return out


def plot(r: dict[str, Any], path: Path) -> str:
    """Scale-out time vs hosts: ptcfs, its limit, DCP; or why there is none."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in r["cases"] if c["case"].startswith("scale-out")]
    xs = [c["hosts"] for c in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, style in (("ptcfs_s", "ptcfs reconfigure", "o-"),
                              ("limit_s", "network limit (busiest link)", "k--"),
                              ("dcp_s", "PyTorch DCP from shared storage (HTTP)", "s-")):
        ax.plot(xs, [c[key] for c in rows], style, label=label)
    ax.set_xlabel("hosts after the scale-out (from 2)")
    ax.set_ylabel("seconds")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"GPT {r['state_bytes'] / 1e9:.2f} GB (fp32 + Adam), links {r['rate']}, "
                 f"storage {r['storage_rate']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def render(r: dict[str, Any]) -> str:
    rows = []
    for c in r["cases"]:
        rows.append([c["case"], fmt_fig(c, "ptcfs_s"), fmt_fig(c, "limit_s"),
                     _f(c["vs_limit"]), fmt_fig(c, "dcp_s"), _f(c["ratio_vs_dcp"]),
                     f"{c['ptcfs_link_bytes_max'] / 1e6:.0f}/"
                     f"{c['ptcfs_bytes_cross_host'] / 1e6:.0f}",
                     f"{c['dcp_bytes_read'] / 1e6:.0f}",
                     f"{c['ptcfs_cores']:.2f}/{c['dcp_cores']:.2f}",
                     f"{c['ptcfs_idle']:.2f}/{c['dcp_idle']:.2f}",
                     "yes" if c["checksums_same"] and c["dcp_same"] else "NO"])
    head = (f"{r['model']} fp32 + Adam, {r['state_bytes'] / 1e9:.2f} GB of state; {r['hosts']} "
            f"hosts in network namespaces, links {r['rate']} each way, storage link "
            f"{r['storage_rate']}; medians of {r['runs']} run(s) (min-max)\n"
            "vs limit = limit / ptcfs; vs DCP = ptcfs / DCP; MB: busiest link / all across "
            "hosts (ptcfs), read from storage (DCP); cores: CPU seconds per second used by\n"
            "the run's own processes (daemons and ptcctl / loaders and storage server), of "
            f"{os.cpu_count()}; idle: the machine's idle CPU share (other users' work counts)\n")
    text = head + table(rows, ["case", "ptcfs", "limit", "vs limit", "DCP (HTTP)", "vs DCP",
                               "ptcfs MB", "DCP MB", "cores", "idle", "same bytes"])
    text += (f"\njob created in {r['create_s']:.1f} s; DCP checkpoint saved in "
             f"{r['dcp_save_s']:.1f} s")
    if "png" in r:
        text += f"\nplot: {r['png']}"
    return text


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(MODELS), default="full")
    ap.add_argument("--quick", action="store_true", help="same as --mode quick")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--rate", help="each host's link, both ways (default 200mbit; smoke 100mbit)")
    ap.add_argument("--storage-rate", help="the storage host's link (default: --rate)")
    ap.add_argument("--dir", help="where the cluster's files live (default: a temporary folder)")
    ap.add_argument("--png", default=str(ROOT / "bench" / "cluster.png"),
                    help="where the plot goes ('' for none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    problem = netns_problem()
    if problem:
        print(json.dumps({"missing": problem}) if args.json
              else f"bench_cluster: cannot run here: {problem}", file=sys.stdout if args.json
              else sys.stderr)
        return 2
    mode = "quick" if args.quick else args.mode
    r = run(mode, args.runs, args.rate, args.storage_rate, args.dir,
            Path(args.png) if args.png else None)
    print(json.dumps(r) if args.json else render(r))
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
