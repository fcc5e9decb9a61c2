"""The training loop's stall per save: ptcfs's background save against
``dcp.save`` and ``dcp.async_save`` of the same state, in one run.

One local host (a real ptcd); a job of ``--model`` with Adam on one rank,
loaded into CPU tensors. A loop runs ``--saves`` rounds of ``--work-ms`` of
compute (matrix products) and one save; the stall of a save is the time the
loop waits in it:

- ptcfs: :class:`~ptcfs.client.torch.background.BackgroundSaver`'s ``save``
  as the training face makes it (``late=True``: the copy to its staging
  buffers runs in the background alongside the next round's compute, and the
  loop waits for it, ``copied()``, before it changes the tensors, where the
  face's hook before the optimizer's step waits; that wait is shown apart),
  plus waiting for the save before it; the put and the commit run in the
  background;
- ``dcp.save``: the whole save, to a local folder;
- ``dcp.async_save``: waiting for the previous save's future, then the call
  (DCP stages the state to CPU and writes in a thread).

What the background work costs the loop's compute (the copy, DCP's
writer): the products of each round against rounds without saves, as
``compute_kept`` (1 = nothing lost; on a 2-core machine the background
threads share the cores with the loop).

The small save: the fixed cost of a blocking save of a tiny job (open the
save, put, commit), against one step of the examples (``--step-ms``); and
what the loop waits when that job saves in the background after every step
of ``--step-ms`` (each save first waits for the last one's commit).

    .venv/bin/python bench/bench_save.py [--saves 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import fmt_fig, put, ratio, table
from torch.distributed import checkpoint as dcp

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.saving import begin_save, commit_step
from ptcfs.client.torch.background import BackgroundSaver
from ptcfs.client.torch.state import load_rank, put_rank
from ptcfs.server.testing.localcluster import LocalCluster

MODEL = "llama:layers=4,hidden=512,heads=8,kv_heads=4,vocab=4096,ffn=1376,names=hf"
TINY = "gpt:layers=1,hidden=32,heads=2,vocab=64,seq=8"


def ptcctl(cf: Path, *args: str) -> None:
    exe = Path(sys.executable).with_name("ptcctl")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True,
                       env={"PTC_CLUSTER": str(cf), "PATH": "/usr/bin:/bin"})
    if r.returncode != 0:
        raise SystemExit(f"ptcctl {' '.join(args)}: {r.stderr.strip()}")


def work(a: torch.Tensor, ms: float) -> int:
    """About ``ms`` of compute (products of ``a``, timed by the clock); how
    many products it made."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        a @ a
        n += 1
    return n


def train(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        t.add_(1e-3)


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    lc = LocalCluster(tmp / "c")
    out: dict[str, Any] = {"model": args.model, "saves": args.saves, "work_ms": args.work_ms}
    try:
        lc.up(1, gpus=1)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "s", "--model", args.model, "--optimizer", "adam",
               "--dtype", "fp32", "--config", "dp=1", "--hosts", "h0:1", "--seed", "1")
        ptcctl(cf, "job", "create", "tiny", "--model", TINY, "--config", "dp=1", "--hosts", "h0:1",
               "--seed", "1")
        cluster = Cluster.load(cf)
        co = Coordinator(cluster)
        rs = load_rank(cluster, "s", 0)
        sd = rs.tensors
        out["state_mib"] = round(rs.nbytes / 2**20, 1)
        a = torch.randn(256, 256)
        stalls: dict[str, list[float]] = {"ptcfs": [], "dcp_save": [], "dcp_async_save": [],
                                          "ptcfs_copy": []}
        products: dict[str, list[int]] = {k: [] for k in ("none", "ptcfs", "dcp_async_save")}
        for _ in range(args.saves):
            products["none"].append(work(a, args.work_ms))
            train(sd)
        with BackgroundSaver(cluster, 0) as saver:
            copy_wait = 0.0
            for i in range(args.saves):
                products["ptcfs"].append(work(a, args.work_ms))
                t0 = time.perf_counter()
                saver.copied()  # the face's hook before the optimizer's step
                copy_wait = time.perf_counter() - t0
                train(sd)
                t1 = time.perf_counter()
                saver.wait()  # the previous save, if it is still storing
                saver.save(rs.state, i + 1, sd, late=True)
                if i:  # this round's stall: the last save's copy wait, this save's call
                    stalls["ptcfs"].append(copy_wait + time.perf_counter() - t1)
                    stalls["ptcfs_copy"].append(copy_wait)
        assert co.state("s").step == args.saves
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(args.saves):
                work(a, args.work_ms)
                train(sd)
                t0 = time.perf_counter()
                dcp.save(sd, checkpoint_id=str(tmp / "sync" / str(i)), no_dist=True)
                stalls["dcp_save"].append(time.perf_counter() - t0)
            pending = None
            for i in range(args.saves):
                products["dcp_async_save"].append(work(a, args.work_ms))
                train(sd)
                t0 = time.perf_counter()
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(sd, checkpoint_id=str(tmp / "async" / str(i)),
                                         no_dist=True)
                stalls["dcp_async_save"].append(time.perf_counter() - t0)
            if pending is not None:
                pending.result()
        for k, v in stalls.items():
            put(out, f"{k}_stall_s", v[1:] if len(v) > 2 and k.startswith("dcp") else v)
        base = statistics.median(products["none"])
        for k in ("ptcfs", "dcp_async_save"):  # the first round has no save behind it
            out[f"{k}_compute_kept"] = round(statistics.median(products[k][1:]) / base, 3)
        out["stall_vs_async_save"] = ratio(out["ptcfs_stall_s"], out["dcp_async_save_stall_s"])
        out["stall_vs_dcp_save"] = ratio(out["ptcfs_stall_s"], out["dcp_save_stall_s"])
        # the fixed cost of a small blocking save
        small = load_rank(cluster, "tiny", 0)
        fixed = []
        for i in range(args.saves):
            t0 = time.perf_counter()
            v = begin_save(co, "tiny")
            put_rank(cluster, small.state, v, 0, small.tensors, progress=False)
            commit_step(co, "tiny", i + 1)
            fixed.append(time.perf_counter() - t0)
        put(out, "small_save_s", fixed)
        out["small_save_vs_step"] = ratio(out["small_save_s"], args.step_ms / 1000)
        # the same small save in the background after every step of --step-ms:
        # what the loop waits for it (the last save's copy and commit, this call)
        stall = []
        with BackgroundSaver(cluster, 0) as saver:
            for i in range(args.saves * 4):
                work(a, args.step_ms)
                t0 = time.perf_counter()
                saver.copied()
                train(small.tensors)
                saver.wait()
                saver.save(small.state, args.saves + 1 + i, small.tensors, late=True)
                stall.append(time.perf_counter() - t0)
        put(out, "small_background_stall_s", stall[1:])
        out["small_background_vs_step"] = ratio(out["small_background_stall_s"],
                                                args.step_ms / 1000)
        cluster.close()
    finally:
        lc.down()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--work-ms", type=float, default=3000.0,
                    help="compute between saves, in which a background save runs")
    ap.add_argument("--step-ms", type=float, default=16.0,
                    help="one step of the examples, for the small save's ratio")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-save-"))
    try:
        out = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"state {out['state_mib']} MiB, {args.saves} saves, {args.work_ms:.0f} ms of work "
          "between saves")
    print(table([["ptcfs background", fmt_fig(out, "ptcfs_stall_s", "ms", 1000)],
                 ["dcp.save", fmt_fig(out, "dcp_save_stall_s", "ms", 1000)],
                 ["  of which the copy's wait", fmt_fig(out, "ptcfs_copy_stall_s", "ms", 1000)],
                 ["dcp.async_save", fmt_fig(out, "dcp_async_save_stall_s", "ms", 1000)]],
                ["save", "stall per save (median, min-max)"]))
    print(f"ptcfs stall / dcp.async_save stall: {out['stall_vs_async_save']}")
    print(f"compute kept while saving in the background: ptcfs {out['ptcfs_compute_kept']}, "
          f"dcp.async_save {out['dcp_async_save_compute_kept']}")
    print(f"small blocking save: {fmt_fig(out, 'small_save_s', 'ms', 1000)} "
          f"({out['small_save_vs_step']} x a {args.step_ms:.0f} ms step)")
    print(f"small save in the background after every step: "
          f"{fmt_fig(out, 'small_background_stall_s', 'ms', 1000)} of stall "
          f"({out['small_background_vs_step']} x a {args.step_ms:.0f} ms step)")


if __name__ == "__main__":
    main()
