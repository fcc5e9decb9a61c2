"""``ptcctl commit``: make a saved version current at a training step;
``ptcctl discard``: drop a save that will not be committed."""

from __future__ import annotations

import argparse

from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import job_name, whole
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.saving import commit_step, discard_save

__all__: list[str] = []


@register("commit")
def _add_commit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "commit", help="commit the state written for a job as training step N",
        description="Commit the version that the job's ranks wrote (through "
                    "/ptc/<job>/ranks/<rank>/ or the client's save) as step N: every "
                    "sub-tensor must have been written; it is copied to its replicas and "
                    "becomes current on every host at once. The dataset's read position "
                    "moves to step N.")
    p.add_argument("job", type=job_name)
    p.add_argument("--step", type=whole(0), required=True, help="the training step the state is at")
    p.add_argument("--force", action="store_true",
                   help="commit even a step before the dataset's read position (its samples "
                        "from there on are read again)")
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_commit)


def _run_commit(args: argparse.Namespace) -> int:
    cluster = Cluster.load(args.cluster)
    try:
        st = commit_step(Coordinator(cluster), args.job, args.step, force=args.force)
    finally:
        cluster.close()
    if args.json:
        emit_json({"job": st.job, "version": st.version, "step": st.step,
                   "config": st.describe()})
    else:
        print(f"{st.job}: version {st.version} committed at step {st.step} ({st.describe()})")
    return 0


@register("discard")
def _add_discard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "discard", help="drop the state written for a job since its last commit",
        description="Drop the job's open save on every host: what its ranks wrote (through "
                    "/ptc/<job>/ranks/<rank>/, a dcp.save or save_pretrained through the "
                    "mount, or the client's save) since the last commit, for a save that "
                    "will not be committed (its writers are gone, or failed). The current "
                    "version stays as it is; a repair of the job waits while a save is "
                    "open. Nothing to drop is not an error.")
    p.add_argument("job", type=job_name)
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_discard)


def _run_discard(args: argparse.Namespace) -> int:
    cluster = Cluster.load(args.cluster)
    try:
        version = discard_save(Coordinator(cluster), args.job)
    finally:
        cluster.close()
    if args.json:
        emit_json({"job": args.job, "discarded": version})
    elif version is None:
        print(f"{args.job}: no save is open")
    else:
        print(f"{args.job}: the save of version {version} dropped")
    return 0
