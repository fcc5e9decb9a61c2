"""Reading view entries against stored entries, through the mount and the
client, same run, same bytes.

Two jobs of one model and seed (so the same bytes) on a 2-host cluster
(``h0:2,h1:2``, stores and mounts in ``--dir``), both at tp=4 in the end:

- **stored**: created at tp=4: every entry holds its bytes itself;
- **viewed**: created at tp=2,dp=2 and resharded to tp=4 (nothing crosses
  hosts): every entry is a view of a tp=2,dp=2 entry.

Rank 0's sub-tensors (on h0) fall in two groups, found from the viewed
job's store: **contiguous** views (one stretch of their source: split along
the first dimension, or not split), the **largest** four of those (where
a read's speed shows more than the cost of opening many small files), and
**strided** ones (one run per row of the source: split along a later
dimension). For each group and job, runs alternating which job goes first:

- **mount**: every file ``<job>/ranks/0/<name>.npy`` of the group read
  through h0's mount with plain sequential ``readinto`` of one reused
  8 MiB buffer, after dropping its pages from the page cache
  (``posix_fadvise DONTNEED``), so each read goes through the mount's read
  path; the mount's background warming is off (``PTC_MOUNT_WARM_BYTES=0``);
- **client**: the group's sub-tensors read into preallocated arrays the
  way :func:`~ptcfs.client.torch.state.load_rank` reads them on CPU (the
  host's store read directly, one thread); and ``load_rank`` of the whole
  rank (both groups, ``PTC_CLIENT_READ_THREADS`` threads).

Figures are GB/s (1e9 bytes/s), medians of ``--runs`` runs with min-max;
ratio = viewed / stored (1 = as fast; the target for contiguous views is
>= 0.9). The bytes read are checked to be the same for both jobs.

    .venv/bin/python bench/bench_views.py [--quick] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from common import fmt_fig, put, table

from ptcfs import settings
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.localread import source_for
from ptcfs.dtypes import numpy_dtype
from ptcfs.jobstate import JobState
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import parse_config, rank_tensors

MODEL = "gpt:layers=8,hidden=768,heads=12,vocab=50176,seq=1024"
QUICK = "gpt:layers=2,hidden=512,heads=8,vocab=25088,seq=1024"
HOSTS = "h0:2,h1:2"
JOBS = ("stored", "viewed")
BLOCK = 8 << 20


def _read_file(path: Path, buf: mmap.mmap, crc: bool = False) -> tuple[int, int]:
    """(bytes, crc32 when ``crc``) of one sequential read of ``path`` into
    ``buf``, its pages dropped from the page cache first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(buf)
        total, value = 0, 0
        while n := os.readv(fd, [view]):
            if crc:
                value = zlib.crc32(view[:n], value)
            total += n
    finally:
        os.close(fd)
    return total, value


def _groups(cluster: Cluster, state: JobState) -> dict[str, list[tuple[str, str, Any]]]:
    """Rank 0's sub-tensors of the viewed job: contiguous and strided views,
    as (tensor, part, local shape and dtype)."""
    src = source_for(cluster, "h0")
    store = getattr(src, "store", None)
    if store is None:
        raise SystemExit("bench_views: the client cannot read h0's store directly "
                         "(PTC_CLIENT_LOCAL_STORE=0?)")
    chunk = int(settings.get("PTC_STORE_CHUNK_BYTES"))
    out: dict[str, list[tuple[str, str, Any]]] = {"contiguous": [], "strided": []}
    with store.reader() as r:
        for spec, sl in rank_tensors(state.model_spec(), state.config, 0):
            info = r.info("viewed", state.version, spec.name, sl.key())
            runs = sum(1 for _ in r.ranges("viewed", state.version, spec.name, sl.key()))
            group = "contiguous" if runs <= math.ceil(info.nbytes / chunk) + 1 else "strided"
            out[group].append((spec.name, sl.key(), (info.shape, info.dtype)))
    # the biggest files, where a read's own speed shows more than opening files
    out["largest"] = sorted(out["contiguous"], key=lambda x: -math.prod(x[2][0]))[:4]
    return out


def _mount_read(mount: Path, job: str, items: list[tuple[str, str, Any]],
                buf: mmap.mmap, crc: bool = False) -> tuple[float, int, int]:
    """(seconds, bytes, crc of the crcs when ``crc``) of reading the group's files."""
    t0 = time.perf_counter()
    total, crcs = 0, 0
    for name, _, _ in items:
        n, value = _read_file(mount / job / "ranks" / "0" / f"{name}.npy", buf, crc)
        total += n
        crcs = zlib.crc32(value.to_bytes(4, "little"), crcs)
    return time.perf_counter() - t0, total, crcs


def _client_read(cluster: Cluster, job: str, version: int,
                 items: list[tuple[str, str, Any]], outs: list[np.ndarray]) -> float:
    src = source_for(cluster, "h0")
    t0 = time.perf_counter()
    for (name, part, _), out in zip(items, outs):
        src.read_into(job, version, name, part, 0, out.nbytes, out)
    return time.perf_counter() - t0


def run(model: str, runs: int, directory: str) -> dict[str, Any]:
    os.environ["PTC_MOUNT_WARM_BYTES"] = "0"  # the daemons' mounts: no background reads
    from ptcfs.client.torch.state import load_rank

    with tempfile.TemporaryDirectory(prefix="ptc-bench-views-", dir=directory) as d:
        lc = LocalCluster(Path(d) / "cluster")
        lc.up(2, gpus=2, replicas=1, mount=True)
        buf = mmap.mmap(-1, BLOCK)
        buf.write(b"\0" * BLOCK)
        try:
            cluster = Cluster.load(lc.cluster_file)
            co = Coordinator(cluster)
            hosts = ("h0", "h1")
            for job, cfg in (("stored", "tp=4"), ("viewed", "tp=2,dp=2")):
                co.create(JobState(job, 1, model, "fp32", "adam", parse_config(cfg, HOSTS), 0, 1,
                                   hosts), seed=0)
            co.reconfigure("viewed", parse_config("tp=4", HOSTS))
            states = {job: co.state(job) for job in JOBS}
            groups = _groups(cluster, states["viewed"])
            mount = lc.mount_dir("h0")
            out: dict[str, Any] = {"model": model, "runs": runs}
            same = True
            for group, items in groups.items():
                if not items:
                    continue
                g: dict[str, Any] = {"tensors": len(items)}
                outs = [np.empty(shape, dtype=numpy_dtype(dt)) for _, _, (shape, dt) in items]
                times: dict[str, list[float]] = {f"{w}_{j}": [] for w in ("mount", "client")
                                                 for j in JOBS}
                crcs = {job: _mount_read(mount, job, items, buf, crc=True)[2] for job in JOBS}
                nbytes = 0
                for i in range(runs):
                    for job in (JOBS if i % 2 == 0 else JOBS[::-1]):
                        s, nbytes, _ = _mount_read(mount, job, items, buf)
                        times[f"mount_{job}"].append(nbytes / s / 1e9)
                        s = _client_read(cluster, job, states[job].version, items, outs)
                        times[f"client_{job}"].append(sum(o.nbytes for o in outs) / s / 1e9)
                same = same and crcs["stored"] == crcs["viewed"]
                g["bytes"] = nbytes
                for k, v in times.items():
                    put(g, f"{k}_gbs", v, 3)
                for w in ("mount", "client"):
                    g[f"{w}_ratio"] = round(g[f"{w}_viewed_gbs"] / g[f"{w}_stored_gbs"], 3)
                out[group] = g
            whole: dict[str, list[float]] = {j: [] for j in JOBS}
            nbytes = 0
            for i in range(runs):
                for job in (JOBS if i % 2 == 0 else JOBS[::-1]):
                    t0 = time.perf_counter()
                    rs = load_rank(cluster, job, 0, device="cpu", state=states[job],
                                   progress=False)
                    whole[job].append(rs.nbytes / (time.perf_counter() - t0) / 1e9)
                    nbytes = rs.nbytes
                    del rs
            lr: dict[str, Any] = {"bytes": nbytes}
            for j, v in whole.items():
                put(lr, f"{j}_gbs", v, 3)
            lr["ratio"] = round(lr["viewed_gbs"] / lr["stored_gbs"], 3)
            out["load_rank"] = lr
            out["rank_bytes"] = nbytes
            out["identical"] = same
            cluster.close()
        finally:
            buf.close()
            lc.down()
    return out


def render(r: dict[str, Any]) -> str:
    rows = []
    for group in ("contiguous", "largest", "strided"):
        g = r.get(group)
        if g is None:
            continue
        for w, label in (("mount", "mount, plain reads"), ("client", "client, read_into")):
            rows.append([f"{group} ({g['tensors']}, {g['bytes'] / 1e6:.0f} MB)", label,
                         fmt_fig(g, f"{w}_viewed_gbs", "GB/s"),
                         fmt_fig(g, f"{w}_stored_gbs", "GB/s"), f"{g[f'{w}_ratio']:.2f}"])
    lr = r["load_rank"]
    rows.append([f"rank 0 ({lr['bytes'] / 1e6:.0f} MB)", "client, load_rank",
                 fmt_fig(lr, "viewed_gbs", "GB/s"), fmt_fig(lr, "stored_gbs", "GB/s"),
                 f"{lr['ratio']:.2f}"])
    head = (f"{r['model']} fp32 + Adam at tp=4 on {HOSTS}, rank 0's files: views (after "
            f"tp=2,dp=2 -> tp=4) vs stored (created at tp=4); medians of {r['runs']} runs "
            f"(min-max); ratio = views / stored, target >= 0.90 for contiguous views; "
            f"same bytes: {'yes' if r['identical'] else 'NO'}\n")
    return head + table(rows, ["sub-tensors", "read", "views", "stored", "ratio"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help=f"GPT preset (default {MODEL})")
    ap.add_argument("--quick", action="store_true", help=f"a smaller model ({QUICK})")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                    help="where stores and mounts live")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.path.exists("/dev/fuse"):
        print("bench_views: /dev/fuse is missing; nothing to measure", file=sys.stderr)
        return 2
    r = run(args.model or (QUICK if args.quick else MODEL), args.runs, args.dir)
    print(json.dumps(r) if args.json else render(r))
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
