"""``ptcctl repair``: restore the copies of a job that lost hosts held."""

from __future__ import annotations

import argparse
from typing import Any

from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import job_name
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.repair import repair
from ptcfs.settings import parse_size
from ptcfs.units import fmt_bytes

__all__: list[str] = []


@register("repair")
def _add_repair(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "repair", help="restore the copies that lost hosts held",
        description="Declare the hosts that do not answer (and those given with --lost) "
        "lost, and have the live hosts restore `replicas` copies of every sub-tensor of "
        "JOB's current version, copying from host to host in the background at most "
        "PTC_REPAIR_RATE bytes per second each; the repaired copies are committed as the "
        "job's next version. Without --wait it returns once the repair has started "
        "(`ptcctl status` shows it).")
    p.add_argument("job", type=job_name)
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--lost", default="", metavar="h1,h2",
                   help="hosts to declare lost even if they answer")
    p.add_argument("--rate", type=parse_size, metavar="BYTES",
                   help="bytes per second each host may fetch, e.g. 64M; 0: no limit "
                   "(default: PTC_REPAIR_RATE of the driving ptcd)")
    p.add_argument("--wait", action="store_true", help="wait until the repair ends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_repair)


def _run_repair(args: argparse.Namespace) -> int:
    lost = tuple(h for h in (x.strip() for x in args.lost.split(",")) if h)
    cluster = Cluster.load(args.cluster)
    try:
        run = repair(cluster, args.job, lost, wait=args.wait, rate=args.rate)
    finally:
        cluster.close()
    if args.json:
        emit_json(run)
    else:
        print(_describe(run))
    return 0


def _describe(run: dict[str, Any]) -> str:
    job, state = run["job"], run["state"]
    if state == "nothing":
        return f"{job}: every copy is in place; nothing to repair"
    copies = f"{run.get('pieces', 0)} copies, {fmt_bytes(run.get('bytes', 0))}"
    lost = ", ".join(run.get("lost", [])) or "none"
    if state == "done":
        return (f"repaired {job}: {copies} (lost: {lost}); version {run['new_version']} "
                f"is current, in {run['seconds']:.1f} s")
    return f"repairing {job} on {run['driver']} in the background: see `ptcctl status`"
