"""Dataset views: reading a rank's samples through the /ptc mount against the
same samples from a local file, the time from a position commit to a rank's
first batch, and the token imbalance of the deal with and without balancing.

- mount: rank 0's ``/ptc/<job>/data/ranks/0/samples.npy`` opened with
  ``np.load(mmap_mode="r")`` and read batch by batch (``batches.npy``) into
  arrays, as a dataloader does; *cold* = the first read of that view,
  *repeat* = the next read of it (the kernel's page cache).
- local: the ingested ``.npy`` file (in the same filesystem as the stores),
  the same rows in the same order, each batch gathered with fancy indexing
  from ``np.load(mmap_mode="r")`` (what a shuffling loader does locally).
- local contiguous: the rank's rows written in order to a local ``.npy``
  first, then read like the mount (the best a pre-sharded copy can do).
- commit → first batch: ``commit_position`` (a new position version on every
  host) then opening ``samples.npy`` and reading the first batch through the
  mount of a host; median over commits that change the step and dp.
- imbalance: max/mean tokens per rank, averaged over the steps of an epoch,
  for a skewed length distribution (95 % of 50–500 tokens, 5 % of 4000).

Two hosts on loopback, every chunk on both (``replicas = 2``), so reads are
local to the mount's host; a tiny model job exists because the mount shows
the data of jobs with model state.

    .venv/bin/python bench/bench_data.py [--samples 65536] [--length 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import commit_position
from ptcfs.data.deal import deal_steps
from ptcfs.server.testing.localcluster import LocalCluster

TINY = "gpt:layers=1,hidden=16,heads=2,vocab=64,seq=8"


def ptcctl(cluster: Path, *args: str) -> str:
    exe = Path(sys.executable).with_name("ptcctl")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True,
                       env=dict(os.environ, PTC_CLUSTER=str(cluster)))
    if r.returncode != 0:
        raise SystemExit(f"ptcctl {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_batches(path: Path, counts: np.ndarray) -> tuple[float, int, int]:
    """Seconds, samples and bytes to read a view batch by batch."""
    t0 = time.perf_counter()
    rows = np.load(path, mmap_mode="r")
    at, nbytes = 0, 0
    for n in counts.tolist():
        batch = np.array(rows[at:at + n])
        nbytes += batch.nbytes
        at += n
    return time.perf_counter() - t0, at, nbytes


def read_gather(path: Path, ids: np.ndarray, counts: np.ndarray) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    rows = np.load(path, mmap_mode="r")
    at, nbytes = 0, 0
    for n in counts.tolist():
        batch = rows[np.sort(ids[at:at + n])][np.argsort(np.argsort(ids[at:at + n]))]
        nbytes += batch.nbytes
        at += n
    return time.perf_counter() - t0, at, nbytes


def rate(r: tuple[float, int, int]) -> dict[str, float]:
    s, n, b = r
    return {"samples_per_s": round(n / s), "MB_per_s": round(b / s / 1e6, 1),
            "seconds": round(s, 3)}


def imbalance(n: int, batch: int, dp: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    tokens = np.where(rng.random(n) < 0.05, 4000, rng.integers(50, 500, n))
    out = {}
    for name, tok in (("even", None), ("balanced", tokens)):
        views = deal_steps(n, 1, batch, 0, n // batch, dp, tok)
        per = np.array([[tokens[v.step_samples(s)].sum() for v in views]
                        for s in range(n // batch)])
        out[name] = round(float((per.max(axis=1) / per.mean(axis=1)).mean()), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--length", type=int, default=256, help="int32 tokens per sample")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--commits", type=int, default=5)
    ap.add_argument("--dir", help="where the stores go (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        raise SystemExit("bench_data needs FUSE (/dev/fuse and fusermount3)")
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-data-"))
    lc = LocalCluster(base / "cluster")
    out: dict[str, object] = {"samples": args.samples, "length": args.length,
                              "global_batch": args.global_batch}
    try:
        lc.up(2, gpus=2, replicas=2, mount=True)
        cf = lc.cluster_file
        src = base / "tokens.npy"
        arr = np.random.default_rng(0).integers(0, 50000, (args.samples, args.length),
                                                dtype=np.int32)
        np.save(src, arr)
        out["dataset_MB"] = round(arr.nbytes / 1e6, 1)
        del arr
        ptcctl(cf, "job", "create", "b", "--model", TINY, "--config", "dp=2", "--hosts",
               "h0:1,h1:1")
        t0 = time.perf_counter()
        ing = json.loads(ptcctl(cf, "data", "ingest", "b", str(src), "--format", "npy",
                                "--global-batch", str(args.global_batch), "--json"))
        out["ingest"] = {"seconds": round(time.perf_counter() - t0, 2),
                         "MB_per_s": round(ing["bytes"] * 2 / (time.perf_counter() - t0) / 1e6,
                                           1), "chunks": ing["chunks"], "copies": 2}
        view = lc.mount_dir("h0") / "b" / "data" / "ranks" / "0"
        counts = np.load(view / "batches.npy")
        pos = json.loads((lc.mount_dir("h0") / "b" / "data" / "position.json").read_text())
        first, stop = pos["view_steps"]
        ids = deal_steps(args.samples, pos["seed"], args.global_batch, first, stop,
                         pos["dp"])[0].samples
        out["mount_cold"] = rate(read_batches(view / "samples.npy", counts))
        out["mount_repeat"] = rate(read_batches(view / "samples.npy", counts))
        drop_cache(src)
        out["local_gather_cold"] = rate(read_gather(src, ids, counts))
        out["local_gather_repeat"] = rate(read_gather(src, ids, counts))
        contiguous = base / "rank0.npy"
        np.save(contiguous, np.load(src, mmap_mode="r")[ids])
        drop_cache(contiguous)
        out["local_contiguous_cold"] = rate(read_batches(contiguous, counts))
        out["local_contiguous_repeat"] = rate(read_batches(contiguous, counts))
        cluster = Cluster.load(cf)
        times, dp = [], 2
        try:
            for i in range(args.commits):
                dp = 3 if dp == 2 else 2
                t0 = time.perf_counter()
                commit_position(cluster, "b", 7 * (i + 1), dp)
                committed = time.perf_counter() - t0
                mnt = lc.mount_dir(f"h{i % 2}") / "b" / "data" / "ranks" / "0"
                n0 = int(np.load(mnt / "batches.npy")[0])
                np.array(np.load(mnt / "samples.npy", mmap_mode="r")[:n0])
                times.append((committed, time.perf_counter() - t0))
        finally:
            cluster.close()
        out["commit_to_first_batch_s"] = {
            "commit": round(statistics.median(t[0] for t in times), 3),
            "first_batch": round(statistics.median(t[1] for t in times), 3)}
        out["imbalance_max_over_mean"] = imbalance(8192, 64, 8)
    finally:
        lc.down()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:24} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
