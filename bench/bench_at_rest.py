"""Reads before and after checksums at rest, side by side; and what the
checksums cost where they are paid (a put, a scrub).

Reads, paired: each checkout (``--before DIR``, e.g. ``git worktree add
/tmp/before <commit>``, and this one) brings up its own 2-host cluster with
h0's mount, from its own code, in a process of its own (``--side``), and
creates the same job in it (``--model`` at tp=4 over h0:2,h1:2, seed 0).
Both clusters stay up while this process reads, round after round, the
order alternating, the same reads from each: rank 0's files through h0's
mount (the **largest** four, then **all** of them; plain sequential
``readinto`` of one reused buffer, each file's pages dropped from the page
cache first, the mount's background warming off), and, asked of the
side's process, the client's ``read_into`` of the largest four and a whole
``load_rank`` of rank 0. Each round gives a ratio after / before per
figure; the figure is the median of those ratios, with the 10th-90th
percentile of them (reads do not check sums: the target is 1, within 5%).

At rest (each checkout in a process of its own, alternating, a store in
``--dir``): ``put`` of ``--mib`` MiB in PTC_STORE_CHUNK_BYTES chunks (after:
each with its xxHash), and a whole ``scrub`` of it (after only), in GB/s.

    .venv/bin/python bench/bench_at_rest.py --before /tmp/before [--rounds 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QUICK = "gpt:layers=2,hidden=512,heads=8,vocab=25088,seq=1024"
HOSTS = "h0:2,h1:2"
JOB = "stored"
BLOCK = 8 << 20
#: the figures, in the order shown
FIGURES = ("mount largest", "mount all", "client largest", "load_rank")


def _imports() -> dict[str, Any]:
    """What a side needs, from this checkout's layout or the one before it
    (modules moved when the house was laid out by role)."""
    try:
        from ptcfs.client.control.conn import Cluster
        from ptcfs.client.control.coordinator import Coordinator
        from ptcfs.client.torch.localread import source_for
        from ptcfs.client.torch.state import load_rank
        from ptcfs.server.testing.localcluster import LocalCluster
    except ImportError:
        from ptcfs.client.conn import Cluster  # type: ignore[no-redef,import-not-found,unused-ignore]
        from ptcfs.client.coordinator import Coordinator  # type: ignore[no-redef,import-not-found,unused-ignore]
        from ptcfs.client.localread import source_for  # type: ignore[no-redef,import-not-found,unused-ignore]
        from ptcfs.client.torchstate import load_rank  # type: ignore[no-redef,import-not-found,unused-ignore]
        from ptcfs.server.localcluster import LocalCluster  # type: ignore[no-redef,import-not-found,unused-ignore]
    return {"Cluster": Cluster, "Coordinator": Coordinator, "source_for": source_for,
            "load_rank": load_rank, "LocalCluster": LocalCluster}


def side(directory: Path, model: str) -> int:
    """One checkout's cluster, serving the reads asked on stdin (one JSON
    line each: ``{"read": "client"|"load_rank"}``; ``{}`` ends it)."""
    os.environ["PTC_MOUNT_WARM_BYTES"] = "0"  # no background reads by the mount
    from ptcfs.dtypes import numpy_dtype
    from ptcfs.jobstate import JobState
    from ptcfs.sharding import parse_config, rank_tensors

    m = _imports()
    with tempfile.TemporaryDirectory(prefix="ptc-at-rest-", dir=directory) as d:
        lc = m["LocalCluster"](Path(d) / "cluster")
        lc.up(2, gpus=2, replicas=1, mount=True)
        try:
            cluster = m["Cluster"].load(lc.cluster_file)
            co = m["Coordinator"](cluster)
            co.create(JobState(JOB, 1, model, "fp32", "adam", parse_config("tp=4", HOSTS), 0, 1,
                               ("h0", "h1")), seed=0)
            state = co.state(JOB)
            _quiet(cluster)
            parts = sorted(((spec, sl) for spec, sl in rank_tensors(state.model_spec(),
                                                                     state.config, 0)),
                           key=lambda x: -math.prod(x[1].local_shape(x[0].shape)))
            largest = parts[:4]
            outs = [np.empty(sl.local_shape(spec.shape), dtype=numpy_dtype(spec.dtype))
                    for spec, sl in largest]
            src = m["source_for"](cluster, "h0")
            print(json.dumps({"mount": str(lc.mount_dir("h0") / JOB / "ranks" / "0"),
                              "all": [spec.name for spec, _ in parts],
                              "largest": [spec.name for spec, _ in largest]}), flush=True)
            for line in sys.stdin:
                ask = json.loads(line)
                if not ask:
                    break
                t0 = time.perf_counter()
                if ask["read"] == "client":
                    for (spec, sl), out in zip(largest, outs):
                        src.read_into(JOB, state.version, spec.name, sl.key(), 0, out.nbytes, out)
                    nbytes = sum(o.nbytes for o in outs)
                else:
                    rs = m["load_rank"](cluster, JOB, 0, device="cpu", state=state,
                                        progress=False)
                    nbytes = rs.nbytes
                    del rs
                print(json.dumps({"s": time.perf_counter() - t0, "bytes": nbytes}), flush=True)
            cluster.close()
        finally:
            lc.down()
    return 0


def _quiet(cluster: Any, timeout_s: float = 300.0) -> None:
    """Until no daemon is making room for a next version (the zeros and
    buffers it writes after a commit) and no mount is warming its cache:
    neither may run during a measurement."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health, down = cluster.call_all("health")
        if not down and not any(h.get("making_room") or (h.get("mount") or {}).get("warming")
                                for h in health.values()):
            return
        time.sleep(0.2)  # polling the daemons' health: nothing to wait on
    print("bench_at_rest: the daemons did not go quiet; figures may be low", file=sys.stderr)


class Side:
    """A checkout's :func:`side` process, and what it said at start."""

    def __init__(self, checkout: Path, directory: Path, model: str):
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--before", "-", "--side",
             "--dir", str(directory), "--model", model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=checkout)
        self.said = self._answer()
        self.mount = Path(self.said["mount"])

    def _answer(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        line = out.readline() if out is not None else ""
        if not line:
            raise SystemExit(f"a side's cluster ended (exit {self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, read: str) -> float:
        """GB/s of one read done by the side's process."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"read": read}) + "\n")
        self.proc.stdin.flush()
        a = self._answer()
        return float(a["bytes"]) / a["s"] / 1e9

    def close(self) -> None:
        """End the side: its cluster goes down (it reads ``{}``, or its stdin ends)."""
        try:
            if self.proc.stdin is not None and self.proc.poll() is None:
                self.proc.stdin.write("{}\n")
                self.proc.stdin.close()
        except OSError:
            pass  # it ended already
        self.proc.wait(timeout=120)


def _read_files(mount: Path, names: list[str], buf: mmap.mmap) -> float:
    """GB/s of reading each file once, its pages dropped from the cache first."""
    t0 = time.perf_counter()
    total = 0
    view = memoryview(buf)
    for name in names:
        fd = os.open(mount / f"{name}.npy", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def paired_reads(before: Path, directory: Path, model: str, rounds: int) -> dict[str, Any]:
    """The figures of each round, after / before (module docstring)."""
    sides = {"before": Side(before, directory, model)}
    try:
        sides["after"] = Side(ROOT, directory, model)
        if sides["before"].said["all"] != sides["after"].said["all"]:
            raise SystemExit("the two checkouts lay out rank 0 differently; nothing to pair")
        buf = mmap.mmap(-1, BLOCK)
        buf.write(b"\0" * BLOCK)
        gbs: dict[str, dict[str, list[float]]] = {n: {f: [] for f in FIGURES} for n in sides}
        for i in range(rounds + 1):  # the first round warms both up and is not counted
            for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                s = sides[name]
                got = {"mount largest": _read_files(s.mount, s.said["largest"], buf),
                       "mount all": _read_files(s.mount, s.said["all"], buf),
                       "client largest": s.ask("client"), "load_rank": s.ask("load_rank")}
                if i:
                    for f, v in got.items():
                        gbs[name][f].append(v)
        buf.close()
    finally:
        for s in sides.values():
            s.close()
    out: dict[str, Any] = {}
    for f in FIGURES:
        ratios = sorted(a / b for a, b in zip(gbs["after"][f], gbs["before"][f]))
        q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [ratios[0]] * 9
        out[f] = {"before_gbs": round(statistics.median(gbs["before"][f]), 3),
                  "after_gbs": round(statistics.median(gbs["after"][f]), 3),
                  "ratio": round(statistics.median(ratios), 3),
                  "ratio_p10": round(q[0], 3), "ratio_p90": round(q[-1], 3)}
    return out


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
    ap.add_argument("--rounds", type=int, default=30, help="paired rounds of reads")
    ap.add_argument("--model", default=QUICK, help="the job read (a preset)")
    ap.add_argument("--mib", type=int, default=256, help="MiB put and scrubbed")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(at_rest(Path(args.dir), args.mib)))
        return 0
    if args.side:
        return side(Path(args.dir), args.model)
    out: dict[str, Any] = {"rounds": args.rounds, "model": args.model,
                           "reads": paired_reads(args.before.resolve(), Path(args.dir),
                                                 args.model, args.rounds)}
    rest: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(2):
        order = [("before", args.before), ("after", ROOT)]
        for name, checkout in (order if i % 2 == 0 else order[::-1]):
            rest[name].append(at_rest_run(checkout.resolve(), Path(args.dir), args.mib))
    out["at_rest"] = {
        "put_gbs_before": statistics.median(r["put_gbs"] for r in rest["before"]),
        "put_gbs_after": statistics.median(r["put_gbs"] for r in rest["after"]),
        "scrub_gbs": statistics.median(r["scrub_gbs"] for r in rest["after"])}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"reads, GB/s, {args.rounds} paired rounds (medians; ratio = after / before, "
          "median of the rounds' ratios, 10th-90th percentile)")
    print(f"  {'figure':<16} {'before':>8} {'after':>8} {'ratio':>7}  p10-p90")
    for name, f in out["reads"].items():
        print(f"  {name:<16} {f['before_gbs']:>8.3f} {f['after_gbs']:>8.3f} {f['ratio']:>7.3f}"
              f"  {f['ratio_p10']:.3f}-{f['ratio_p90']:.3f}")
    r = out["at_rest"]
    print(f"at rest ({args.mib} MiB): put {r['put_gbs_before']} GB/s before, "
          f"{r['put_gbs_after']} with checksums; a whole scrub {r['scrub_gbs']} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
