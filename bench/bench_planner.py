"""Planner speed and quality: GPT-175B on 1024 GPUs and smaller transitions.

For each case: planning time, cross-host bytes against the lower bound,
and max bytes sent by one host for our planner, HotSPa's greedy switching
planner and round-robin, computed in the same run.

    .venv/bin/python bench/bench_planner.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from ptcfs.planner import plan
from ptcfs.presets import parse_model
from ptcfs.sharding import parse_config

GPT175 = "gpt:layers=96,hidden=12288,heads=96,vocab=51200"
GPT13 = "gpt:layers=40,hidden=5120,heads=40,vocab=51200"


def hosts(n: int, gpus: int = 8, offset: int = 0) -> str:
    return ",".join(f"h{i + offset}:{gpus}" for i in range(n))


CASES = [
    ("175B pp16,dp8 -> pp12,dp10 (128 -> 120 hosts)", GPT175,
     "tp=8,pp=16,dp=8", hosts(128), "tp=8,pp=12,dp=10", hosts(120)),
    ("175B tp8,pp16,dp8 -> tp4,pp16,dp16 (same 128 hosts)", GPT175,
     "tp=8,pp=16,dp=8", hosts(128), "tp=4,pp=16,dp=16", hosts(128)),
    ("13B tp4,pp2,dp4 -> tp2,pp4,dp3 (4 -> 3 hosts)", GPT13,
     "tp=4,pp=2,dp=4", hosts(4), "tp=2,pp=4,dp=3", hosts(3)),
    ("13B scale-out: tp8,dp4 on 4 hosts -> tp8,dp6 on 6 hosts", GPT13,
     "tp=8,dp=4", hosts(4), "tp=8,dp=6", hosts(6)),
    ("13B replace 2 hosts: tp8,pp2,dp2 on h0-h3 -> same on h0,h1,h4,h5", GPT13,
     "tp=8,pp=2,dp=2", hosts(4), "tp=8,pp=2,dp=2", "h0:8,h1:8,h4:8,h5:8"),
    ("13B host failure: tp4,pp2,dp2 on h0-h1 -> tp4,pp2,dp1 on h1", GPT13,
     "tp=4,pp=2,dp=2", hosts(2), "tp=4,pp=2,dp=1", "h1:8"),
]


def run_case(name: str, model_text: str, a: str, ah: str, b: str, bh: str) -> dict:
    model = parse_model(model_text, dtype="fp16", optimizer="adam")
    old, new = parse_config(a, ah), parse_config(b, bh)
    t0 = time.perf_counter()
    ours = plan(model, old, new)
    seconds = time.perf_counter() - t0
    greedy = plan(model, old, new, strategy="greedy")
    rr = plan(model, old, new, strategy="round-robin")

    def ratio(x: int, y: int) -> float:
        return x / y if y else 1.0

    return {
        "case": name,
        "plan_seconds": round(seconds, 3),
        "transfers": len(ours.transfers),
        "bytes_total": ours.bytes_total,
        "bytes_cross_host": ours.bytes_cross_host,
        "bytes_min_cross_host": ours.bytes_min_cross_host,
        "max_send": ours.max_host_send_bytes,
        "max_send_greedy": greedy.max_host_send_bytes,
        "max_send_round_robin": rr.max_host_send_bytes,
        "max_send_ratio_vs_greedy": round(ratio(ours.max_host_send_bytes,
                                                greedy.max_host_send_bytes), 4),
        "cross_ratio_vs_greedy": round(ratio(ours.bytes_cross_host, greedy.bytes_cross_host), 4),
        "max_send_ratio_vs_round_robin": round(ratio(ours.max_host_send_bytes,
                                                     rr.max_host_send_bytes), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 175B cases")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cases = [c for c in CASES if not (args.quick and c[1] == GPT175)]
    results = [run_case(*c) for c in cases]
    if args.json:
        print(json.dumps({"planner": results}))
        return
    for r in results:
        print(r["case"])
        print(f"  planned in {r['plan_seconds']:.2f} s, {r['transfers']} transfers")
        print(f"  across hosts {r['bytes_cross_host'] / 1e9:.1f} GB "
              f"(lower bound {r['bytes_min_cross_host'] / 1e9:.1f} GB), "
              f"of {r['bytes_total'] / 1e9:.1f} GB new state")
        print(f"  max sent by one host: ours {r['max_send'] / 1e9:.2f} GB, "
              f"greedy {r['max_send_greedy'] / 1e9:.2f} GB "
              f"(ratio {r['max_send_ratio_vs_greedy']:.3f}), "
              f"round-robin {r['max_send_round_robin'] / 1e9:.2f} GB "
              f"(ratio {r['max_send_ratio_vs_round_robin']:.3f})")


if __name__ == "__main__":
    main()
