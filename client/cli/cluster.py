"""``ptcctl`` subcommands that talk to a running cluster of ``ptcd`` daemons."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.client.cli.access import access_from, add_access_actions, add_access_args
from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import (
    MESH_METAVAR,
    add_model_args,
    config_from,
    door,
    job_name,
    model_from_args,
    model_text,
    whole,
)
from ptcfs.client.control.access import describe_owner
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.datastate import dataset_record
from ptcfs.client.control.repair import repairs_in_progress
from ptcfs.data.names import STORE_SUFFIX
from ptcfs.errors import JobNotFound
from ptcfs.jobstate import JobState
from ptcfs.model.specfile import encode_spec
from ptcfs.slicing import parse_index
from ptcfs.units import fmt_bytes, fmt_rate

__all__: list[str] = []


def _cluster_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")


@contextmanager
def _coordinator(args: argparse.Namespace) -> Iterator[Coordinator]:
    cluster = Cluster.load(args.cluster)
    try:
        yield Coordinator(cluster)
    finally:
        cluster.close()


@contextmanager
def _bar(total: int, what: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=quiet or None,
              leave=False) as bar:
        yield bar.update


# --- job create ---------------------------------------------------------------
@register("job")
def _add_job(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("job", help="create and delete jobs")
    jsub = p.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    c = jsub.add_parser("create", help="create version 1 of a job's model state",
                        description="Create a job with deterministic random values "
                        "(for demos, tests and benchmarks) on the hosts that hold each rank.")
    c.add_argument("job", type=job_name)
    _cluster_arg(c)
    add_model_args(c)
    c.add_argument("--config", required=True, metavar=MESH_METAVAR)
    c.add_argument("--hosts", required=True, metavar="h0:2,h1:2")
    c.add_argument("--init", default="random", choices=("random",))
    c.add_argument("--seed", type=whole(0), default=0)
    add_access_args(c)
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=_run_create)
    d = jsub.add_parser("delete", help="delete every version of a job and its dataset",
                        description="Delete every version of JOB, committed or staging, and "
                        "its dataset, on every host. Refused while a host of the cluster "
                        "does not answer (it may keep copies that would come back) unless "
                        "--force.")
    d.add_argument("job")
    _cluster_arg(d)
    d.add_argument("--force", action="store_true",
                   help="delete on the hosts that answer even if others do not")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=_run_delete)
    add_access_actions(jsub)


def _run_create(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        cfg = config_from(args.config, args.hosts)
        model = model_from_args(args)
        state = JobState(args.job, 1, model_text(args), args.dtype, args.optimizer, cfg, 0,
                         co.cluster.replicas, tuple(co.cluster.hosts), encode_spec(model),
                         **access_from(args))
        total = sum(s.nbytes for s in model.tensors_for(cfg.pp)) * co.cluster.replicas
        with _bar(total, f"creating {args.job}", args.json) as tick:
            co.create(state, args.seed, progress=tick)
    if args.json:
        emit_json({"job": args.job, "version": 1, "config": state.describe()})
    else:
        print(f"created {args.job} version 1: {state.describe()}")
    return 0


def _run_delete(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        gone = co.delete_job(args.job, force=args.force)
    if args.json:
        emit_json({"job": args.job, "deleted_versions": gone})
    else:
        where = ", ".join(f"{h} ({n})" for h, n in gone.items()) or "no host"
        print(f"deleted {args.job}: versions on {where}")
    return 0


# --- status -------------------------------------------------------------------
@register("status")
def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="hosts and jobs of the cluster")
    _cluster_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        health, down = co.cluster.call_all("health")
        jobs_by_host, _ = co.cluster.call_all("jobs", hosts=sorted(health))
        names = sorted({j for js in jobs_by_host.values() for j in js})
        jobs: dict[str, Any] = {}
        for j in names:
            if j.endswith(STORE_SUFFIX):  # a job's dataset: shown with the job
                job = j.removesuffix(STORE_SUFFIX)
                try:
                    rec = dataset_record(co.cluster, job)
                except JobNotFound:
                    continue
                jobs.setdefault(job, {})["dataset"] = {
                    "format": rec.format, "samples": rec.count, **rec.position_json()}
                continue
            try:
                st = co.state(j, roll_forward=False)
            except JobNotFound:
                continue
            jobs.setdefault(j, {}).update(
                {"version": st.version, "config": st.describe(), "step": st.step,
                 "model": st.model, "dtype": st.dtype, "optimizer": st.optimizer,
                 "owner": list(st.owner) if st.owner else None, "mode": f"{st.mode:04o}",
                 "writers": list(st.writers)})
            open_versions = _read_versions(co, j, sorted(health))
            if open_versions:
                jobs[j]["open_versions"] = open_versions
        for j, run in repairs_in_progress(co.cluster, sorted(health)).items():
            jobs.setdefault(j, {})["repair"] = {k: run[k] for k in (
                "driver", "lost", "pieces", "bytes", "pieces_left", "bytes_left")}
    def store(h: str, key: str) -> Any:
        return health[h]["store"][key] if h in health else None

    hosts = {h: {"alive": h in health, "lease": co.cluster.leased.get(h),
                 "address": co.cluster.addresses()[h], "store_bytes": store(h, "bytes_used"),
                 "room_bytes": store(h, "room_bytes"),
                 "making_room": health[h]["making_room"] if h in health else None,
                 "stage_buffers_bytes": health[h].get("stage_buffers_bytes")
                 if h in health else None,
                 "mount": health[h].get("mount") if h in health else None,
                 "sealed": health[h].get("sealed") if h in health else None,
                 "jobs": jobs_by_host.get(h, {})} for h in co.cluster.hosts}
    if args.json:
        emit_json({"hosts": hosts, "jobs": jobs, "down": down,
                   "registry": co.cluster.spec.registry})
        return 0
    print(f"hosts (registry {co.cluster.spec.registry}, in join order)"
          if co.cluster.spec.registry else "hosts")
    for h, info in hosts.items():
        if info["alive"]:
            held = ", ".join(f"{j} v{v}" for j, v in info["jobs"].items()) or "no jobs"
            room = f"room {fmt_bytes(info['room_bytes'])}" + (
                " (making more)" if info["making_room"] else "")
            if info["stage_buffers_bytes"]:
                room += f", buffers {fmt_bytes(info['stage_buffers_bytes'])}"
            print(f"  {h:<10} up    store {fmt_bytes(info['store_bytes']):>10}   {room:<36} "
                  f"{held}")
            if info["mount"] is not None:
                m = info["mount"]
                left = (f", {fmt_bytes(m['pending_bytes'])} to go"
                        + (" (paused: files are open)" if m["paused"] else "")
                        if m["warming"] else "")
                print(f"  {'':<10}       mount: {fmt_bytes(m['cached_bytes'])} in the page "
                      f"cache{left}")
        else:
            why = " (lease expired)" if info["lease"] is False else ""
            print(f"  {h:<10} DOWN{why}")
    print("jobs")
    for j, info in jobs.items():
        line = f"  {j:<10} "
        if "version" in info:
            line += f"version {info['version']}  step {info['step']}  {info['config']}"
            owner = describe_owner(tuple(info["owner"]) if info["owner"] else None)
            line += f"  owner {owner} {info['mode']}"
        if "dataset" in info:
            d = info["dataset"]
            line += (("; " if "version" in info else "") + f"dataset: {d['samples']} "
                     f"{d['format']} samples, epoch {d['epoch']} step {d['step']}, dp={d['dp']}")
        print(line)
        for o in info.get("open_versions", []):
            where = ", ".join(f"{n} on {h}" for h, n in sorted(o["readers"].items()))
            kept = "; kept until they close" if o["deleting"] else ""
            print(f"  {'':<10} version {o['version']} is open: {where} file(s){kept}")
        if "repair" in info:
            r = info["repair"]
            print(f"  {'':<10} repairing (lost: {', '.join(r['lost'])}): {r['pieces_left']} of "
                  f"{r['pieces']} copies, {fmt_bytes(r['bytes_left'])} of "
                  f"{fmt_bytes(r['bytes'])} left")
    if not jobs:
        print("  (none)")
    return 0


def _read_versions(co: Coordinator, job: str, hosts: list[str]) -> list[dict[str, Any]]:
    """Versions of ``job`` with files open on some host's mount: version,
    open files by host, and whether a deletion waits for them to close."""
    answers, _ = co.cluster.call_all("versions", hosts=hosts, job=job)
    out: dict[int, dict[str, Any]] = {}
    for h, versions in answers.items():
        for v in versions:
            if v.get("readers"):
                o = out.setdefault(v["version"], {"version": v["version"], "readers": {},
                                                  "deleting": False})
                o["readers"][h] = v["readers"]
                o["deleting"] = o["deleting"] or bool(v.get("deleting"))
    return [out[v] for v in sorted(out)]


# --- tensor get, checksum, verify ---------------------------------------------
@register("tensor")
def _add_tensor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensor", help="read logical tensors")
    tsub = p.add_subparsers(dest="tensor_command", metavar="ACTION", required=True)
    g = tsub.add_parser("get", help="write a logical tensor (or a slice) to a .npy file")
    g.add_argument("job", type=job_name)
    g.add_argument("name")
    _cluster_arg(g)
    g.add_argument("--slice", default="", help='numpy-style slice, e.g. "0:4,:"')
    g.add_argument("--version", type=whole(1))
    g.add_argument("--out", required=True, help="the .npy file to write")
    g.set_defaults(run=_run_get)


def _state_at(co: Coordinator, job: str, version: int | None) -> JobState:
    st = co.state(job)
    if version is None or version == st.version:
        return st
    answers, _ = co.cluster.call_all("versions", job=job)
    for versions in answers.values():
        for v in versions:
            if v["version"] == version and v["state"] == "committed":
                return JobState.from_meta(v["meta"])
    raise JobNotFound(f"job {job!r} has no committed version {version}")


def _run_get(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        st = _state_at(co, args.job, args.version)
        specs = {s.name: s for s in st.model_spec().tensors_for(st.config.pp)}
        if args.name not in specs:
            from ptcfs.errors import TensorNotFound
            raise TensorNotFound(f"job {args.job!r} has no tensor {args.name!r}")
        with door():  # a bad --slice is the command line's: exit 2
            box, shape = (parse_index(args.slice, specs[args.name].shape) if args.slice
                          else (None, specs[args.name].shape))
        arr = co.fetch_tensor(st, args.name, box).reshape(shape)
    _save_npy(Path(args.out), arr)
    return 0


def _save_npy(path: Path, arr: np.ndarray) -> None:
    """Write ``arr`` as a .npy file; a failed write raises (np.save's C
    writes let a full device pass silently)."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        f.write(np.ascontiguousarray(arr).data.cast("B"))


@register("checksum")
def _add_checksum(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checksum", help="sha256 of every logical tensor of a job")
    p.add_argument("job", type=job_name)
    _cluster_arg(p)
    p.add_argument("--version", type=whole(1))
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_checksum)


def _run_checksum(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        sums = co.checksums(_state_at(co, args.job, args.version))
    if args.json:
        emit_json(sums)
    else:
        for name, digest in sums.items():
            print(f"{digest}  {name}")
    return 0


@register("verify")
def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check every copy of the current version")
    p.add_argument("job", type=job_name)
    _cluster_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    with _coordinator(args) as co:
        st = co.state(args.job)
        problems = co.verify(st)
    if args.json:
        emit_json({"job": args.job, "version": st.version, "ok": not problems,
                   "problems": problems})
    elif problems:
        print(f"{args.job} version {st.version}: {len(problems)} problem(s)")
        for line in problems:
            print(f"  {line}")
    else:
        print(f"{args.job} version {st.version}: every sub-tensor has {st.replicas} "
              "matching copies")
    return 1 if problems else 0


# --- reconfigure --------------------------------------------------------------
@register("reconfigure")
def _add_reconfigure(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reconfigure", help="change a job's parallelism and hosts",
                       description="Plan, stage on every host in parallel, then commit the new "
                       "version everywhere (two-phase). Any failure leaves the old version "
                       "current and whole.")
    p.add_argument("job", type=job_name)
    _cluster_arg(p)
    p.add_argument("--to", required=True, metavar=MESH_METAVAR)
    p.add_argument("--hosts", help="hosts of the new configuration (default: the current ones)")
    p.add_argument("--dry-run", action="store_true", help="show the plan, move nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_reconfigure)


def _pairs(transfers: Any) -> dict[str, int]:
    pairs: dict[str, int] = defaultdict(int)
    for t in transfers:
        pairs[f"{t.src.host}->{t.dst.host}"] += t.nbytes
    return pairs


def _run_reconfigure(args: argparse.Namespace) -> int:
    from ptcfs.client.cli.plan import plan_summary

    with _coordinator(args) as co:
        cur = co.state(args.job)
        hosts = args.hosts or ",".join(f"{h.name}:{h.gpus}" for h in cur.config.hosts)
        new_cfg = config_from(args.to, hosts)
        if args.dry_run:
            old, new, p, lost = co.plan_for(args.job, new_cfg)
            s = plan_summary(p, 0.0)
            s.update(dry_run=True, job=args.job, lost_hosts=list(lost))
            if args.json:
                emit_json(s)
            else:
                print(f"{args.job}: {old.describe()} -> {new.describe()} (dry run)")
                for pair, b in sorted(_pairs(p.transfers).items()):
                    print(f"  {pair:<24} {fmt_bytes(b):>12}")
                print(f"across hosts {fmt_bytes(s['bytes_cross_host'])}, "
                      f"{s['transfers']} transfers")
                if lost:
                    print(f"giving up on: {', '.join(lost)}")
            return 0
        planned = co.plan_for(args.job, new_cfg)
        total = sum(t.nbytes for t in planned[2].transfers)
        with _bar(total, f"reconfiguring {args.job}", args.json) as tick:
            r = co.reconfigure(args.job, new_cfg, progress=tick, planned=planned)
    moved = sum(t.nbytes for t in r.plan.transfers)
    measured = sum(b for dst, srcs in r.received.items() for src, b in srcs.items() if src != dst)
    out = {"job": args.job, "from_version": r.old.version, "version": r.new.version,
           "from": r.old.describe(), "to": r.new.describe(), "seconds": round(r.seconds, 3),
           "bytes_moved": moved, "bytes_cross_host": r.plan.bytes_cross_host,
           "bytes_cross_host_measured": measured, "pairs": _pairs(r.plan.transfers),
           "lost_hosts": list(r.lost), "phases": r.phases, "staged": r.staged,
           "missed_commit": r.missed, "warnings": r.warnings}
    if r.missed:  # done all the same: they roll forward when they answer again
        why = "; ".join(f"{h}: {m}" for h, m in sorted(r.missed.items()))
        print(f"ptcctl reconfigure: warning: version {r.new.version} is committed, but "
              f"{', '.join(sorted(r.missed))} missed the commit and will be rolled forward "
              f"when they answer again ({why})", file=sys.stderr)
    for w in r.warnings:
        print(f"ptcctl reconfigure: warning: {w}", file=sys.stderr)
    if args.json:
        emit_json(out)
        return 0
    print(f"{args.job}: version {r.old.version} -> {r.new.version}: "
          f"{r.old.describe()} -> {r.new.describe()}")
    if r.lost:
        print(f"gave up on lost host(s): {', '.join(r.lost)}; rebuilt from surviving copies")
    for pair, b in sorted(out["pairs"].items()):
        print(f"  {pair:<24} {fmt_bytes(b):>12}")
    print(f"moved {fmt_bytes(moved)} ({fmt_bytes(r.plan.bytes_cross_host)} across hosts) in "
          f"{r.seconds:.2f} s, {fmt_rate(moved, r.seconds)}")
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in r.phases.items() if k != "plan"))
    return 0
