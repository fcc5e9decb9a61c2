"""``ptcctl plan``: compute and show a reconfiguration plan (no cluster needed)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import MESH_METAVAR, add_model_args, config_from, model_from_args
from ptcfs.jobstate import describe_config
from ptcfs.model.hfmodels import RECORDED_PARAMS
from ptcfs.model.specfile import dump_spec
from ptcfs.plan.planner import plan
from ptcfs.sharding import rank_coords, rank_tensors
from ptcfs.types import ModelSpec, ParallelConfig, Plan
from ptcfs.units import fmt_bytes

__all__ = ["plan_summary"]

MATRIX_MAX_HOSTS = 8
TOP_PAIRS = 20


@register("plan")
def _add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show what a reconfiguration would move",
        description="Compute the transfers that turn one parallel configuration's state into "
        "another's, and show bytes per host pair. Needs no cluster.",
    )
    add_model_args(p)
    p.add_argument("--from", dest="src", required=True, metavar=MESH_METAVAR)
    p.add_argument("--from-hosts", required=True, metavar="h0:4,h1:4",
                   help="hosts of the old configuration, name:gpus")
    p.add_argument("--to", dest="dst", required=True, metavar=MESH_METAVAR)
    p.add_argument("--to-hosts", metavar="h0:4,h1:4",
                   help="hosts of the new configuration (default: the old ones); "
                   "a name in both lists is the same machine")
    p.add_argument("--shapes", action="store_true",
                   help="also give every new rank's host and sub-tensor shapes")
    p.add_argument("--list", action="store_true", help="list every transfer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


@register("spec")
def _add_spec(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "spec",
        help="write a model's spec file (a starting point for your own model)",
        description="Write the spec of a preset, of a Hugging Face model directory (--from-hf: "
        "through transformers, as `ptcctl import --format hf` derives it), or re-write a spec "
        "file, as TOML or JSON: every tensor with its shape, dtype and sharding rule. Edit it "
        "and pass it to --model-spec.",
    )
    add_model_args(p, from_hf=True)
    p.add_argument("--format", choices=("toml", "json"), default="toml")
    p.add_argument("--out", metavar="FILE", help="write here (default: standard output)")
    p.set_defaults(run=_run_spec)


def _run_spec(args: argparse.Namespace) -> int:
    if args.from_hf is not None:
        from ptcfs.client.formats.hf_spec import spec_of_dir
        from ptcfs.model.presets import with_optimizer

        model = spec_of_dir(Path(args.from_hf), require_plan=False)
        if args.optimizer != "none":
            model = with_optimizer(model, args.optimizer)
    else:
        model = model_from_args(args)
    text = dump_spec(model, args.format)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _describe(cfg: ParallelConfig) -> str:
    return f"{describe_config(cfg)} ({cfg.world} ranks)"


def _pairs(p: Plan) -> dict[tuple[str, str], int]:
    pairs: dict[tuple[str, str], int] = defaultdict(int)
    for t in p.transfers:
        pairs[(t.src.host, t.dst.host)] += t.nbytes
    return pairs


def plan_summary(p: Plan, seconds: float) -> dict[str, Any]:
    """The figures of a plan, as the ``--json`` output gives them."""
    pairs = _pairs(p)
    return {
        "from": {**p.old.degrees(), "hosts": {h.name: h.gpus for h in p.old.hosts}},
        "to": {**p.new.degrees(), "hosts": {h.name: h.gpus for h in p.new.hosts}},
        "bytes_total": p.bytes_total,
        "bytes_cross_host": p.bytes_cross_host,
        "bytes_min_cross_host": p.bytes_min_cross_host,
        "bytes_local": sum(t.nbytes for t in p.transfers if not t.cross_host),
        "max_host_send_bytes": p.max_host_send_bytes,
        "host_send_bytes": dict(p.host_send),
        "transfers": len(p.transfers),
        "pairs": [{"src": s, "dst": d, "bytes": b} for (s, d), b in sorted(pairs.items())],
        "plan_seconds": round(seconds, 4),
    }


def _shapes(model: ModelSpec, cfg: ParallelConfig) -> dict[str, Any]:
    out = {}
    for c in rank_coords(cfg):
        out[str(c.rank)] = {
            "host": c.host,
            "tensors": {s.name: list(sl.local_shape(s.shape))
                        for s, sl in rank_tensors(model, cfg, c.rank)},
        }
    return out


def _print_text(model: ModelSpec, p: Plan, s: dict[str, Any], show_list: bool) -> None:
    params = " ".join(f"{k}={v}" for k, v in model.params if k not in RECORDED_PARAMS)
    state = sum(t.nbytes for t in model.tensors)
    print(f"model  {model.name} {params}")
    print(f"       {len(model.tensors)} tensors, {fmt_bytes(state)} of state per model copy")
    print(f"from   {_describe(p.old)}")
    print(f"to     {_describe(p.new)}")
    print()
    pairs = _pairs(p)
    srcs = [h.name for h in p.old.hosts]
    dsts = [h.name for h in p.new.hosts]
    if len(srcs) <= MATRIX_MAX_HOSTS and len(dsts) <= MATRIX_MAX_HOSTS:
        print("bytes per host pair (rows: from, columns: to; the diagonal is local copies)")
        width = max(10, *(len(d) + 2 for d in dsts))
        print(" " * 10 + "".join(d.rjust(width) for d in dsts))
        for a in srcs:
            row = "".join((fmt_bytes(pairs[(a, b)]) if pairs.get((a, b)) else "-").rjust(width)
                          for b in dsts)
            print(a.ljust(10) + row)
    else:
        cross = sorted(((b, k) for k, b in pairs.items() if k[0] != k[1]), reverse=True)
        print(f"largest cross-host flows ({min(TOP_PAIRS, len(cross))} of {len(cross)})")
        for b, (a, d) in cross[:TOP_PAIRS]:
            print(f"  {a:>10} -> {d:<10} {fmt_bytes(b):>12}")
    print()
    lb = s["bytes_min_cross_host"]
    verdict = "at the lower bound" if s["bytes_cross_host"] == lb else "ABOVE the lower bound"
    busiest = max(p.host_send, key=lambda kv: kv[1])[0] if p.host_send else "-"
    print(f"new state (all ranks)   {fmt_bytes(s['bytes_total'])}")
    print(f"across hosts            {fmt_bytes(s['bytes_cross_host'])} "
          f"(lower bound {fmt_bytes(lb)}: {verdict})")
    print(f"local copies            {fmt_bytes(s['bytes_local'])}")
    print(f"most sent by one host   {fmt_bytes(s['max_host_send_bytes'])} ({busiest})")
    print(f"transfers               {s['transfers']}, planned in {s['plan_seconds']:.2f} s")
    if show_list:
        print()
        for t in p.transfers:
            box = ",".join(f"{a}:{b}" for a, b in t.dst.box)
            print(f"{t.src.host}/{t.src.tensor}[{t.src.slice.key()}] -> "
                  f"{t.dst.host}/{t.dst.tensor}[{t.dst.slice.key()}][{box}] {t.nbytes} B")


def run(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    old = config_from(args.src, args.from_hosts)
    new = config_from(args.dst, args.from_hosts if args.to_hosts is None else args.to_hosts)
    start = time.perf_counter()
    p = plan(model, old, new)
    s = plan_summary(p, time.perf_counter() - start)
    if args.json:
        if args.shapes:
            s["ranks"] = _shapes(model, new)
        emit_json(s)
        return 0
    _print_text(model, p, s, args.list)
    if args.shapes:
        print()
        for rank, info in _shapes(model, new).items():
            print(f"rank {rank} on {info['host']}:")
            for name, dims in info["tensors"].items():
                print(f"  {name} {dims}")
    return 0
