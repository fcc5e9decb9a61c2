"""``ptcctl suggest``: the meshes of a job's GPUs, their estimated memory per
GPU and step time, and the fastest that fits (no cluster needed)."""

from __future__ import annotations

import argparse
from typing import Any

from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import (
    MESH_METAVAR,
    add_model_args,
    config_from,
    model_from_args,
    whole,
)
from ptcfs.client.cli.suggest_lengths import run_lengths
from ptcfs.errors import InvalidConfig
from ptcfs.sharding import parse_hosts
from ptcfs.suggest.device import PROFILES, device_from
from ptcfs.suggest.memory import RECOMPUTE, dims_of
from ptcfs.suggest.search import (
    FSDP_PIPELINE,
    GRAD_DTYPES,
    MICROBATCHING,
    OBJECTIVES,
    POLICIES,
    RUNTIMES,
    Estimate,
    Query,
    Suggestion,
    suggest,
)
from ptcfs.suggest.steptime import GEMM_HALF_DIM, UTILIZATION
from ptcfs.units import fmt_bytes

__all__: list[str] = []


@register("suggest")
def _add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "suggest",
        help="estimate every mesh of a job's GPUs and suggest the fastest that fits",
        description="Enumerate every valid mesh (pp, vpp, dp, fsdp, cp, tp, ep, zero, "
        "cp_shard) of the hosts' "
        "GPUs, estimate each one's memory per GPU and step time, print the Pareto front and "
        "mark the fastest mesh that fits in GPU memory. Needs no cluster.",
    )
    add_model_args(p)
    p.add_argument("--hosts", required=True, metavar="h0:8,h1:8", help="the GPUs, name:gpus")
    p.add_argument("--global-batch", required=True, type=whole(1), metavar="B",
                   help="sequences per step")
    p.add_argument("--seq", required=True, type=whole(1), metavar="S", help="tokens per sequence")
    p.add_argument("--micro-batch", type=whole(1), default=1, metavar="b",
                   help="sequences per micro-batch (default 1)")
    p.add_argument("--device", choices=tuple(PROFILES), help="a named GPU profile")
    p.add_argument("--gpu-mem", metavar="80GiB", help="memory per GPU")
    p.add_argument("--gpu-tflops", type=float, metavar="400", help="peak 16-bit TFLOP/s per GPU")
    p.add_argument("--intra-host", metavar="450GB/s", help="per-GPU bandwidth inside a host")
    p.add_argument("--inter-host", metavar="25GB/s", help="per-GPU bandwidth between hosts")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="activation recomputation: none (default), selective (Megatron's: "
                   "attention's core), op (torchtitan's selective: every other matrix "
                   "multiplication) or full")
    p.add_argument("--from", dest="src", metavar=MESH_METAVAR, help="the job's current mesh")
    p.add_argument("--from-hosts", metavar="h0:8", help="the current mesh's hosts")
    p.add_argument("--cp-shard", type=int, choices=(0, 1), default=None,
                   help="the job's layout with context parallelism: 0, its ranks keep replicas "
                   "of the state (Megatron-Core); 1, FSDP shards over fsdp*cp (torchtitan's "
                   "dp_shard_cp); default: --from's when it has cp > 1, else both")
    p.add_argument("--horizon", type=whole(1), default=1000, metavar="STEPS",
                   help="steps over which a reconfiguration's cost is spread (default 1000)")
    p.add_argument("--policy", choices=POLICIES, default=POLICIES[0],
                   help="how to pick among meshes that fit (default fastest-that-fits)")
    p.add_argument("--all", action="store_true", help="list every mesh, not only the front")
    p.add_argument("--explain", action="store_true", help="give every estimate's terms")
    p.add_argument("--no-flash", dest="flash", action="store_false",
                   help="attention stores its scores (no FlashAttention-style kernel)")
    p.add_argument("--float8", action="store_true",
                   help="the run trains its linear layers in Float8 (torchao, or Transformer "
                   "Engine's FP8 with --runtime megatron): their matrix multiplications are "
                   "priced faster")
    p.add_argument("--runtime", choices=RUNTIMES, default="torch",
                   help="what trains the model, where it changes the memory: torch (default: "
                   "torchtitan, torch.distributed.pipelining) or megatron (Megatron-Core with "
                   "Transformer Engine: no standing pipeline receive buffers, fused SwiGLU, "
                   "FP8 linear inputs under --float8)")
    p.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="",
                   help="the gradients' dtype when not the optimizer's master's (fp32 with "
                   "one): bf16 for Megatron-Core's grad_reduce_in_fp32 off")
    p.add_argument("--eager", action="store_true",
                   help="the run's elementwise operations are not fused (eager PyTorch, no "
                   "torch.compile): their memory traffic is priced 3x")
    p.add_argument("--async-tp", action="store_true",
                   help="the run overlaps tensor parallelism's collectives with its matrix "
                   "multiplications (torchtitan's async TP)")
    p.add_argument("--fsdp-pipeline", choices=FSDP_PIPELINE, default="step",
                   help="FSDP under a pipeline: step (torch.distributed.pipelining, as "
                   "torchtitan runs it: a stage's parameters kept gathered and its gradients "
                   "whole until the last backward, a receive buffer per micro-batch) or micro "
                   "(Llama 3: gathered from each forward to its backward, gradients "
                   "reduced per micro-batch); default step")
    p.add_argument("--async-p2p", action="store_true",
                   help="the pipeline's sends and receives overlap compute (Llama 3)")
    p.add_argument("--pp-microbatches", choices=MICROBATCHING, default="size",
                   help="how a data-parallel rank's batch splits: size (default), micro-batches "
                   "of --micro-batch sequences; stages, as many as the pipeline has stages and "
                   "one without a pipeline (torchtitan's default, no gradient accumulation)")
    p.add_argument("--seq-lengths", metavar="FILE|JOB",
                   help="one mesh per sequence-length group (HotSPa): the lengths in FILE "
                   "(whole numbers), or the coming steps of JOB's dataset (needs the cluster)")
    p.add_argument("--lookahead", type=whole(1), default=64, metavar="STEPS",
                   help="with --seq-lengths JOB: steps of the dataset to take (default 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _query(args: argparse.Namespace) -> Query:
    model = model_from_args(args)
    hosts = parse_hosts(args.hosts)
    device = device_from(args.device, args.gpu_mem, args.gpu_tflops, args.intra_host,
                         args.inter_host)
    old = None
    if args.src or args.from_hosts:
        if not (args.src and args.from_hosts):
            raise InvalidConfig("give --from and --from-hosts together")
        old = config_from(args.src, args.from_hosts)
    cp_shard = args.cp_shard
    if cp_shard is None and old is not None and old.cp > 1:
        cp_shard = old.cp_shard  # the job's framework keeps its layout
    return Query(model, hosts, args.global_batch, args.seq, device, args.micro_batch,
                 args.recompute, old=old, horizon=args.horizon, flash=args.flash,
                 cp_shard=cp_shard, float8=args.float8, async_tp=args.async_tp,
                 fsdp_pipeline=args.fsdp_pipeline, async_p2p=args.async_p2p,
                 pp_microbatches=args.pp_microbatches, eager=args.eager,
                 runtime=args.runtime, grad_dtype=args.grad_dtype)


def _row(e: Estimate) -> dict[str, Any]:
    return {"config": e.config.degrees_text(), "degrees": e.config.degrees(),
            "step_seconds": e.step, "amortised_step_seconds": e.amortised,
            "memory_bytes": e.memory, "fits": e.fits, "step_terms": e.step_terms,
            "memory_terms": e.memory_terms, "inter_host_bytes": e.inter_host,
            "inter_host_terms": e.inter_host_terms, "move_bytes": e.move_bytes,
            "move_seconds": e.move_seconds}


def to_json(s: Suggestion) -> dict[str, Any]:
    q = s.query
    d = q.device
    return {
        "device": {"name": d.name, "memory_bytes": d.memory, "flops": d.flops,
                   "intra_host_bytes_per_s": d.intra_host, "inter_host_bytes_per_s": d.inter_host,
                   "pod_gpus": d.pod_gpus, "pod_oversubscription": d.pod_oversubscription,
                   "memory_bytes_per_s": d.hbm, "attention_utilization": d.attn_util},
        "assumptions": {"utilization": UTILIZATION, "gemm_half_dim": GEMM_HALF_DIM,
                        "recompute": q.recompute, "micro_batch": q.micro,
                        "horizon": q.horizon, "cp_shard": q.cp_shard,
                        "float8": q.float8, "async_tp": q.async_tp,
                        "fsdp_pipeline": q.fsdp_pipeline, "async_p2p": q.async_p2p,
                        "pp_microbatches": q.pp_microbatches, "eager": q.eager,
                        "runtime": q.runtime, "grad_dtype": q.grad_dtype},
        "objectives": list(OBJECTIVES),
        "notes": s.notes,
        "best": _row(s.best) if s.best else None,
        "front": [_row(e) for e in s.front],
        "meshes": [_row(e) for e in s.estimates],
    }


def _terms(terms: dict[str, float], unit: str) -> str:
    fmt = (lambda v: fmt_bytes(v)) if unit == "B" else (lambda v: f"{v:.3f} s")
    return ", ".join(f"{k} {fmt(v)}" for k, v in terms.items() if v)


def run(args: argparse.Namespace) -> int:
    q = _query(args)
    if args.seq_lengths:
        return run_lengths(args, q)
    s = suggest(q, args.policy)
    if args.json:
        emit_json(to_json(s))
        return 0 if s.best else 1
    d = q.device
    print(f"{len(s.estimates)} meshes of {sum(h.gpus for h in q.hosts)} GPUs "
          f"({d.name}: {fmt_bytes(d.memory)}, {d.flops / 1e12:.0f} TFLOP/s); "
          f"model {'has' if dims_of(q.model, q.seq) else 'lacks'} transformer sizes")
    for note in s.notes:
        print(f"note: {note}")
    rows = s.estimates if args.all else s.front
    move = q.old is not None
    print(f"  {'mesh':34} {'step s':>9} {'mem/GPU':>10} {'net/GPU':>10} fits" +
          ("  moved" if move else ""))
    for e in sorted(rows, key=lambda e: e.amortised):
        mark = "*" if e is s.best else " "
        moved = "" if not move else f"  {fmt_bytes(e.move_bytes)}" \
            if e.move_bytes is not None else "  -"
        print(f"{mark} {e.config.degrees_text():34} {e.amortised:9.3f} "
              f"{fmt_bytes(e.memory):>10} {fmt_bytes(e.inter_host):>10} "
              f"{'yes' if e.fits else 'no ':3}{moved}")
        if args.explain:
            print(f"      time: {_terms(e.step_terms, 's')}")
            print(f"      memory: {_terms(e.memory_terms, 'B')}")
            print(f"      between hosts: {_terms(e.inter_host_terms, 'B') or 'nothing'}")
    if s.best is None:
        print("no mesh fits in GPU memory: recompute activations, or add GPUs")
        return 1
    print(f"* {args.policy}: {s.best.config.degrees_text()}")
    return 0
