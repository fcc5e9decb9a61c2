"""Reads before and after checksums at rest, side by side; and what the
checksums cost where they are paid (a put, a scrub).

Reads: :mod:`bench_views` (a 2-host cluster, reads through h0's mount and
``load_rank``) run from two checkouts, ``--before DIR`` (a checkout of the
commit before, e.g. ``git worktree add /tmp/before <commit>``) and this
one, alternating, ``--rounds`` times each; figures are medians over the
rounds of each run's median (GB/s), ratio = after / before (reads do not
check sums: the target is 1, within 5%).

At rest (each checkout in a process of its own, alternating, a store in
``--dir``): ``put`` of ``--mib`` MiB in PTC_STORE_CHUNK_BYTES chunks (after:
each with its xxHash), and a whole ``scrub`` of it (after only), in GB/s.

    .venv/bin/python bench/bench_at_rest.py --before /tmp/before [--rounds 2] [--json]
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
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: bench_views' figures compared: (group, key)
FIGURES = [("largest", "mount_stored_gbs"), ("contiguous", "mount_stored_gbs"),
           ("strided", "mount_stored_gbs"), ("load_rank", "stored_gbs"),
           ("largest", "client_stored_gbs")]


def views_run(checkout: Path, runs: int) -> dict[str, Any]:
    """One run of that checkout's bench_views.py --quick, with its code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    r = subprocess.run([sys.executable, str(checkout / "bench" / "bench_views.py"), "--quick",
                        "--runs", str(runs), "--json"], capture_output=True, text=True,
                       env=env, cwd=checkout, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"bench_views.py of {checkout} failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def at_rest(directory: Path, mib: int) -> dict[str, float]:
    """Put and scrub rates of this checkout's store."""
    from ptcfs.store.lmdb_store import LmdbStore

    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        store = LmdbStore(Path(d) / "s")
        try:
            v = store.begin("j")
            t0 = time.perf_counter()
            store.put("j", v, "w", "all", data, data.shape, "uint8")
            put_s = time.perf_counter() - t0
            store.commit("j", v)
            out = {"put_gbs": round(data.nbytes / put_s / 1e9, 3)}
            if hasattr(store, "scrub"):  # the checkout before has none
                t0 = time.perf_counter()
                found, after, read = store.scrub(None, budget=1 << 62)
                scrub_s = time.perf_counter() - t0
                if found or after is not None or read != data.nbytes:
                    raise SystemExit(f"the scrub of a healthy store found {found}")
                out["scrub_gbs"] = round(data.nbytes / scrub_s / 1e9, 3)
        finally:
            store.close()
    return out


def at_rest_run(checkout: Path, directory: Path, mib: int) -> dict[str, float]:
    """:func:`at_rest` in a process importing that checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--before", "-",
                        "--child", "--dir", str(directory), "--mib", str(mib)],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the put of {checkout} failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the commit before")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each checkout, alternating")
    ap.add_argument("--runs", type=int, default=3, help="bench_views.py --runs")
    ap.add_argument("--mib", type=int, default=256, help="MiB put and scrubbed")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(at_rest(Path(args.dir), args.mib)))
        return 0
    got: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    rest: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = [("before", args.before), ("after", ROOT)]
        for name, checkout in (order if i % 2 == 0 else order[::-1]):
            got[name].append(views_run(checkout.resolve(), args.runs))
            rest[name].append(at_rest_run(checkout.resolve(), Path(args.dir), args.mib))
    out: dict[str, Any] = {"rounds": args.rounds, "runs": args.runs, "reads": {}}
    for group, key in FIGURES:
        b = statistics.median(r[group][key] for r in got["before"])
        a = statistics.median(r[group][key] for r in got["after"])
        out["reads"][f"{group} {key}"] = {"before": b, "after": a,
                                          "ratio": round(a / b, 3) if b else None}
    out["at_rest"] = {
        "put_gbs_before": statistics.median(r["put_gbs"] for r in rest["before"]),
        "put_gbs_after": statistics.median(r["put_gbs"] for r in rest["after"]),
        "scrub_gbs": statistics.median(r["scrub_gbs"] for r in rest["after"])}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"reads, GB/s (medians of {args.rounds} rounds of bench_views.py --quick "
          f"--runs {args.runs}, alternating)")
    print(f"  {'figure':<34} {'before':>8} {'after':>8} {'ratio':>7}")
    for name, f in out["reads"].items():
        print(f"  {name:<34} {f['before']:>8.3f} {f['after']:>8.3f} {f['ratio']:>7}")
    r = out["at_rest"]
    print(f"at rest ({args.mib} MiB): put {r['put_gbs_before']} GB/s before, "
          f"{r['put_gbs_after']} with checksums; a whole scrub {r['scrub_gbs']} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
