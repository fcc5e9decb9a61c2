"""Scaling curves: reconfiguration time as the model grows (real daemons),
planning time as the model grows and as the hosts grow (simulated), with a
PNG plot of all three.

- reconfigure: GPT with fp32 parameters and Adam, 4 sizes (more layers),
  tp=4 -> tp=2,dp=2 on 2 local hosts (``h0:2,h1:2``), across the daemons;
  median of ``--runs`` (each run goes back untimed);
- plan vs model: GPT-1.3B, 6.7B, 13B and 175B (fp16 + Adam),
  tp8,pp4,dp4 on 16 hosts -> tp8,pp4,dp3 on 12 hosts of 8 GPUs;
- plan vs hosts: GPT-13B (1.3B with ``--mode smoke``), tp8,pp4,dp=N/4 on
  N hosts -> dp=N/4-1 on N-4.

    .venv/bin/python bench/bench_scaling.py [--quick] [--png bench/scaling.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import ROOT, fmt_fig, put, table, timed

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.jobstate import JobState
from ptcfs.model.presets import parse_model
from ptcfs.plan.planner import plan
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import parse_config

RECONF_HOSTS = "h0:2,h1:2"
RECONF = ("tp=4", "tp=2,dp=2")
PLAN_MODELS = (("1.3B", "gpt:layers=24,hidden=2048,heads=16,vocab=51200"),
               ("6.7B", "gpt:layers=32,hidden=4096,heads=32,vocab=51200"),
               ("13B", "gpt:layers=40,hidden=5120,heads=40,vocab=51200"),
               ("175B", "gpt:layers=96,hidden=12288,heads=96,vocab=51200"))
SIZES = {"full": (1024, (1, 2, 4, 8)), "quick": (512, (1, 2, 4, 8)), "smoke": (64, (1, 2))}
HOSTS = {"full": (8, 32, 128, 512), "quick": (8, 16, 32, 64), "smoke": (8, 16)}


def _hosts(n: int) -> str:
    return ",".join(f"h{i}:8" for i in range(n))


def reconfigure_curve(hidden: int, layers: tuple[int, ...], runs: int,
                      directory: str | None) -> list[dict[str, Any]]:
    """Reconfiguration seconds for each model size, on one 2-host cluster."""
    out = []
    a, b = (parse_config(d, RECONF_HOSTS) for d in RECONF)
    with tempfile.TemporaryDirectory(prefix="ptc-bench-scaling-", dir=directory) as d:
        lc = LocalCluster(Path(d))
        lc.up(2, gpus=2, replicas=1)
        try:
            co = Coordinator(Cluster.load(lc.cluster_file))
            for n in layers:
                model = f"gpt:layers={n},hidden={hidden},heads=8,vocab=8192,seq=1024"
                job = f"s{n}"
                state = JobState(job, 1, model, "fp32", "adam", a, 0, 1, ("h0", "h1"))
                co.create(state, seed=0)
                times, moved = [], 0
                for _ in range(runs):
                    t0 = time.perf_counter()
                    r = co.reconfigure(job, b)
                    times.append(time.perf_counter() - t0)
                    moved = r.plan.bytes_cross_host
                    co.reconfigure(job, a)
                row: dict[str, Any] = {
                    "model": model, "state_bytes": sum(
                        s.nbytes for s in state.model_spec().tensors_for(1)),
                    "bytes_cross_host": moved}
                put(row, "seconds", times, 3)
                out.append(row)
            co.cluster.close()
        finally:
            lc.down()
    return out


def _plan_row(model_text: str, a: str, ah: str, b: str, bh: str, runs: int) -> dict[str, Any]:
    model = parse_model(model_text, dtype="fp16", optimizer="adam")
    old, new = parse_config(a, ah), parse_config(b, bh)
    times, transfers = [], 0
    for _ in range(runs):
        seconds, p = timed(lambda: plan(model, old, new))
        times.append(seconds)
        transfers = len(p.transfers)
    row: dict[str, Any] = {"params": sum(
        s.nbytes for s in model.tensors if not s.name.startswith("optim/")) // 2,
        "gpus": old.world, "hosts": len(old.hosts), "transfers": transfers}
    put(row, "seconds", times, 3)
    return row


def run(mode: str = "full", runs: int = 3, directory: str | None = None,
        png: Path | None = ROOT / "bench" / "scaling.png") -> dict[str, Any]:
    hidden, layers = SIZES[mode]
    out: dict[str, Any] = {"reconfigure_vs_size": reconfigure_curve(hidden, layers, runs,
                                                                    directory)}
    models = PLAN_MODELS[:2] if mode == "smoke" else PLAN_MODELS
    out["plan_vs_size"] = [{"model": name, **_plan_row(
        text, "tp=8,pp=4,dp=4", _hosts(16), "tp=8,pp=4,dp=3", _hosts(12), runs)}
        for name, text in models]
    name, text = PLAN_MODELS[0] if mode == "smoke" else PLAN_MODELS[2]
    out["plan_vs_hosts"] = [{"model": name, **_plan_row(
        text, f"tp=8,pp=4,dp={n // 4}", _hosts(n), f"tp=8,pp=4,dp={n // 4 - 1}",
        _hosts(n - 4), runs)} for n in HOSTS[mode]]
    if png is not None:
        out["png"] = str(plot(out, png))
    return out


def plot(r: dict[str, Any], path: Path) -> Path:
    """Three panels: reconfigure vs state, plan vs params, plan vs hosts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        (r["reconfigure_vs_size"], "state_bytes", 1e9, "state (GB, fp32 + Adam)",
         "reconfiguration time (s)", "tp4 -> tp2,dp2 on 2 local hosts"),
        (r["plan_vs_size"], "params", 1e9, "parameters (billions)", "planning time (s)",
         "plan: 128 -> 96 GPUs"),
        (r["plan_vs_hosts"], "hosts", 1, "hosts (8 GPUs each)", "planning time (s)",
         f"plan: GPT-{r['plan_vs_hosts'][0]['model']}, N -> N-4 hosts"),
    )
    for a, (rows, key, scale, xl, yl, title) in zip(ax, panels):
        xs = [row[key] / scale for row in rows]
        med = [row["seconds"] for row in rows]
        lo = [row["seconds"] - row["spread"]["seconds"][0] for row in rows]
        hi = [row["spread"]["seconds"][1] - row["seconds"] for row in rows]
        a.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3)
        a.set_xlabel(xl)
        a.set_ylabel(yl)
        a.set_title(title, fontsize=10)
        a.grid(alpha=0.3)
        if key != "state_bytes":
            a.set_xscale("log")
            a.set_xticks(xs, [row["model"] if key == "params" else f"{x:g}"
                              for row, x in zip(rows, xs)])
            a.xaxis.set_minor_formatter(NullFormatter())
        a.set_ylim(bottom=0)
    fig.suptitle("ptcfs scaling (medians of runs, bars: min-max)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(r: dict[str, Any]) -> str:
    rows = [["reconfigure", f"{x['state_bytes'] / 1e9:.2f} GB state",
             f"{x['bytes_cross_host'] / 1e9:.2f} GB across", fmt_fig(x, "seconds")]
            for x in r["reconfigure_vs_size"]]
    rows += [["plan", f"GPT-{x['model']} on {x['hosts']} hosts", f"{x['transfers']} transfers",
              fmt_fig(x, "seconds")] for x in r["plan_vs_size"]]
    rows += [["plan", f"GPT-{x['model']} on {x['hosts']} hosts ({x['gpus']} GPUs)",
              f"{x['transfers']} transfers", fmt_fig(x, "seconds")] for x in r["plan_vs_hosts"]]
    text = table(rows, ["what", "size", "moves", "time"])
    if "png" in r:
        text += f"\nplot: {r['png']}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(SIZES), default="full")
    ap.add_argument("--quick", action="store_true", help="same as --mode quick")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", help="where the hosts' stores live (default: a temporary folder)")
    ap.add_argument("--png", default=str(ROOT / "bench" / "scaling.png"),
                    help="where the plot goes ('' for none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mode = "quick" if args.quick else args.mode
    r = run(mode, args.runs, args.dir, Path(args.png) if args.png else None)
    print(json.dumps(r) if args.json else render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
