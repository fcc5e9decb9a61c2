"""A job's dataset on the cluster: ingest, read position, status, drop.

The dataset lives in the store-job ``<job>@data`` on every host
(:mod:`ptcfs.data.record`). Who calls what:

- ``ptcctl data ingest`` → :func:`ingest_dataset` (once per job).
- ``ptcctl commit JOB --step N`` and ``ptcctl reconfigure`` (after their
  model version is committed) → :func:`commit_position` with the job's
  step and data-parallel degree (:func:`advance_data`);
  ``ptcctl data seek`` for jobs without model state.
- ``ptcctl data status`` → :func:`dataset_record`.

:func:`commit_position` writes a new committed version, holding no
entries, whose record has the new position, on every host that answers
(a host that is down catches up at the next commit: until then its mount
shows the older position). Versions of older positions are dropped
(``PTC_DATA_KEEP_POSITIONS`` are kept, and the ingested version always).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ptcfs import settings
from ptcfs.client.control.conn import Cluster
from ptcfs.data.ingest import ingest
from ptcfs.data.names import store_job
from ptcfs.data.record import META_KEY, DatasetRecord, check_position
from ptcfs.data.source import Source
from ptcfs.errors import DatasetExists, InvalidRequest, JobNotFound, PeerError, PtcError
from ptcfs.jobstate import DEFAULT_MODE

__all__ = ["ClusterSink", "has_dataset", "dataset_record", "commit_position", "advance_data",
           "check_forward", "ingest_dataset", "drop_dataset", "latest_record"]


def _versions(cluster: Cluster, job: str) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    answers, down = cluster.call_all("versions", job=store_job(job))
    return answers, down


def _latest(answers: dict[str, list[dict[str, Any]]]) -> DatasetRecord | None:
    committed = {v["version"]: v["meta"] for vs in answers.values() for v in vs
                 if v["state"] == "committed"}
    return DatasetRecord.from_meta(committed[max(committed)]) if committed else None


def dataset_record(cluster: Cluster, job: str) -> DatasetRecord:
    """The job's current dataset record (the newest any host has committed)."""
    rec = _latest(_versions(cluster, job)[0])
    if rec is None:
        raise JobNotFound(f"job {job!r} has no dataset; ingest one with "
                          f"`ptcctl data ingest {job} SOURCE --format ...`")
    return rec


def latest_record(cluster: Cluster, job: str) -> DatasetRecord | None:
    """The job's current dataset record, or None when it has no dataset."""
    return _latest(_versions(cluster, job)[0])


def has_dataset(cluster: Cluster, job: str) -> bool:
    """Whether any live host holds a committed dataset of ``job``."""
    return _latest(_versions(cluster, job)[0]) is not None


def advance_data(cluster: Cluster, job: str, step: int | None, dp: int,
                 force: bool = False) -> None:
    """Deal the job's dataset, if it has one, to ``dp`` ranks from ``step``
    (None: the step its read position is at; called after every commit of
    a new version). Moving the position back is refused unless ``force``:
    see :func:`check_forward`."""
    rec = _latest(_versions(cluster, job)[0])
    if rec is None:
        return
    target = rec.position.step if step is None else step
    if not force:
        check_forward(rec, job, target)
    commit_position(cluster, job, target, dp)


def check_forward(rec: DatasetRecord | None, job: str, step: int) -> None:
    """Refuse to move a read position back to ``step`` (the samples between
    would be read again), saying what it would undo."""
    if rec is not None and step < rec.position.step:
        raise InvalidRequest(
            f"the dataset of {job!r} is read up to step {rec.position.step}; going back to "
            f"step {step} would read {rec.position.step - step} steps of samples again "
            "(give --force to do it anyway)")


def commit_position(cluster: Cluster, job: str, step: int, dp: int) -> None:
    """Commit the read position ``step`` under ``dp`` data-parallel ranks
    on every host that answers (see the module docstring)."""
    check_position(step, dp)
    answers, _ = _versions(cluster, job)
    rec = _latest(answers)
    if rec is None:
        raise JobNotFound(f"job {job!r} has no dataset to move the read position of")
    hosts = sorted(answers)
    sj = store_job(job)
    base = rec.base_version

    def abort_staging(h: str) -> None:  # a position commit that failed half-way
        for v in answers[h]:
            if v["state"] == "staging" and v["version"] > base:
                cluster.client(h).call("abort", job=sj, version=v["version"])

    cluster.each(abort_staging, hosts)
    version = max(v["version"] for vs in answers.values() for v in vs) + 1
    meta = rec.with_position(step, dp, version).to_meta()
    cluster.call_hosts(hosts, "begin_at", job=sj, version=version, meta=meta)
    try:
        cluster.call_hosts(hosts, "commit", job=sj, version=version, meta=meta)
    except PtcError:
        cluster.call_hosts(hosts, "abort", job=sj, version=version, quiet=True)
        raise
    _prune(cluster, answers, sj, rec.base_version, version)


def _prune(cluster: Cluster, answers: dict[str, list[dict[str, Any]]], sj: str, base: int,
           newest: int) -> None:
    committed = sorted({v["version"] for vs in answers.values() for v in vs
                        if v["state"] == "committed"} | {newest})
    keep = {base, *committed[-int(settings.get("PTC_DATA_KEEP_POSITIONS")):]}

    def one(h: str) -> None:
        for v in answers[h]:
            if v["state"] == "committed" and v["version"] not in keep:
                try:
                    cluster.client(h).call("delete_version", job=sj, version=v["version"])
                except PtcError:
                    return  # dropped at the next commit

    cluster.each(one, sorted(answers))


class ClusterSink:
    """An ingest's writes to every host of a cluster (:class:`ptcfs.data.ingest.Sink`)."""

    def __init__(self, cluster: Cluster, job: str):
        self.cluster = cluster
        self.job = store_job(job)
        self.ring = list(cluster.hosts)
        self.replicas = cluster.replicas

    def next_version(self) -> int:
        answers, _ = self.cluster.call_all("versions", job=self.job)
        return max((v["version"] for vs in answers.values() for v in vs), default=0) + 1

    def begin(self, version: int, meta: dict[str, Any]) -> None:
        self.cluster.call_hosts(self.ring, "begin_at", job=self.job, version=version, meta=meta)

    def put(self, hosts: tuple[str, ...], version: int, tensor: str, part: str,
            data: np.ndarray) -> None:
        dtype = {np.dtype(np.int64): "int64", np.dtype(np.int32): "int32"}.get(data.dtype,
                                                                              "uint8")
        arr = data if dtype != "uint8" else data.view(np.uint8).reshape(-1)
        for h in hosts:
            self.cluster.client(h).put(self.job, version, tensor, part, arr, dtype)

    def commit(self, version: int, meta: dict[str, Any]) -> None:
        self.cluster.call_hosts(self.ring, "commit", job=self.job, version=version, meta=meta)

    def abort(self, version: int) -> None:
        self.cluster.call_hosts(self.ring, "abort", job=self.job, version=version, quiet=True)


def ingest_dataset(cluster: Cluster, job: str, source: Source, *, seed: int, global_batch: int,
                   balance: str = "samples", step: int = 0, dp: int = 1,
                   chunk_bytes: int | None = None,
                   progress: Callable[[int], None] | None = None) -> DatasetRecord:
    """Store ``source`` as ``job``'s dataset on every host (all must answer)."""
    _, down = cluster.call_all("ping")
    if down:
        raise PeerError(f"hosts not answering: {', '.join(down)}; every host keeps the "
                        "dataset's record, so all must be up to ingest")
    if has_dataset(cluster, job):
        raise DatasetExists(f"job {job!r} has a dataset already; drop it first with "
                            f"`ptcctl data drop {job}`")
    return ingest(source, ClusterSink(cluster, job), job, seed=seed, global_batch=global_batch,
                  balance=balance, step=step, dp=dp, chunk_bytes=chunk_bytes, progress=progress,
                  access=_access_of_new(cluster, job))


def _access_of_new(cluster: Cluster, job: str) -> dict[str, Any]:
    """A job without a record gets one through its dataset: owned by the
    caller, with the default mode, changed only by the caller's client key
    (the job's record governs once there is one)."""
    answers, _ = cluster.call_all("versions", job=job)
    if any(answers.values()):
        return {}
    out: dict[str, Any] = {"owner": [os.getuid(), os.getgid()], "mode": DEFAULT_MODE}
    if cluster.key_name is not None:
        out["writers"] = [cluster.key_name]
    return out


def drop_dataset(cluster: Cluster, job: str) -> int:
    """Drop the job's dataset: when every host answers, all of it, leaving
    nothing; else on the hosts that answer an empty version (a record of
    none) becomes current and every other version is deleted, and the
    hosts that did not answer are named. Returns how many versions were
    dropped."""
    answers, down = _versions(cluster, job)
    if _latest(answers) is None:
        raise JobNotFound(f"job {job!r} has no dataset")
    sj = store_job(job)
    hosts = sorted(answers)
    version = max(v["version"] for vs in answers.values() for v in vs) + 1
    meta: dict[str, Any] = {META_KEY: None}
    if not down:  # every host answers: nothing can come back, so nothing is left
        cluster.call_hosts(hosts, "delete_job", job=sj)
        return len({v["version"] for vs in answers.values() for v in vs})
    # a record of none becomes current, so that a host that comes back with the
    # dataset does not bring it back
    cluster.call_hosts(hosts, "begin_at", job=sj, version=version, meta=meta)
    cluster.call_hosts(hosts, "commit", job=sj, version=version, meta=meta)
    for h, vs in answers.items():
        client = cluster.client(h)
        for v in vs:
            op = "delete_version" if v["state"] == "committed" else "abort"
            client.call(op, job=sj, version=v["version"])
    raise PeerError(f"the dataset of {job!r} was dropped on {', '.join(hosts)}; hosts "
                    f"{', '.join(down)} did not answer and keep it until it is dropped "
                    "again")
