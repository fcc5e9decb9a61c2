"""Reading tensor bytes from a daemon: sealed (AES-GCM) against CurveZMQ and
plain TCP, and against what ZeroMQ itself moves over loopback, same run.

One daemon holds one ``--mib`` MiB tensor. A client in this process reads it
whole with :meth:`PeerClient.read_into` (8 MiB replies, 4 in flight, into
one reused buffer), ``--runs`` times per way, the ways taking turns:

- **sealed**: a cluster with keys, ``PTC_BULK=1`` (the default): the
  replies come over the daemon's sealed socket (:mod:`ptcfs.server.net.sealed`);
- **curve**: the same daemon, ``PTC_BULK=0`` in the client: over CurveZMQ;
- **plain**: a second daemon of a cluster without keys: no encryption.

And the limits ZeroMQ sets, measured by two sockets of this process
(4 MiB messages, one sender thread): **zmq plain** and **zmq curve**.

Figures are GB/s (1e9 bytes/s), medians with min-max. The bytes read are
checked against the tensor.

    .venv/bin/python bench/bench_wire.py [--mib 256] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from common import fmt_fig, put, ratio, table

from ptcfs.server.net.cluster import load_cluster
from ptcfs.server.net.keys import load_keys
from ptcfs.server.net.peer import PeerClient
from ptcfs.server.testing.localcluster import LocalCluster

ZMQ_MESSAGE = 4 << 20


def zmq_rate(curve: bool, nbytes: int) -> float:
    """GB/s of ``nbytes`` in 4 MiB messages between two sockets over loopback."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        if curve:
            server_pub, server_sec = zmq.curve_keypair()
            client_pub, client_sec = zmq.curve_keypair()
            a.curve_server, a.curve_secretkey, a.curve_publickey = True, server_sec, server_pub
            b.curve_serverkey, b.curve_publickey, b.curve_secretkey = \
                server_pub, client_pub, client_sec
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        b.send(b"ready")
        a.recv()
        buf = bytearray(ZMQ_MESSAGE)
        n = max(1, nbytes // ZMQ_MESSAGE)
        t0 = time.perf_counter()
        sender = threading.Thread(target=lambda: [a.send(buf, copy=False) for _ in range(n)])
        sender.start()
        for _ in range(n):
            b.recv(copy=False)
        sender.join()
        return n * ZMQ_MESSAGE / (time.perf_counter() - t0) / 1e9
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _daemon(directory: Path, keys: bool, data: np.ndarray) -> tuple[LocalCluster, PeerClient]:
    lc = LocalCluster(directory)
    lc.up(1, gpus=1, replicas=1, keys=keys)
    spec = load_cluster(lc.cluster_file)
    c = PeerClient(spec.host("h0").address, curve=load_keys(spec.curve_dir)
                   if spec.curve_dir else None, timeout_s=120)
    c.call("begin_at", job="wire", version=1)
    c.put("wire", 1, "t", "full", data)
    c.call("commit", job="wire", version=1)
    return lc, c


def _read_rate(c: PeerClient, data: np.ndarray, out: np.ndarray, bulk: str) -> float:
    os.environ["PTC_BULK"] = bulk
    out[:] = 0
    t0 = time.perf_counter()
    c.read_into("wire", 1, "t", "full", 0, data.nbytes, out)
    rate = data.nbytes / (time.perf_counter() - t0) / 1e9
    if not np.array_equal(out, data):
        raise SystemExit("bench_wire: the bytes read differ from the tensor")
    return rate


def run(mib: int = 256, runs: int = 5, directory: str = "/tmp") -> dict[str, Any]:
    data = np.random.default_rng(0).integers(0, 2**31, (mib << 20) // 4, dtype=np.int32)
    out = np.empty_like(data)
    rates: dict[str, list[float]] = {k: [] for k in ("sealed", "curve", "plain", "zmq_plain",
                                                       "zmq_curve")}
    with tempfile.TemporaryDirectory(prefix="ptc-bench-wire-", dir=directory) as d:
        keyed, ck = _daemon(Path(d) / "keys", True, data)
        try:
            plain, cp = _daemon(Path(d) / "plain", False, data)
            try:
                for bulk in ("1", "0"):  # warm every path (sessions, sockets, pages)
                    _read_rate(ck, data, out, bulk)
                    _read_rate(cp, data, out, bulk)
                for _ in range(runs):
                    rates["sealed"].append(_read_rate(ck, data, out, "1"))
                    rates["curve"].append(_read_rate(ck, data, out, "0"))
                    rates["plain"].append(_read_rate(cp, data, out, "1"))
                    rates["zmq_plain"].append(zmq_rate(False, data.nbytes))
                    rates["zmq_curve"].append(zmq_rate(True, data.nbytes))
            finally:
                cp.close()
                plain.down()
        finally:
            ck.close()
            keyed.down()
    res: dict[str, Any] = {"bytes": data.nbytes, "runs": runs}
    for k, v in rates.items():
        put(res, f"{k}_gbps", v, 3)
    res["sealed_vs_curve"] = ratio(res["sealed_gbps"], res["curve_gbps"])
    res["sealed_vs_plain"] = ratio(res["sealed_gbps"], res["plain_gbps"])
    res["sealed_vs_zmq_plain"] = ratio(res["sealed_gbps"], res["zmq_plain_gbps"])
    return res


def render(r: dict[str, Any]) -> str:
    rows = [[way, fmt_fig(r, f"{key}_gbps", "GB/s")] for way, key in (
        ("ptcfs read, sealed (AES-GCM)", "sealed"), ("ptcfs read, CurveZMQ", "curve"),
        ("ptcfs read, no keys", "plain"), ("ZeroMQ alone, plain TCP", "zmq_plain"),
        ("ZeroMQ alone, CurveZMQ", "zmq_curve"))]
    return (f"{r['bytes'] / 2**20:.0f} MiB read from a daemon over loopback; medians of "
            f"{r['runs']} runs (min-max)\n" + table(rows, ["way", "rate"]) +
            f"\nsealed / CurveZMQ: {r['sealed_vs_curve']}   sealed / no keys: "
            f"{r['sealed_vs_plain']}   sealed / ZeroMQ plain: {r['sealed_vs_zmq_plain']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp", help="where the stores live (default /tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args.mib, args.runs, args.dir)
    print(json.dumps(r) if args.json else render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
