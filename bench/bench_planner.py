"""Planner quality and speed: ours against HotSPa's greedy switching planner
(:mod:`hotspa`, device by device) and round-robin, on the same transitions,
GPT-175B on 1024 GPUs among them, all computed in the same run.

Per case: cross-host bytes (against the lower bound) and the most bytes one
host sends, for each planner, their ratios ours/peer (below 1 is better for
us), and our planning time (median of ``--runs``).

    .venv/bin/python bench/bench_planner.py [--quick] [--runs 3] [--json]
    .venv/bin/python bench/bench_planner.py --sharded   # FSDP and experts, ours alone
    .venv/bin/python bench/bench_planner.py --control   # the coordinator before staging

``--control``: what ``ptcctl reconfigure`` computes before daemons start
staging, for the first (175B, 128 -> 120 hosts) case: the plan, each
host's part of it (:func:`~ptcfs.plan.stagework.split_plan`) and the ``stage``
requests as they go on the wire (:func:`~ptcfs.plan.stagework.encode`, msgpack):
until the first host's request is ready (it is sent then, and that host
starts), and until every host's is, against the 2 s the coordinator may
take. The calls around it (versions, ping, begin) are not in these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgpack
from common import fmt_fig, put, ratio, table, timed
from hotspa import hotspa_plan

from ptcfs.model.presets import parse_model
from ptcfs.plan.planner import plan
from ptcfs.plan.stagework import encode, split_plan
from ptcfs.sharding import parse_config

GPT175 = "gpt:layers=96,hidden=12288,heads=96,vocab=51200"
GPT13 = "gpt:layers=40,hidden=5120,heads=40,vocab=51200"
GPT_TINY = "gpt:layers=4,hidden=256,heads=8,vocab=1024"


def hosts(n: int, gpus: int = 8, offset: int = 0) -> str:
    return ",".join(f"h{i + offset}:{gpus}" for i in range(n))


# (name, model, old degrees, old hosts, new degrees, new hosts, in --quick)
CASES = [
    ("175B pp16,dp8 -> pp12,dp10 (1024 GPUs, 128 -> 120 hosts)", GPT175,
     "tp=8,pp=16,dp=8", hosts(128), "tp=8,pp=12,dp=10", hosts(120), True),
    ("175B tp8,pp16,dp8 -> tp4,pp16,dp16 (1024 GPUs, same 128 hosts)", GPT175,
     "tp=8,pp=16,dp=8", hosts(128), "tp=4,pp=16,dp=16", hosts(128), False),
    ("13B tp4,pp2,dp4 -> tp2,pp4,dp3 (4 -> 3 hosts)", GPT13,
     "tp=4,pp=2,dp=4", hosts(4), "tp=2,pp=4,dp=3", hosts(3), True),
    ("13B scale-out: tp8,dp4 on 4 hosts -> tp8,dp6 on 6 hosts", GPT13,
     "tp=8,dp=4", hosts(4), "tp=8,dp=6", hosts(6), True),
    ("13B replace 2 hosts: tp8,pp2,dp2 on h0-h3 -> same on h0,h1,h4,h5", GPT13,
     "tp=8,pp=2,dp=2", hosts(4), "tp=8,pp=2,dp=2", "h0:8,h1:8,h4:8,h5:8", True),
    ("13B host failure: tp4,pp2,dp2 on h0-h1 -> tp4,pp2,dp1 on h1", GPT13,
     "tp=4,pp=2,dp=2", hosts(2), "tp=4,pp=2,dp=1", "h1:8", True),
    ("13B scale-in: tp2,pp2,dp8 on 4 hosts -> tp4,pp2,dp2 on 2 hosts", GPT13,
     "tp=2,pp=2,dp=8", hosts(4), "tp=4,pp=2,dp=2", hosts(2), False),
]
MOE64 = ("moe:layers=32,hidden=4096,heads=32,kv_heads=8,vocab=32000,ffn=14336,experts=64,"
         "names=mcore")
# Fully-sharded jobs, planned by ours alone (HotSPa's planner knows only tp/pp/dp):
# (name, model, old degrees, old hosts, new degrees, new hosts)
SHARDED = [
    ("175B fsdp1024 -> fsdp960 (128 -> 120 hosts)", GPT175,
     "fsdp=1024", hosts(128), "fsdp=960", hosts(120)),
    ("175B tp8,fsdp128 -> tp8,fsdp120 (128 -> 120 hosts)", GPT175,
     "tp=8,fsdp=128", hosts(128), "tp=8,fsdp=120", hosts(120)),
    ("MoE 64 experts fsdp1024,ep64 -> fsdp960,ep64 (128 -> 120 hosts)", MOE64,
     "fsdp=1024,ep=64", hosts(128), "fsdp=960,ep=64", hosts(120)),
]
SMOKE = [("tiny tp2,dp2 -> tp4 (2 -> 1 hosts)", GPT_TINY, "tp=2,dp=2", "h0:2,h1:2",
          "tp=4", "h1:4", True)]


def _ratio(ours: int, peer: int) -> float | None:
    """ours / peer; 1 when both are 0; None (shown as "inf") when only the peer's is."""
    if peer == 0:
        return 1.0 if ours == 0 else None
    return ratio(ours, peer, 4)


def _fmt(r: float | None) -> str:
    return "inf" if r is None else f"{r:.3f}"


def run_case(name: str, model_text: str, a: str, ah: str, b: str, bh: str,
             runs: int = 3) -> dict[str, Any]:
    model = parse_model(model_text, dtype="fp16", optimizer="adam")
    old, new = parse_config(a, ah), parse_config(b, bh)
    times = []
    for _ in range(runs):
        seconds, ours = timed(lambda: plan(model, old, new))
        times.append(seconds)
    greedy_s, greedy = timed(lambda: hotspa_plan(model, old, new))
    rr = plan(model, old, new, strategy="round-robin")
    out = {
        "case": name,
        "gpus_old": old.world, "gpus_new": new.world,
        "greedy_plan_seconds": round(greedy_s, 3),
        "transfers": len(ours.transfers),
        "bytes_total": ours.bytes_total,
        "bytes_min_cross_host": ours.bytes_min_cross_host,
        "cross": ours.bytes_cross_host,
        "cross_greedy": greedy.bytes_cross_host,
        "cross_round_robin": rr.bytes_cross_host,
        "greedy_intra_node": greedy.bytes_intra_node,
        "max_send": ours.max_host_send_bytes,
        "max_send_greedy": greedy.max_host_send_bytes,
        "max_send_round_robin": rr.max_host_send_bytes,
        "max_send_ratio_vs_greedy": _ratio(ours.max_host_send_bytes,
                                           greedy.max_host_send_bytes),
        "cross_ratio_vs_greedy": _ratio(ours.bytes_cross_host, greedy.bytes_cross_host),
        "max_send_ratio_vs_round_robin": _ratio(ours.max_host_send_bytes,
                                                rr.max_host_send_bytes),
        "cross_ratio_vs_round_robin": _ratio(ours.bytes_cross_host, rr.bytes_cross_host),
    }
    put(out, "plan_seconds", times, 3)
    out["worse_than_greedy"] = (out["max_send"] > out["max_send_greedy"]
                                or out["cross"] > out["cross_greedy"])
    return out


def run_sharded(name: str, model_text: str, a: str, ah: str, b: str, bh: str
                ) -> dict[str, Any]:
    """One fully-sharded case, planned once by ours."""
    model = parse_model(model_text, dtype="fp16", optimizer="adam")
    old, new = parse_config(a, ah), parse_config(b, bh)
    seconds, ours = timed(lambda: plan(model, old, new))
    return {"case": name, "gpus_old": old.world, "gpus_new": new.world,
            "tensors": len(model.tensors), "transfers": len(ours.transfers),
            "cross": ours.bytes_cross_host, "bytes_min_cross_host": ours.bytes_min_cross_host,
            "max_send": ours.max_host_send_bytes, "plan_seconds": round(seconds, 2)}


#: Seconds the coordinator may spend before staging starts (the 175B case).
CONTROL_TARGET_S = 2.0


def run_control(runs: int = 3, replicas: int = 2) -> dict[str, Any]:
    """The first case's plan, split and encoded requests, timed ``runs``
    times: until the first host's request is ready (the coordinator sends
    each host's as soon as it is made, so that host starts staging then),
    and until every host's is."""
    name, model_text, a, ah, b, bh, _ = CASES[0]
    model = parse_model(model_text, dtype="fp16", optimizer="adam")
    old, new = parse_config(a, ah), parse_config(b, bh)
    ring = tuple(h.name for h in new.hosts)
    steps: dict[str, list[float]] = {k: [] for k in ("plan", "split", "encode_first", "encode",
                                                     "first_host", "every_host")}
    wire = transfers = 0
    for _ in range(runs):
        t_plan, p = timed(lambda: plan(model, old, new, replicas=replicas, new_ring=ring))
        t_split, work = timed(lambda p=p: split_plan(p, model, replicas, ring))
        each = [timed(lambda w=w: msgpack.packb(encode(w))) for w in work.values()]
        t_first, t_enc = each[0][0], sum(t for t, _ in each)
        for key, value in (("plan", t_plan), ("split", t_split), ("encode_first", t_first),
                           ("encode", t_enc), ("first_host", t_plan + t_split + t_first),
                           ("every_host", t_plan + t_split + t_enc)):
            steps[key].append(value)
        wire, transfers = sum(len(x) for _, x in each), len(p.transfers)
    out: dict[str, Any] = {"case": name, "transfers": transfers, "hosts": len(ring),
                           "wire_bytes": wire, "target_seconds": CONTROL_TARGET_S}
    for key, values in steps.items():
        put(out, f"{key}_seconds", values, 3)
    out["ratio_to_target"] = ratio(out["first_host_seconds"], CONTROL_TARGET_S)
    return out


def run(quick: bool = False, smoke: bool = False, runs: int = 3) -> list[dict[str, Any]]:
    """Every case (``quick``: those marked for it; ``smoke``: one tiny case)."""
    cases = SMOKE if smoke else [c for c in CASES if c[6] or not quick]
    return [run_case(*c[:6], runs=runs) for c in cases]


def render(results: list[dict[str, Any]]) -> str:
    """One row per case: bytes in GB, ratios ours/peer."""
    rows = []
    for r in results:
        rows.append([
            r["case"],
            f"{r['cross'] / 1e9:.1f}/{r['cross_greedy'] / 1e9:.1f}/"
            f"{r['cross_round_robin'] / 1e9:.1f}",
            f"{r['max_send'] / 1e9:.2f}/{r['max_send_greedy'] / 1e9:.2f}/"
            f"{r['max_send_round_robin'] / 1e9:.2f}",
            _fmt(r["cross_ratio_vs_greedy"]),
            _fmt(r["max_send_ratio_vs_greedy"]),
            _fmt(r["max_send_ratio_vs_round_robin"]),
            fmt_fig(r, "plan_seconds"),
        ])
    return table(rows, ["case", "cross GB ours/greedy/rr", "max send GB ours/greedy/rr",
                        "cross vs greedy", "max send vs greedy", "max send vs rr",
                        "plan time"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the slowest cases")
    ap.add_argument("--smoke", action="store_true", help="one tiny case (checks the harness)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of our planner per case")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--control", action="store_true",
                    help="only the coordinator's work before staging (the 175B case)")
    ap.add_argument("--sharded", action="store_true",
                    help="only the fully-sharded cases (FSDP, experts on 1024 GPUs), ours alone")
    args = ap.parse_args()
    if args.control:
        r = run_control(args.runs)
        if args.json:
            print(json.dumps({"planner_control": r}))
        else:
            print(table([[r["case"], str(r["transfers"]), f"{r['wire_bytes'] / 1e6:.1f} MB",
                          fmt_fig(r, "plan_seconds"), fmt_fig(r, "split_seconds"),
                          fmt_fig(r, "encode_seconds"), fmt_fig(r, "first_host_seconds"),
                          fmt_fig(r, "every_host_seconds"), f"{r['ratio_to_target']:.2f}"]],
                        ["case", "transfers", "stage requests", "plan", "split",
                         "encode (all)", "first host stages", "every host stages",
                         "first / 2 s"]))
        return 0
    if args.sharded:
        sharded = [run_sharded(*c) for c in SHARDED]
        if args.json:
            print(json.dumps({"planner_sharded": sharded}))
        else:
            print(table([[r["case"], str(r["tensors"]), str(r["transfers"]),
                          f"{r['cross'] / 1e9:.1f}/{r['bytes_min_cross_host'] / 1e9:.1f}",
                          f"{r['max_send'] / 1e9:.2f}", f"{r['plan_seconds']:.1f} s"]
                         for r in sharded],
                        ["case", "tensors", "transfers", "cross GB / bound", "max send GB",
                         "plan time"]))
        return 0
    results = run(quick=args.quick, smoke=args.smoke, runs=args.runs)
    if args.json:
        print(json.dumps({"planner": results}))
    else:
        print(render(results))
    worse = [r["case"] for r in results if r["worse_than_greedy"]]
    if worse:
        print("ours is worse than HotSPa's greedy on: " + "; ".join(worse), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
