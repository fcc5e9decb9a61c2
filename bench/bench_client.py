"""The training client against its peers, same run, same bytes.

1. **Loading a rank's state** (a GPT with Adam state, tp=2: one rank's
   sub-tensors, ``--model``): ptcfs ``load_rank`` from the rank's local
   daemon into CPU tensors, against ``torch.load`` of the same tensors
   saved with ``torch.save`` in one file, and against DCP
   (``torch.distributed.checkpoint.load``) of the same state dict into
   preallocated tensors. The files sit in ``--dir`` (default /dev/shm) and
   are read from the page cache, as ptcfs reads its LMDB map from memory.
   Best of ``--repeat``; GB = 1e9 bytes.
   Where CUDA is present (``--device``, default ``cuda`` there), the same
   rank is loaded onto the GPU too: ptcfs ``load_rank`` against
   ``torch.load(map_location=...)`` and DCP into device tensors, and
   against the bound of any load from host memory, the copy of as many
   bytes from pinned host memory to the device, measured in the same run.
2. **Migration in place**: the job is reconfigured, then each new rank is
   built from what an old rank holds (``migrate``, on ``--device``); bytes
   kept on the device against fetched, and the time against loading the
   new rank from scratch.
3. **Resume** (unless ``--no-resume``): the example job (examples/train_gpt.py)
   runs on 4 workers, saves step 5 and stops at 7; 2 workers restart it:
   wall time from that save (when ``job.save`` returned; its commit follows
   in the background, before the workers stop) to the restarted job's first
   step, and its parts (reconfiguration, loading, first step).

    python bench/bench_client.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.migrate import migrate
from ptcfs.client.torch.state import load_rank
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import parse_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = "gpt:layers=4,hidden=768,heads=12,vocab=32000,seq=1024"
QUICK = "gpt:layers=2,hidden=256,heads=4,vocab=8000,seq=256"


def best(fn: Any, repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def ptcctl(cf: Path, *args: str) -> None:
    subprocess.run([str(Path(sys.executable).with_name("ptcctl")), *args], check=True,
                   env=dict(os.environ, PTC_CLUSTER=str(cf)), stdout=subprocess.DEVNULL)


def bench_load(cluster: Cluster, files: Path, repeat: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    rs = load_rank(cluster, "bench", 0, device="cpu", progress=False)
    nbytes = rs.nbytes
    t_ptc = best(lambda: load_rank(cluster, "bench", 0, device="cpu", progress=False), repeat)
    pt = files / "rank0.pt"
    torch.save(rs.tensors, pt)
    t_torch = best(lambda: torch.load(pt, map_location="cpu", weights_only=True), repeat)
    d = files / "rank0.dcp"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(rs.tensors, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
        target = {n: torch.empty_like(t) for n, t in rs.tensors.items()}
        t_dcp = best(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(str(d)),
                                      no_dist=True), repeat)
    same = all(torch.equal(target[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in rs.tensors.items())
    return {"bytes": nbytes, "tensors": len(rs.tensors), "ptcfs_s": t_ptc,
            "torch_load_s": t_torch, "dcp_load_s": t_dcp, "dcp_same_bytes": same,
            "ptcfs_gbps": nbytes / t_ptc / 1e9, "torch_load_gbps": nbytes / t_torch / 1e9,
            "dcp_gbps": nbytes / t_dcp / 1e9,
            "ptcfs_vs_torch_load": t_torch / t_ptc, "ptcfs_vs_dcp": t_dcp / t_ptc}


def bench_device(cluster: Cluster, files: Path, repeat: int, dev: torch.device
                 ) -> dict[str, Any]:
    """Rank 0 onto ``dev`` (after :func:`bench_load`, whose files it reads)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def synced(fn: Any) -> Any:
        def run() -> None:
            fn()
            torch.cuda.synchronize(dev)
        return run

    cpu = load_rank(cluster, "bench", 0, device="cpu", progress=False)
    nbytes = cpu.nbytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_h2d = best(synced(lambda: on_dev.copy_(pinned, non_blocking=True)), repeat)
    got = load_rank(cluster, "bench", 0, device=dev, progress=False)
    same = all(torch.equal(got.tensors[n].cpu().view(torch.uint8), t.view(torch.uint8))
               for n, t in cpu.tensors.items())
    del got
    t_ptc = best(synced(lambda: load_rank(cluster, "bench", 0, device=dev, progress=False)),
                 repeat)
    t_torch = best(synced(lambda: torch.load(files / "rank0.pt", map_location=dev,
                                             weights_only=True)), repeat)
    target = {n: torch.empty_like(t, device=dev) for n, t in cpu.tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_dcp = best(synced(lambda: dcp.load(
            target, storage_reader=dcp.FileSystemReader(str(files / "rank0.dcp")),
            no_dist=True)), repeat)
    return {"device": str(dev), "name": torch.cuda.get_device_name(dev), "bytes": nbytes,
            "same_bytes": same, "ptcfs_s": t_ptc, "torch_load_s": t_torch, "dcp_load_s": t_dcp,
            "h2d_pinned_s": t_h2d, "ptcfs_gbps": nbytes / t_ptc / 1e9,
            "torch_load_gbps": nbytes / t_torch / 1e9, "dcp_gbps": nbytes / t_dcp / 1e9,
            "h2d_pinned_gbps": nbytes / t_h2d / 1e9, "ptcfs_vs_torch_load": t_torch / t_ptc,
            "ptcfs_vs_dcp": t_dcp / t_ptc, "ptcfs_of_h2d_bound": t_h2d / t_ptc}


SCENARIOS = [  # (old, old hosts, new, new hosts)
    ("tp=2", "h0:2", "tp=4", "h0:2,h1:2"),
    ("tp=4", "h0:2,h1:2", "tp=2,dp=2", "h0:2,h1:2"),
    ("tp=2,dp=2", "h0:2,h1:2", "tp=1,dp=4", "h1:2,h0:2"),
]


def bench_migrate(cf: Path, cluster: Cluster, model: str, dev: torch.device
                  ) -> list[dict[str, Any]]:
    co = Coordinator(cluster)
    out = []
    for i, (old, oh, new, nh) in enumerate(SCENARIOS):
        job = f"mig{i}"
        ptcctl(cf, "job", "create", job, "--model", model, "--optimizer", "adam",
               "--config", old, "--hosts", oh, "--seed", "1")
        before = co.state(job)
        held = {r: load_rank(cluster, job, r, device=dev, progress=False)
                for r in range(before.config.world)}
        co.reconfigure(job, parse_config(new, nh))
        kept = fetched = 0
        t_mig = t_load = 0.0
        for rank in range(parse_config(new, nh).world):
            t0 = time.perf_counter()
            _, stats = migrate(cluster, held[rank % before.config.world], rank)
            t_mig += time.perf_counter() - t0
            t0 = time.perf_counter()
            load_rank(cluster, job, rank, device=dev, progress=False)
            t_load += time.perf_counter() - t0
            kept += stats.bytes_kept
            fetched += stats.bytes_fetched
        out.append({"from": f"{old} on {oh}", "to": f"{new} on {nh}", "bytes_kept": kept,
                    "bytes_fetched": fetched, "kept_fraction": kept / max(1, kept + fetched),
                    "migrate_s": t_mig, "load_from_scratch_s": t_load})
    return out


def bench_resume(cf: Path, tmp: Path) -> dict[str, Any]:
    data = tmp / "tokens.npy"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tokens.py"), str(data)],
                   check=True)
    metrics = tmp / "resume.jsonl"
    env = dict(os.environ, PTC_CLUSTER=str(cf), PTC_HOST="h0", OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    for n, extra in ((4, ["--exit-after", "7"]), (2, [])):
        subprocess.run([torchrun, "--standalone", f"--nproc-per-node={n}",
                        str(ROOT / "examples" / "train_gpt.py"), "--job", "resume", "--data",
                        str(data), "--steps", "8", "--metrics", str(metrics),
                        "--policy", "fixed-rule", *extra],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    events = [e for e in events if "event" in e]
    commit = [e for e in events if e["event"] == "save" and e["step"] == 5][0]
    resume = [e for e in events if e["event"] == "resume"][-1]
    first = [e for e in events if e["event"] == "first_step"][-1]
    return {"commit_to_first_step_s": first["time"] - commit["time"],
            "worker_start_to_first_step_s": first["since_start_s"],
            "reconfigure_s": resume["reconfigure_s"], "load_s": resume["load_s"],
            "first_step_s": first["since_resume_s"], "from": "tp=2,dp=2 (4 workers)",
            "to": resume["config"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"GPT preset (default {MODEL})")
    p.add_argument("--quick", action="store_true", help=f"a small model ({QUICK})")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where migrations build the new ranks, and a CUDA device to load onto "
                   "(default: cuda where CUDA is present, else cpu)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = a.model or (QUICK if a.quick else MODEL)
    try:
        dev = torch.device(a.device)
    except RuntimeError:
        p.error(f"--device {a.device!r} is not a torch device (cpu, cuda, cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available on this machine")
    result: dict[str, Any] = {"model": model, "dtype": "fp16", "optimizer": "adam",
                              "device": str(dev)}
    with tempfile.TemporaryDirectory(dir=a.dir) as files, \
            tempfile.TemporaryDirectory() as tmp:
        lc = LocalCluster(Path(tmp) / "cluster")
        try:
            lc.write(2, gpus=4)
            for h in ("h0", "h1"):
                lc.start(h)
            cf = lc.cluster_file
            ptcctl(cf, "job", "create", "bench", "--model", model, "--optimizer", "adam",
                   "--config", "tp=2", "--hosts", "h0:2", "--seed", "1")
            cluster = Cluster.load(cf)
            try:
                result["load"] = bench_load(cluster, Path(files), a.repeat)
                if dev.type == "cuda":
                    result["load_device"] = bench_device(cluster, Path(files), a.repeat, dev)
                result["migrate"] = bench_migrate(cf, cluster, model, dev)
            finally:
                cluster.close()
            if not a.no_resume:
                result["resume"] = bench_resume(cf, Path(tmp))
        finally:
            lc.down()
    if a.json:
        print(json.dumps(result))
        return 0
    ld = result["load"]
    print(f"model {model} fp16 + Adam; one rank of tp=2: {ld['bytes'] / 1e6:.0f} MB in "
          f"{ld['tensors']} tensors")
    print(f"load a rank   ptcfs {ld['ptcfs_gbps']:.2f} GB/s   torch.load "
          f"{ld['torch_load_gbps']:.2f} GB/s   DCP {ld['dcp_gbps']:.2f} GB/s   "
          f"(ptcfs x{ld['ptcfs_vs_torch_load']:.2f} torch.load, x{ld['ptcfs_vs_dcp']:.2f} DCP)")
    if "load_device" in result:
        gd = result["load_device"]
        print(f"onto {gd['device']} ({gd['name']})  ptcfs {gd['ptcfs_gbps']:.2f} GB/s   "
              f"torch.load {gd['torch_load_gbps']:.2f} GB/s   DCP {gd['dcp_gbps']:.2f} GB/s   "
              f"pinned host-to-device copy {gd['h2d_pinned_gbps']:.2f} GB/s   (ptcfs "
              f"x{gd['ptcfs_vs_torch_load']:.2f} torch.load, x{gd['ptcfs_vs_dcp']:.2f} DCP, "
              f"{100 * gd['ptcfs_of_h2d_bound']:.0f}% of the copy's rate; same bytes: "
              f"{gd['same_bytes']})")
    print(f"migrations on {result['device']}:")
    for m in result["migrate"]:
        print(f"migrate {m['from']:>18} -> {m['to']:<20} kept {m['bytes_kept'] / 1e6:7.1f} MB"
              f"  fetched {m['bytes_fetched'] / 1e6:7.1f} MB  ({100 * m['kept_fraction']:.0f}% "
              f"kept)  {m['migrate_s']:.2f} s vs {m['load_from_scratch_s']:.2f} s from scratch")
    if "resume" in result:
        r = result["resume"]
        print(f"resume {r['from']} -> {r['to']}: commit to first step "
              f"{r['commit_to_first_step_s']:.1f} s (worker start to first step "
              f"{r['worker_start_to_first_step_s']:.1f} s: reconfigure {r['reconfigure_s']:.2f}"
              f" s, load {r['load_s']:.2f} s, first step {r['first_step_s']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
