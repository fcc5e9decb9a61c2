"""Every benchmark side by side with its peers, in one command (``bench/run``).

Sections, each run as its own process (``bench/<script> --json``) so one
failing does not stop the others and each starts with clean memory:

- ``reshard``  bench_reshard.py   ptcfs vs PyTorch DCP vs centralized
- ``planner``  bench_planner.py   ours vs HotSPa's greedy vs round-robin
- ``data``     bench_resume.py    ptcfs dataset views vs mosaicml-streaming
- ``fuse``     bench_fuse.py      /ptc mount vs /dev/shm vs LMDB direct
- ``wire``     bench_wire.py      sealed reads vs CurveZMQ vs no keys vs ZeroMQ
- ``scaling``  bench_scaling.py   reconfigure and plan times, with a PNG
- ``cluster``  bench_cluster.py   shaped netns cluster: vs the link limit and
                                  DCP over HTTP (needs root), with a PNG

Modes: full (default), ``--quick`` (smaller sizes, under 5 minutes on 2
cores) and ``--smoke`` (tiny sizes, one run: checks the harness, its
figures mean nothing). A section that cannot run is reported as missing,
with why, never as zeros. Exit status 1 when a section is missing or a
correctness check fails (different bytes than DCP, duplicates or skips,
a planner case worse than HotSPa's greedy). ``cluster`` is skipped, and
says why, where network namespaces cannot be made (not root, no iproute2).

    bench/run [--quick | --smoke] [--json] [--only SECTION ...] [--results PATH]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_cluster
import bench_deps
import bench_planner
import bench_reshard
import bench_resume
import bench_scaling
import bench_wire
import report
from common import ROOT, machine

from ptcfs.server.testing.netnscluster import netns_problem

BENCH = ROOT / "bench"
QUICK_RESHARD = "gpt:layers=4,hidden=512,heads=8,vocab=50176,seq=1024"

# section → mode → (script, arguments, timeout in seconds)
SECTIONS: dict[str, dict[str, tuple[str, list[str], int]]] = {
    "reshard": {
        "full": ("bench_reshard.py", ["--runs", "3"], 1200),
        "quick": ("bench_reshard.py", ["--runs", "3", "--model", QUICK_RESHARD], 400),
        "smoke": ("bench_reshard.py", ["--runs", "1", "--model", bench_reshard.SMOKE_MODEL,
                                       "--transitions", "1"], 240),
    },
    "planner": {
        "full": ("bench_planner.py", ["--runs", "3"], 900),
        "quick": ("bench_planner.py", ["--runs", "3", "--quick"], 300),
        "smoke": ("bench_planner.py", ["--runs", "1", "--smoke"], 120),
    },
    "data": {
        "full": ("bench_resume.py", ["--runs", "3"], 900),
        "quick": ("bench_resume.py", ["--runs", "3", "--samples", "24576", "--length", "128"],
                  300),
        "smoke": ("bench_resume.py", ["--runs", "1", "--samples", "576", "--length", "8",
                                      "--targets", "1"], 240),
    },
    "fuse": {
        "full": ("bench_fuse.py", ["--gib", "1", "--runs", "3"], 600),
        "quick": ("bench_fuse.py", ["--gib", "0.5", "--runs", "3"], 300),
        "smoke": ("bench_fuse.py", ["--gib", "0.02", "--runs", "1"], 120),
    },
    "wire": {
        "full": ("bench_wire.py", ["--mib", "256", "--runs", "5"], 300),
        "quick": ("bench_wire.py", ["--mib", "128", "--runs", "3"], 200),
        "smoke": ("bench_wire.py", ["--mib", "8", "--runs", "1"], 120),
    },
    "scaling": {
        "full": ("bench_scaling.py", ["--runs", "3", "--mode", "full"], 1200),
        "quick": ("bench_scaling.py", ["--runs", "3", "--mode", "quick"], 300),
        "smoke": ("bench_scaling.py", ["--runs", "1", "--mode", "smoke"], 120),
    },
    "cluster": {
        "full": ("bench_cluster.py", ["--runs", "2"], 1800),
        "quick": ("bench_cluster.py", ["--quick"], 400),
        "smoke": ("bench_cluster.py", ["--mode", "smoke"], 240),
    },
}


def _say(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def run_section(name: str, mode: str, extra: list[str]) -> dict[str, Any]:
    """One section's JSON, or ``{"missing": why}``."""
    script, args, timeout = SECTIONS[name][mode]
    cmd = [sys.executable, str(BENCH / script), "--json", *args, *extra]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"missing": f"{script} did not finish in {timeout} s"}
    took = time.perf_counter() - t0
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"missing": f"{script} exited {r.returncode} without figures: {tail}"}
    out: dict[str, Any] = json.loads(lines[-1])
    if name == "planner":
        out = {"cases": out["planner"]}
    out["seconds"] = round(took, 1)
    if r.returncode != 0:
        out["exit_status"] = r.returncode
    return out


def for_json(results: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` object: ``planner`` is the list of its cases (its
    running time moves to ``planner_seconds``); other sections as they are."""
    out = dict(results)
    planner = results.get("planner")
    if isinstance(planner, dict) and "cases" in planner:
        out["planner"] = planner["cases"]
        out["planner_seconds"] = planner.get("seconds")
    return out


def checks(results: dict[str, Any]) -> list[str]:
    """Correctness failures across sections (empty when all hold)."""
    bad = []
    rs = results.get("reshard", {})
    if rs and "missing" not in rs and not rs.get("identical", False):
        bad.append("reshard: ptcfs and DCP handed some rank different bytes")
    data = results.get("data", {})
    if "missing" not in data and (data.get("duplicates") or data.get("skipped")):
        bad.append(f"data: ptcfs had {data.get('duplicates')} duplicates and "
                   f"{data.get('skipped')} skips after resuming")
    cl = results.get("cluster", {})
    if "missing" not in cl and "identical" in cl and not cl["identical"]:
        bad.append("cluster: checksums changed, or DCP loaded different bytes")
    for c in results.get("planner", {}).get("cases", []):
        if c.get("worse_than_greedy"):
            bad.append(f"planner: ours is worse than HotSPa's greedy on {c['case']}")
    for name, sec in results.items():
        if isinstance(sec, dict) and "missing" in sec:
            bad.append(f"{name}: missing ({sec['missing']})")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller sizes, < 5 min on 2 cores")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run these sections")
    ap.add_argument("--dir", help="where stores, checkpoints and shards go (default /tmp)")
    ap.add_argument("--results", help="write the Markdown report here, in place of the "
                                      "report at its top, its other sections kept "
                                      "(default: bench/RESULTS.md; none with --smoke or --only)")
    ap.add_argument("--no-install", action="store_true",
                    help="do not install the bench extra when it is missing")
    args = ap.parse_args(argv)
    m = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.dir:
        try:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--dir {args.dir}: cannot make it: {e.strerror}")
    missing_deps = bench_deps.ensure(install=not args.no_install, say=_say)
    command = "bench/run " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    results: dict[str, Any] = {"mode": m, "command": command.strip(), "machine": machine(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    t0 = time.perf_counter()
    for name in args.only or list(SECTIONS):
        extra: list[str] = []
        if args.dir and name in ("reshard", "data", "scaling"):
            extra += ["--dir", args.dir]
        if name == "scaling":
            png = BENCH / "scaling.png" if m != "smoke" else Path(
                args.dir or "/tmp") / "ptc-bench-scaling-smoke.png"
            extra += ["--png", str(png) if "matplotlib" not in missing_deps else ""]
        if name == "cluster":
            png = BENCH / "cluster.png" if m != "smoke" else Path(
                args.dir or "/tmp") / "ptc-bench-cluster-smoke.png"
            extra += ["--png", str(png) if "matplotlib" not in missing_deps else ""]
            if args.dir:
                extra += ["--dir", args.dir]
        if name == "data" and "streaming" in missing_deps:
            results[name] = {"missing": "mosaicml-streaming is not installed "
                                        "(run bench/run without --no-install)"}
            continue
        if name == "cluster" and netns_problem():
            results[name] = {"not_run": f"cannot make network namespaces: {netns_problem()}"}
            _say(f"{name}: skipped: {results[name]['not_run']}")
            continue
        _say(f"{name} ({m}) ...")
        results[name] = run_section(name, m, extra)
        sec = results[name]
        _say(f"{name}: missing: {sec['missing']}" if "missing" in sec
             else f"{name}: done in {sec['seconds']:.0f} s")
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    results["failures"] = checks(results)
    text = report.render(results, {"reshard": bench_reshard.render,
                                   "planner": lambda r: bench_planner.render(r["cases"]),
                                   "data": bench_resume.render,
                                   "scaling": bench_scaling.render,
                                   "wire": bench_wire.render,
                                   "cluster": bench_cluster.render})
    # a partial run (--only, --smoke) leaves the full run's report in bench/RESULTS.md
    results_path = args.results or (None if m == "smoke" or args.only
                                    else str(BENCH / "RESULTS.md"))
    if results_path:
        path = Path(results_path)
        old = path.read_text() if path.exists() else ""
        path.write_text(report.merged(old, report.markdown(results, text)))
        _say(f"wrote {results_path} (its sections after the report kept)")
    print(json.dumps(for_json(results)) if args.json else text)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
