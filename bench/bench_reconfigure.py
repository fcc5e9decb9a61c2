"""Reconfiguring a ≥1 GB GPT state across 2 local hosts, against the
centralized way (Tenplex-Central: gather the whole state on one host,
re-split it there, send each host its part), measured in the same run.

Also measures the ZeroMQ loopback limit here (4 MiB messages, copy=False,
between two processes) to put the achieved GB/s in context, and runs the
reconfiguration back and forth (``--rounds``, 5): the first round writes
the new version into fresh store space; once versions are deleted (two are
kept), later rounds write into pages the store freed, and from the fourth
round on the stores stop growing. Where touching
fresh memory is slow (VMs whose host takes back memory the guest does not
use), the two differ.

After every commit the daemons make room in their stores for the next
version in the background (``LmdbStore.make_room``) and touch staging
buffers for it; before each measurement the bench waits until they are
done (their ``health`` says so) and reports how long that took.
``--no-room`` turns it off (``PTC_STORE_ROOM=0``), to see what it saves.

Stores under ``--dir /dev/shm`` (tmpfs) use LMDB's writemap, stores on disk
do not (the store's default; ``PTC_STORE_WRITEMAP=0/1`` forces either); the
output says which (``writemap``).

    .venv/bin/python bench/bench_reconfigure.py [--model gpt:...] [--no-room] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.jobstate import JobState
from ptcfs.plan.reshard import cut, merge
from ptcfs.server.testing.localcluster import LocalCluster, free_port
from ptcfs.sharding import parse_config, placement

MODEL = "gpt:layers=8,hidden=2048,heads=16,vocab=50257,seq=1024"
OLD = ("tp=2,pp=1,dp=1", "h0:1,h1:1")
NEW = ("tp=1,pp=2,dp=1", "h0:1,h1:1")


def _sink(port: int, n: int, size: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.connect(f"tcp://127.0.0.1:{port}")
    for _ in range(n):
        s.recv(copy=False)
    s.close()
    ctx.term()


def zmq_loopback_gbps(total: int = 2 << 30, size: int = 4 << 20) -> float:
    """GB/s of 4 MiB messages sent with copy=False to another process."""
    port = free_port()
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 64)
    s.bind(f"tcp://127.0.0.1:{port}")
    n = total // size
    p = mp.get_context("spawn").Process(target=_sink, args=(port, n, size))
    p.start()
    buf = np.ones(size, dtype=np.uint8)
    t0 = time.perf_counter()
    for _ in range(n):
        s.send(buf, copy=False)
    p.join()
    dt = time.perf_counter() - t0
    s.close()
    ctx.term()
    return total / dt / 1e9


def settle(co: Coordinator) -> float:
    """Wait until no daemon is making room in its store; the seconds waited."""
    t0 = time.perf_counter()
    while True:
        health, _ = co.cluster.call_all("health")
        if not any(h["making_room"] for h in health.values()):
            return time.perf_counter() - t0
        time.sleep(0.05)  # polling the daemons' own report of their work


def central(co: Coordinator, old: JobState, new: JobState) -> float:
    """Gather every tensor on this process, re-split, send the parts out."""
    t0 = time.perf_counter()
    model = old.model_spec()
    co.cluster.call_hosts(co.cluster.hosts, "begin_at", job=old.job, version=new.version,
                          meta=new.to_meta())
    old_specs = {s.name: s for s in model.tensors_for(old.config.pp)}
    for spec in model.tensors_for(new.config.pp):
        src = old_specs.get(spec.name) or old_specs[str(spec.same_as)]
        parts = []
        for sl, hosts in placement(model, old.config, src, old.replicas, old.ring).items():
            data = co.cluster.client(next(iter(hosts))).read_box(
                old.job, old.version, src.name, sl.key(),
                tuple((0, n) for n in sl.local_shape(spec.shape)))
            parts.append((sl, np.frombuffer(data, dtype=np.uint8).view(
                np.float16 if spec.dtype == "fp16" else np.float32).reshape(
                sl.local_shape(spec.shape))))
        logical = merge(spec, parts)
        for sl, hosts in placement(model, new.config, spec, new.replicas, new.ring).items():
            sub = cut(spec, sl, logical)
            for h in hosts:
                co.cluster.client(h).put(old.job, new.version, spec.name, sl.key(), sub,
                                         spec.dtype)
    co.cluster.call_hosts(co.cluster.hosts, "abort", job=old.job, version=new.version)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--dir", default="/tmp", help="where the hosts' stores live (default /tmp)")
    ap.add_argument("--rounds", type=int, default=5, choices=range(1, 8), metavar="1-7",
                    help="reconfigurations, back and forth (default 5: the last writes into "
                         "pages the store freed)")
    ap.add_argument("--no-room", action="store_true",
                    help="daemons do not make room in their stores between versions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.no_room:
        os.environ["PTC_STORE_ROOM"] = "0"  # the daemons started below inherit it
    settled = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        lc = LocalCluster(Path(d))
        lc.up(2, gpus=2, replicas=1)
        try:
            co = Coordinator(Cluster.load(lc.cluster_file))
            cfg = parse_config(*OLD)
            state = JobState("bench", 1, args.model, "fp16", "none", cfg, 0, 1, ("h0", "h1"))
            co.create(state, seed=0)
            writemap = all(h["store"]["writemap"]
                           for h in co.cluster.call_all("health")[0].values())
            total = sum(s.nbytes for s in state.model_spec().tensors_for(cfg.pp))
            old, new, p, lost = co.plan_for("bench", parse_config(*NEW))
            settled.append(settle(co))
            t_central = central(co, old, new)
            settled.append(settle(co))
            r = co.reconfigure("bench", parse_config(*NEW), planned=(old, new, p, lost))
            # back and forth again: later rounds write into pages the store freed
            rounds = [r]
            for i in range(1, args.rounds):
                settled.append(settle(co))
                rounds.append(co.reconfigure("bench", parse_config(*(OLD if i % 2 else NEW))))
            co.cluster.close()
        finally:
            lc.down()
    moved = sum(t.nbytes for t in r.plan.transfers)
    limit = zmq_loopback_gbps()
    out = {
        "state_bytes": total,
        "bytes_moved": moved,
        "bytes_cross_host": r.plan.bytes_cross_host,
        "ptcfs_s": round(r.seconds, 3),
        "central_s": round(t_central, 3),
        "speedup_vs_central": round(t_central / r.seconds, 2),
        "ptcfs_cross_gbps": round(r.plan.bytes_cross_host / r.seconds / 1e9, 3),
        "ptcfs_moved_gbps": round(moved / r.seconds / 1e9, 3),
        "zmq_loopback_gbps": round(limit, 3),
    }
    out["cross_vs_loopback"] = round(out["ptcfs_cross_gbps"] / limit, 3)
    out["moved_vs_loopback"] = round(out["ptcfs_moved_gbps"] / limit, 3)
    same = [x for i, x in enumerate(rounds) if i % 2 == 0][1:]  # OLD -> NEW again
    if same:
        last = same[-1]
        out["again_s"] = round(last.seconds, 3)
        out["again_moved_gbps"] = round(sum(t.nbytes for t in last.plan.transfers)
                                        / last.seconds / 1e9, 3)
        out["again_moved_vs_loopback"] = round(out["again_moved_gbps"] / limit, 3)
    out["rounds_s"] = [round(x.seconds, 3) for x in rounds]
    out["room"] = not args.no_room
    out["writemap"] = writemap
    # waits for the daemons' room making: after creation, after central, between rounds
    out["settle_s"] = [round(x, 3) for x in settled]
    out["phases_s"] = r.phases
    out["staged_s"] = r.staged
    if args.json:
        print(json.dumps(out))
        return
    print(f"state {total / 1e9:.2f} GB; {OLD[0]} on {OLD[1]} -> {NEW[0]} on {NEW[1]}; stores in "
          f"{args.dir} ({'writemap' if writemap else 'pwrite'})")
    print(f"ptcfs reconfigure   {out['ptcfs_s']:.2f} s  moved {moved / 1e9:.2f} GB "
          f"({r.plan.bytes_cross_host / 1e9:.2f} GB across hosts), "
          f"{out['ptcfs_moved_gbps']:.2f} GB/s moved, {out['ptcfs_cross_gbps']:.2f} GB/s across")
    print("  phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.phases.items()))
    for h, sec in sorted(r.staged.items()):
        print(f"  {h} staging: " + ", ".join(f"{k} {v:.2f} s" for k, v in sec.items())
              + " (thread-seconds but wall)")
    print(f"central (Tenplex)   {out['central_s']:.2f} s  -> ptcfs is "
          f"{out['speedup_vs_central']:.2f}x faster")
    print(f"zmq loopback limit  {limit:.2f} GB/s (4 MiB, copy=False); bytes moved per second "
          f"are {out['moved_vs_loopback']:.2f} of it, across hosts {out['cross_vs_loopback']:.2f}")
    print("rounds (back and forth): " + ", ".join(f"{x:.2f} s" for x in out["rounds_s"]))
    print("room made by the daemons before each run: "
          + (", ".join(f"{x:.2f} s" for x in out["settle_s"]) if out["room"] else "off"))
    if same:
        print(f"the same reconfiguration again (round {2 * len(same) + 1}, into reused store "
              f"pages): {out['again_s']:.2f} s, {out['again_moved_gbps']:.2f} GB/s moved, "
              f"{out['again_moved_vs_loopback']:.2f} of the loopback limit")


if __name__ == "__main__":
    main()
