"""``ptcctl data``: a job's dataset (ingest, status, seek, drop)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import job_name, size, whole
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import (
    commit_position,
    dataset_record,
    drop_dataset,
    ingest_dataset,
)
from ptcfs.data import open_source
from ptcfs.data.formats import FORMATS
from ptcfs.data.names import BALANCES
from ptcfs.data.record import DatasetRecord
from ptcfs.errors import InvalidRequest, JobNotFound
from ptcfs.jobstate import JobState
from ptcfs.units import fmt_bytes, fmt_rate

__all__: list[str] = []

#: The global batch when ``--global-batch`` is not given.
DEFAULT_GLOBAL_BATCH = 32


@contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[Cluster]:
    cluster = Cluster.load(args.cluster)
    try:
        yield cluster
    finally:
        cluster.close()


@contextmanager
def _bar(total: int, quiet: bool) -> Iterator[Callable[[int], None]]:
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="ingest", disable=quiet or None,
              leave=False) as bar:
        yield bar.update


def _model_state(cluster: Cluster, job: str) -> JobState | None:
    from ptcfs.client.control.coordinator import Coordinator

    try:
        return Coordinator(cluster).state(job)
    except JobNotFound:
        return None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", type=job_name)
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@register("data")
def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="a job's dataset: ingest, status, seek, drop",
                       description="A job's dataset, dealt to its data-parallel ranks in a "
                                   "fixed seeded order and served under /ptc/<job>/data/.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    ing = dsub.add_parser(
        "ingest", help="store a dataset for a job",
        description="Read SOURCE, check all of it, and store its samples in chunks on the "
                    "cluster (replicated like model state). Takes the job's step and "
                    "data-parallel degree from its model state if it has one, else from "
                    "--step/--dp. Bad input stops it and leaves nothing behind.")
    _common(ing)
    ing.add_argument("source", help="a .npy file, a .jsonl file, a folder of files, or a "
                                    "Megatron dataset (prefix, .bin or .idx)")
    ing.add_argument("--format", required=True, choices=list(FORMATS))
    ing.add_argument("--global-batch", type=whole(1), default=DEFAULT_GLOBAL_BATCH,
                     help=f"samples per training step (default {DEFAULT_GLOBAL_BATCH})")
    ing.add_argument("--seed", type=whole(0), default=0, help="seed of every epoch's order")
    ing.add_argument("--balance", choices=BALANCES, default="samples",
                     help="deal each batch by sample count (default) or balance tokens")
    ing.add_argument("--length-key", help="jsonl: the field that gives a record's length "
                                          "(default: length)")
    ing.add_argument("--dp", type=whole(1), help="data-parallel degree (jobs without model state)")
    ing.add_argument("--step", type=whole(0), help="starting step (jobs without model state)")
    ing.add_argument("--chunk-bytes", type=size, help="bytes per stored chunk")
    ing.add_argument("--quiet", action="store_true", help="no progress bar")
    ing.set_defaults(run=_run_ingest)

    st = dsub.add_parser("status", help="the dataset and its read position",
                         description="Format, sample count, size, order seed, global batch, "
                                     "and the committed read position.")
    _common(st)
    st.set_defaults(run=_run_status)

    sk = dsub.add_parser(
        "seek", help="commit a read position (jobs without model state)",
        description="Commit the read position: the next step and the data-parallel degree "
                    "from then on. Jobs with model state move it with `ptcctl commit` and "
                    "`ptcctl reconfigure`.")
    _common(sk)
    sk.add_argument("--step", type=whole(0), required=True)
    sk.add_argument("--dp", type=whole(1), help="data-parallel degree (default: unchanged)")
    sk.add_argument("--force", action="store_true",
                    help="even though the job has model state")
    sk.set_defaults(run=_run_seek)

    dr = dsub.add_parser("drop", help="delete the job's dataset from every host")
    _common(dr)
    dr.set_defaults(run=_run_drop)


def _describe(rec: DatasetRecord) -> str:
    shape = f" [{','.join(map(str, rec.sample_shape))}] {rec.dtype}" if rec.sample_shape else ""
    return f"{rec.count} samples of {rec.format}{shape}, {fmt_bytes(rec.nbytes)}"


def _where(rec: DatasetRecord) -> str:
    pos = rec.position_json()
    return (f"epoch {pos['epoch']}, step {pos['step']}, offset {pos['offset']}, "
            f"dp={pos['dp']}, global batch {rec.global_batch}, balance {rec.balance}")


def _run_ingest(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        state = _model_state(cluster, args.job)
        step = args.step if args.step is not None else 0
        dp = args.dp if args.dp is not None else 1
        if state is not None:
            for flag, given, have in (("--dp", args.dp, state.config.data_parallel),
                                      ("--step", args.step, state.step)):
                if given is not None and given != have:
                    raise InvalidRequest(f"job {args.job!r} is at {flag[2:]}={have}; the dataset "
                                         f"follows its model state, so leave out {flag}")
            step, dp = state.step, state.config.data_parallel
        start = time.perf_counter()
        with open_source(args.format, args.source, args.length_key,
                         need_lengths=args.balance == "tokens") as src:
            total = src.info.nbytes * max(1, min(cluster.replicas, len(cluster.hosts)))
            with _bar(total, args.quiet or args.json) as progress:
                rec = ingest_dataset(cluster, args.job, src, seed=args.seed,
                                     global_batch=args.global_batch, balance=args.balance,
                                     step=step, dp=dp, chunk_bytes=args.chunk_bytes,
                                     progress=progress)
        seconds = time.perf_counter() - start
    if args.json:
        emit_json({"job": args.job, "version": rec.version, "samples": rec.count,
                   "bytes": rec.nbytes, "chunks": len(rec.chunks), "seconds": round(seconds, 3),
                   "position": rec.position_json()})
    else:
        print(f"{args.job}: ingested {_describe(rec)} from {rec.source} in {len(rec.chunks)} "
              f"chunks, {seconds:.1f} s ({fmt_rate(rec.nbytes, seconds)})")
        print(f"{args.job}: position {_where(rec)}")
    return 0


def _run_status(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        rec = dataset_record(cluster, args.job)
    if args.json:
        emit_json({"job": args.job, "samples": rec.count, "bytes": rec.nbytes,
                   "chunks": len(rec.chunks), "source": rec.source,
                   "dtype": rec.dtype, "sample_shape": list(rec.sample_shape),
                   "position": rec.position_json()})
    else:
        print(f"{args.job}: {_describe(rec)} from {rec.source}, {len(rec.chunks)} chunks, "
              f"seed {rec.seed}")
        print(f"{args.job}: position {_where(rec)} (dataset version {rec.version})")
    return 0


def _run_seek(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        if not args.force and _model_state(cluster, args.job) is not None:
            raise InvalidRequest(f"job {args.job!r} has model state: its read position moves "
                                 "with `ptcctl commit` and `ptcctl reconfigure` (or give --force)")
        dp = args.dp if args.dp is not None else dataset_record(cluster, args.job).position.dp
        commit_position(cluster, args.job, args.step, dp)
        rec = dataset_record(cluster, args.job)
    if args.json:
        emit_json({"job": args.job, "position": rec.position_json()})
    else:
        print(f"{args.job}: position {_where(rec)}")
    return 0


def _run_drop(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        n = drop_dataset(cluster, args.job)
    if args.json:
        emit_json({"job": args.job, "dropped_versions": n})
    else:
        print(f"{args.job}: dataset dropped ({n} versions)")
    return 0
