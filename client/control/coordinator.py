"""The coordinator: ``ptcctl``'s side of jobs and reconfigurations.

It talks to every host's daemon and owns the two-phase protocol. The call
order of a reconfiguration (:meth:`Coordinator.reconfigure`):

0. Take the job's lock in the registry (:meth:`Registry.lock`): a second
   coordinator of the same job waits ``PTC_LOCK_WAIT_S``, then fails
   naming the holder. The lock is held until step 5 ends.
1. ``versions`` on every host: find the job's current version and its
   record (:class:`~ptcfs.jobstate.JobState`); hosts that do not answer are
   *lost* if the new host list leaves them out, an error otherwise. A
   version committed on some hosts, or decided (step 5) and still staging
   on others (a coordinator that died after its decision), is rolled
   forward first.
2. ``abort`` of any leftover staging version, on every host at once: it
   cancels a stage still running there, wherever it is.
3. :func:`ptcfs.plan.planner.plan` with the cluster's replica count and ring.
4. ``begin_at``, then ``stage`` on every live host, in parallel: each
   builds its new sub-tensors from local copies and from its peers (phase
   one). Then ``stage_status`` on every host, again and again: each
   answers when that host's stage ends, or after STATUS_WAIT_S with its
   bytes so far (the progress bar). Every call, here and in every step,
   pings a host that stays silent for PTC_PEER_SILENCE_S: one that does
   not answer the ping within PTC_PING_TIMEOUT_S is dead (a busy one is
   waited for); a host whose source dies fails its stage as fast, naming
   it. So a dead host ends the reconfiguration within a few seconds.
5. If every host staged: record the decision (job, old and new version,
   hosts, the new record) in the registry (one etcd transaction that checks
   the lock is still ours), send it to every live host (``decide``), then
   ``commit`` on every live host (phase two). From the decision on, the
   version is committed: a host that misses the commit commits itself
   (:mod:`ptcfs.server.ops.registry`). If any host failed to stage:
   ``abort`` on every host still answering, at once, and raise one error
   naming each host's failure; the old version stays current and whole.
6. Once decided, the reconfiguration is done: hosts that missed the commit
   are named in :attr:`ReconfigureResult.missed` and roll forward by
   themselves, or when they answer again (step 1 of the next command);
   hosts given up on (down through the whole reconfiguration) get the new
   version's record when back, from their own daemon's catch-up
   (:func:`ptcfs.server.ops.registry.catch_up`) or at the next command,
   whichever comes first: they hold nothing of it, and their mounts read
   it from its holders.
   What follows is best effort and never turns that into a failure (its
   problems are :attr:`ReconfigureResult.warnings`): old versions are
   pruned on every host at once, each daemon makes room for the next
   version, and the dataset's remaining samples are dealt to the new
   data-parallel ranks from the committed read position, which stays at
   its step (:func:`ptcfs.client.control.datastate.advance_data`).
7. With hosts given up on, the first live host is asked to repair every
   job's copies that they held, in the background (:mod:`ptcfs.client.control.repair`);
   best effort too.

A save that was opened (:mod:`ptcfs.client.control.saving`) and not committed is
dropped by step 2: commit saves before reconfiguring.
"""

from __future__ import annotations

import hashlib
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ptcfs import settings
from ptcfs.boxes import box_index, translate
from ptcfs.client.control.access import check_owner, created_by
from ptcfs.client.control.conn import Cluster, ping_timeout
from ptcfs.client.control.datastate import advance_data
from ptcfs.client.control.repair import start_repair
from ptcfs.data.names import store_job
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import (
    HostFailures,
    InvalidConfig,
    JobBusy,
    JobNotFound,
    PeerError,
    PtcError,
    StoreDamaged,
    TensorNotFound,
    VersionNotCommitted,
    VersionNotFound,
)
from ptcfs.jobstate import JobState, drop_foreign, same_version, split_foreign
from ptcfs.plan.planner import plan as make_plan
from ptcfs.plan.reshard import cut
from ptcfs.plan.stagework import HostWork, encode, split_plan
from ptcfs.server.net.registry import JobLock, holder_name
from ptcfs.sharding import placement, validate
from ptcfs.types import Box, ParallelConfig, Plan, TensorSpec, box_intersect, full_box

__all__ = ["Coordinator", "ReconfigureResult",]

#: Seconds a ``stage_status`` call waits on each host for its stage to end
#: (the answer comes as soon as it does); the progress bar moves this often.
STATUS_WAIT_S = 0.2
#: How long an abort waits for each host (a dead host is aborted by the next
#: command's step 2, once it answers again).
ABORT_TIMEOUT_S = 10.0
#: How long each host's part of the work after a commit may take (pruning,
#: making room); a host slower than this is pruned by the next command.
AFTER_COMMIT_TIMEOUT_S = 10.0



@dataclass
class ReconfigureResult:
    old: JobState
    new: JobState
    plan: Plan
    seconds: float
    received: dict[str, dict[str, int]]  # dst host → src host → bytes
    lost: tuple[str, ...]
    #: wall seconds of each phase: plan (0 when planned by the caller), stage, commit
    phases: dict[str, float] = field(default_factory=dict)
    #: host → its stage's seconds: wall, and thread-seconds of copy, fetch, put
    staged: dict[str, dict[str, float]] = field(default_factory=dict)
    #: hosts that missed the commit (host → why); they are rolled forward later
    missed: dict[str, str] = field(default_factory=dict)
    #: what went wrong after the commit (pruning, making room, the dataset)
    warnings: list[str] = field(default_factory=list)


def init_values(spec: TensorSpec, seed: int) -> np.ndarray:
    """Deterministic random values of a logical tensor (for demos and tests)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    values = rng.standard_normal(spec.shape, dtype=np.float32) * 0.02
    if spec.dtype == "bf16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(numpy_dtype(spec.dtype))


class Coordinator:
    """Jobs on a cluster, seen from ``ptcctl``."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        # job -> hosts holding another job of its name (host_versions)
        self._foreign: dict[str, dict[str, list[dict[str, Any]]]] = {}

    # --- reading the job's state ---------------------------------------------
    def host_versions(self, job: str) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
        """Each live host's versions of ``job``, and the hosts that did not
        answer. Versions of another job of the same name (another identity:
        a store from elsewhere) are left out: such a host holds nothing of
        this job (:meth:`foreign_hosts` names it)."""
        answers, down = self.cluster.call_all("versions", job=job)
        kept, self._foreign[job] = split_foreign(answers)
        return kept, down

    def foreign_hosts(self, job: str) -> dict[str, list[dict[str, Any]]]:
        """The hosts whose stores held another job named ``job`` at the last
        :meth:`host_versions`, with that job's versions."""
        return dict(self._foreign.get(job, {}))

    def drop_foreign(self, job: str, kept: dict[str, list[dict[str, Any]]]) -> None:
        """Delete the versions of another job named ``job`` that hosts held
        at the last :meth:`host_versions` (``kept``: its answer): they are not
        this job's, and their numbers would collide with its next ones."""
        drop_foreign(job, kept, self.foreign_hosts(job),
                     lambda h, op, **args: self.cluster.client(h).call(op, **args))

    def lock(self, job: str) -> JobLock:
        """The job's lock (step 0), held until released (a context manager)."""
        return self.cluster.registry.lock(job, holder_name())

    def decision(self, job: str) -> dict[str, Any] | None:
        """The job's last decision: the registry's, else the newest any host has."""
        rec = self.cluster.registry.decision(job)
        if rec is None:
            answers, _ = self.cluster.call_all("decision", job=job)
            found = [a for a in answers.values() if a]
            rec = max(found, key=lambda r: r["new"]) if found else None
        return rec

    def state(self, job: str, roll_forward: bool = True) -> JobState:
        """The job's current committed version (rolling a half commit, or a
        decided version still staging, forward)."""
        per_host, down = self.host_versions(job)
        committed: dict[int, dict[str, Any]] = {}
        staging: dict[int, list[str]] = {}
        for h, versions in per_host.items():
            for v in versions:
                if v["state"] == "committed":
                    committed[v["version"]] = v["meta"]
                else:
                    staging.setdefault(v["version"], []).append(h)
        if roll_forward and staging:
            rec = self.decision(job)
            if rec is not None and rec["new"] in staging and rec["new"] not in committed:
                hosts = [h for h in staging[rec["new"]] if h in rec["hosts"]]
                self.cluster.call_hosts(hosts, "commit", job=job, version=rec["new"],
                                        meta=rec["meta"])
                committed[rec["new"]] = rec["meta"]
        if not committed:
            raise JobNotFound(f"no host has a committed version of job {job!r}" + (
                f" ({', '.join(sorted(down))} of the cluster do not answer)" if down else ""))
        latest = max(committed)
        same: list[str] = []
        if roll_forward and latest in staging:
            # a host that missed the commit holds the same version, or another that
            # had the number (a save it had open while down): that one goes
            staged = {h: v["meta"] for h in staging[latest] for v in per_host[h]
                      if v["version"] == latest}
            same = [h for h in staging[latest] if same_version(staged[h], committed[latest])]
            other = [h for h in staging[latest] if h not in same]
            if other:
                self.cluster.call_hosts(other, "abort", quiet=True, job=job, version=latest)
            self.cluster.call_hosts(same, "commit", job=job, version=latest,
                                    meta=committed[latest])
        state = JobState.from_meta(committed[latest])
        if roll_forward:
            self._give_record(state, per_host, set(same))
        return state

    def _give_record(self, state: JobState, per_host: dict[str, list[dict[str, Any]]],
                     rolled: set[str]) -> None:
        """Give the current version's record to the answering hosts that lack
        it and hold nothing of it by its placement: hosts that were down
        when it was made (the reconfiguration left them out of its ring), or
        whose version of its number was another's. Their mounts then show
        it, reading its bytes from the hosts that hold them, instead of an
        old version as the job's current one. A host that should hold
        copies of it is a repair's (:meth:`verify` names it). ``rolled``: the
        hosts just rolled forward to it."""
        skip = set(self.foreign_hosts(state.job)) | rolled
        behind = [h for h, vs in per_host.items() if h not in skip and not any(
            v["version"] == state.version and v["state"] == "committed" for v in vs)]
        if not behind:
            return
        holding = state.copy_hosts()
        left_out = [h for h in behind if h not in holding]
        if left_out:
            meta = state.to_meta()
            failed = self.cluster.call_hosts(left_out, "begin_at", quiet=True, job=state.job,
                                             version=state.version, meta=meta)
            self.cluster.call_hosts([h for h in left_out if h not in failed], "commit",
                                    quiet=True, job=state.job, version=state.version,
                                    meta=meta)

    # --- creating a job -------------------------------------------------------
    def delete_job(self, job: str, force: bool = False) -> dict[str, int]:
        """Delete every version of ``job`` and of its dataset on every host
        (host → versions deleted). Refused while a host does not answer,
        since it may keep copies that would come back, unless ``force``.
        Holds the job's lock."""
        with self.lock(job):
            out = self._delete_job(job, force)
            self._forget(job)
            return out

    def _forget(self, job: str) -> None:
        """Drop the job's decisions, in the registry and on every live host."""
        self.cluster.registry.forget(job)
        _, down = self.cluster.call_all("ping")
        self.cluster.call_hosts([h for h in self.cluster.hosts if h not in down],
                                "forget_decision", job=job, quiet=True)

    def _delete_job(self, job: str, force: bool) -> dict[str, int]:
        listed, down = self.cluster.call_all("jobs")
        data = store_job(job)
        held = sorted(h for h, jobs in listed.items() if job in jobs or data in jobs)
        if down and not force:
            raise PeerError(f"hosts {', '.join(sorted(down))} do not answer and may hold copies "
                            f"of {job!r} that would come back; start them first, or give "
                            "--force to delete it on the others")
        if not held:
            raise JobNotFound(f"no host has job {job!r}")
        out: dict[str, int] = {}

        def one(h: str) -> None:
            client = self.cluster.client(h)
            out[h] = sum(client.call("delete_job", job=j)["versions"] for j in (job, data))

        self.cluster.each(one, held)
        return dict(sorted(out.items()))

    def set_access(self, job: str, changes: dict[str, Any]) -> JobState:
        """Merge ``changes`` (owner, mode, writers) into the job's record on
        every host that holds it; refused while one of them does not answer."""
        with self.lock(job):
            state = self.state(job)
            check_owner(state)
            answers, down = self.cluster.call_all("jobs")
            if down:
                raise PeerError(f"hosts {', '.join(down)} do not answer; they would keep the "
                                "old owner and writers: start them first")
            held = [h for h, jobs in answers.items() if job in jobs]
            self.cluster.call_hosts(held, "set_access", job=job, changes=changes)
            return self.state(job)

    def create(self, state: JobState, seed: int,
               progress: Callable[[int], None] | None = None) -> None:
        """Version 1 of a job with deterministic random values (owned by the
        caller unless ``state`` names an owner: :func:`ptcfs.client.control.access.created_by`)."""
        state = created_by(state, self.cluster.key_name)
        model = state.model_spec()
        validate(model, state.config)
        self._check_hosts(state.config)
        existing, down = self.cluster.call_all("versions", job=state.job)
        if down:
            raise PeerError(f"hosts not answering: {', '.join(down)}; cannot create a job")
        if any(existing.values()):
            raise InvalidConfig(f"job {state.job!r} exists already; pick another name")
        self._forget(state.job)  # of a job of this name deleted while a host was down
        hosts = list(self.cluster.hosts)
        meta = state.to_meta()
        self.cluster.call_hosts(hosts, "begin_at", job=state.job, version=state.version,
                                meta=meta)
        try:
            values: dict[str, np.ndarray] = {}
            for spec in model.tensors_for(state.config.pp):
                src = spec.same_as if spec.same_as and spec.same_as in values else spec.name
                logical = values[src] if src != spec.name else init_values(spec, seed)
                if any(s.same_as == spec.name for s in model.tensors_for(state.config.pp)):
                    values[spec.name] = logical
                where = placement(model, state.config, spec, state.replicas, state.ring)
                for sl, on in where.items():
                    sub = cut(spec, sl, logical)
                    for h in on:
                        self.cluster.client(h).put(state.job, state.version, spec.name,
                                                   sl.key(), sub, spec.dtype)
                    if progress:
                        progress(sub.nbytes * len(on))
        except BaseException:
            self.cluster.call_hosts(hosts, "abort", job=state.job, version=state.version,
                                    quiet=True)
            raise
        self.cluster.call_hosts(hosts, "commit", job=state.job, version=state.version, meta=meta)
        self.cluster.call_hosts(hosts, "make_room", quiet=True)

    def _check_hosts(self, cfg: ParallelConfig) -> None:
        unknown = [h.name for h in cfg.hosts if h.name not in self.cluster.hosts]
        if unknown:
            raise InvalidConfig(f"hosts not in the cluster file: {', '.join(unknown)} "
                                f"(known: {', '.join(self.cluster.hosts)})")

    # --- reconfiguring --------------------------------------------------------
    def plan_for(self, job: str, new_cfg: ParallelConfig) -> tuple[JobState, JobState, Plan,
                                                                   tuple[str, ...]]:
        """Steps 1–3: the current state, the new state and the plan."""
        old = self.state(job)
        self._check_hosts(new_cfg)
        model = old.model_spec()
        validate(model, new_cfg)
        _, down = self.cluster.call_all("ping")
        needed = [h.name for h in new_cfg.hosts if h.name in down]
        if needed:
            raise PeerError(f"hosts in the new configuration do not answer: {', '.join(needed)}")
        lost = tuple(sorted(down))
        # hosts back with an empty or another store hold none of the old copies,
        # and a host whose scrub quarantined entries of the version lacks those:
        # no source (until a repair), but a destination like any live host
        per_host, _ = self.host_versions(job)
        empty = self.empty_hosts(old, per_host) + [
            h for h, vs in per_host.items() if h not in old.lost and any(
                v["version"] == old.version and v.get("damaged") for v in vs)]
        ring = tuple(h for h in self.cluster.hosts if h not in down)
        new = old.with_(version=old.version + 1, config=new_cfg, ring=ring,
                        replicas=self.cluster.replicas, lost=(), holders=())
        p = make_plan(model, old.config, new_cfg, replicas=new.replicas, old_ring=old.ring,
                      new_ring=ring, lost=frozenset(lost) | frozenset(old.lost) | set(empty),
                      old_extra=old.extra)
        return old, new, p, lost

    def reconfigure(
        self,
        job: str,
        new_cfg: ParallelConfig,
        progress: Callable[[int], None] | None = None,
        planned: tuple[JobState, JobState, Plan, tuple[str, ...]] | None = None,
    ) -> ReconfigureResult:
        """Steps 0–5 of the protocol in the module docstring (``planned``:
        the result of :meth:`plan_for`, when the caller has it already; it
        is refused if the job changed before the lock was taken)."""
        with self.lock(job) as lock:
            if planned is not None:
                now = self.state(job)
                if now.version != planned[0].version:
                    raise JobBusy(f"job {job!r} changed to version {now.version} while this "
                                  f"reconfiguration was planned from version "
                                  f"{planned[0].version}; run it again")
            return self._reconfigure(job, new_cfg, lock, progress, planned)

    def _reconfigure(self, job: str, new_cfg: ParallelConfig, lock: JobLock,
                     progress: Callable[[int], None] | None,
                     planned: tuple[JobState, JobState, Plan, tuple[str, ...]] | None
                     ) -> ReconfigureResult:
        start = time.perf_counter()
        old, new, p, lost = planned or self.plan_for(job, new_cfg)
        phases = {"plan": time.perf_counter() - start}
        staged: dict[str, dict[str, float]] = {}
        live = [h for h in self.cluster.hosts if h not in lost]
        if self.foreign_hosts(job):  # hosts back with another job of this name
            kept, _ = self.host_versions(job)
            self.drop_foreign(job, kept)
        self._abort_staging(job, live)
        meta = new.to_meta()
        failures: dict[str, str] = {}
        received: dict[str, dict[str, int]] = {}
        t0 = time.perf_counter()
        try:
            self.cluster.call_hosts(live, "begin_at", job=job, version=new.version, meta=meta)
            work = split_plan(p, new.model_spec(), new.replicas, new.ring)
            empty = HostWork("", (), ())
            self.cluster.call_hosts(live, "stage", job=job, old_version=old.version,
                                    new_version=new.version,
                                    per_host=lambda h: encode(work.get(h, empty)))
            self._wait_staged(job, new.version, live, failures, received, progress, staged)
        except HostFailures as e:
            failures.update(e.failures)
        if failures:
            answering = [h for h in live if not self.cluster.is_down(h)]
            self.cluster.call_hosts(answering, "abort", job=job, version=new.version,
                                    quiet=True, timeout_s=ABORT_TIMEOUT_S)
            raise HostFailures(f"reconfiguring {job!r} (old version {old.version} stays current)",
                               failures)
        phases["stage"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        told = self.decide(job, old.version, new.version, live, meta, lock)
        missed = self._commit_all(job, new.version, live, meta, told)
        committed = [h for h in live if h not in missed]
        warnings = self._after_commit(job, committed, new_cfg.data_parallel, lost)
        phases["commit"] = time.perf_counter() - t0
        return ReconfigureResult(old, new, p, time.perf_counter() - start, received, lost,
                                 {k: round(v, 4) for k, v in phases.items()}, staged,
                                 missed, warnings)

    def _wait_staged(self, job: str, version: int, hosts: list[str], failures: dict[str, str],
                     received: dict[str, dict[str, int]],
                     progress: Callable[[int], None] | None,
                     staged: dict[str, dict[str, float]] | None = None) -> None:
        """Ask ``stage_status`` until every host is done or one fails; each
        call waits on the hosts up to STATUS_WAIT_S for their stages to end.
        ``progress(0)`` first: every host has started staging."""
        seen = 0
        if progress is not None:
            progress(0)
        while True:
            asked = time.perf_counter()
            answers, down = self.cluster.call_all("stage_status", hosts=hosts, job=job,
                                                  version=version, wait=STATUS_WAIT_S)
            for h in down:
                failures[h] = ("stopped answering while staging (no answer to a liveness ping "
                               f"within {ping_timeout():g} s)")
            for h, a in answers.items():
                if a["state"] == "failed":
                    failures[h] = a["error"]
                elif a["state"] == "unknown":
                    failures[h] = "lost its stage (restarted?)"
            if failures:
                return
            if all(a["state"] == "done" for a in answers.values()):
                for h, a in answers.items():
                    received[h] = dict(a["result"]["received"])
                    if staged is not None:
                        staged[h] = dict(a["result"].get("seconds", {}))
                break
            total = sum(int(a["bytes"]) for a in answers.values())
            if progress is not None and total > seen:
                progress(total - seen)
                seen = total
            self._pause(asked)
        if progress is not None:
            progress(sum(b for r in received.values() for b in r.values()) - seen)

    @staticmethod
    def _pause(asked: float) -> None:
        """Between two status calls: none, unless the hosts answered without
        waiting (a stage still running everywhere, yet an answer at once)."""
        left = STATUS_WAIT_S / 2 - (time.perf_counter() - asked)
        if left > 0:
            time.sleep(left)

    def decide(self, job: str, old: int, new: int, hosts: list[str], meta: dict[str, Any],
               lock: JobLock) -> list[str]:
        """Record the decision to commit version ``new`` on ``hosts`` (step 5):
        in the registry (JobBusy if ``lock`` was lost: nothing is decided),
        then on every host. Call it once every host has staged, before any
        commit. The hosts that have the decision."""
        _pause_at("staged")
        record = {"job": job, "old": old, "new": new, "hosts": hosts, "meta": meta,
                  "decision": "commit", "by": lock.holder}
        self.cluster.registry.decide(job, record, lock)
        _pause_at("decided")
        missed = self.cluster.call_hosts(hosts, "decide", quiet=True, record=record,
                                         timeout_s=ABORT_TIMEOUT_S)
        _pause_at("told")
        return [h for h in hosts if h not in missed]

    def _commit_all(self, job: str, version: int, hosts: list[str], meta: dict[str, Any],
                    told: list[str]) -> dict[str, str]:
        """Phase two; the hosts that missed the commit (host → why). The
        decision is recorded already (in the registry, and on the hosts
        ``told``): a host that misses the commit commits itself from it, or
        is rolled forward the next time anyone reads the job's state
        (:meth:`state`). Raises only when the decision is nowhere but here:
        no atomic registry, no host told, no host committed."""
        if settings.get("PTC_TEST_PAUSE_AT") == "committing" and len(hosts) > 1:
            # tests: killed mid-commit, once the first host has committed
            self.cluster.call_hosts(hosts[:1], "commit", job=job, version=version, meta=meta)
            _pause_at("committing")
        missed = self.cluster.call_hosts(hosts, "commit", quiet=True, job=job, version=version,
                                         meta=meta)
        if len(missed) == len(hosts) and not told and not self.cluster.registry.atomic:
            raise HostFailures(f"committing version {version} of {job!r} (no host confirmed "
                               "it; the next command finds out which version is current)",
                               missed)
        return missed

    def _after_commit(self, job: str, hosts: list[str], dp: int,
                      lost: tuple[str, ...]) -> list[str]:
        """Steps 6 and 7, best effort, on ``hosts`` (those that committed):
        the problems met, one line each."""
        warnings = []
        try:
            self.prune(job, hosts)
        except PtcError as e:
            warnings.append(f"old versions were not pruned: {e}")
        try:
            advance_data(self.cluster, job, None, dp)
        except PtcError as e:
            warnings.append(f"the dataset's samples were not dealt to the new ranks: {e}")
        if lost:  # other jobs' copies on the lost hosts: the live hosts restore them
            try:
                start_repair(self.cluster, None, lost, live=hosts)
            except PtcError as e:
                warnings.append(f"the repair of the copies {', '.join(lost)} held did not "
                                f"start: {e} (run `ptcctl repair`)")
        return warnings

    def prune(self, job: str, hosts: list[str], keep: int | None = None) -> list[int]:
        """Delete committed versions older than the newest ``keep`` on
        ``hosts`` (all at once), then have them make room for the next
        version. Best effort: a host that does not answer, or fails, keeps
        its old versions until the next prune. The versions pruned."""
        keep = settings.get("PTC_KEEP_VERSIONS", keep)
        answers, _ = self.cluster.call_all("versions", hosts=hosts, job=job)
        committed = sorted({v["version"] for vs in answers.values() for v in vs
                            if v["state"] == "committed"})
        # a version whose files are open on some host's mount stays on every host
        # (the reader may read pieces from any holder) until a later prune
        read = {v["version"] for vs in answers.values() for v in vs if v.get("readers")}
        old = [v for v in committed[:-keep] if v not in read] if keep > 0 else []

        def one(h: str) -> None:
            client = self.cluster.client(h, AFTER_COMMIT_TIMEOUT_S)
            for v in answers[h]:
                if v["version"] in old:
                    try:
                        client.call("delete_version", job=job, version=v["version"])
                    except PtcError:
                        return  # pruned next time

        self.cluster.each(one, sorted(answers))
        # the next version's room, now that the old ones' pages are free
        self.cluster.call_hosts(sorted(answers), "make_room", quiet=True,
                                timeout_s=AFTER_COMMIT_TIMEOUT_S)
        return old

    def _abort_staging(self, job: str, hosts: list[str]) -> None:
        """Abort every staging version of ``job`` on ``hosts``, all at once
        (the caller holds the job's lock, and :meth:`state` has rolled
        decided ones forward)."""
        answers, _ = self.cluster.call_all("versions", hosts=hosts, job=job)

        def one(h: str) -> None:
            for v in answers[h]:
                if v["state"] == "staging":
                    self.cluster.client(h, ABORT_TIMEOUT_S).call("abort", job=job,
                                                                 version=v["version"])

        self.cluster.each(one, sorted(answers))

    # --- reading state back ---------------------------------------------------
    def fetch_tensor(self, state: JobState, name: str, box: Box | None = None,
                     down: list[str] | None = None) -> np.ndarray:
        """The logical tensor ``name`` (or the region ``box`` of it), read from
        live hosts (``down``: hosts known not to answer, else asked now; and
        never from a host that held another job of its name when the state was
        read)."""
        model = state.model_spec()
        specs = {s.name: s for s in model.tensors_for(state.config.pp)}
        if name not in specs:
            from ptcfs.errors import TensorNotFound
            raise TensorNotFound(f"job {state.job!r} has no tensor {name!r}")
        spec = specs[name]
        want = box if box is not None else full_box(spec.shape)
        out = np.zeros([b - a for a, b in want], dtype=numpy_dtype(spec.dtype))
        if down is None:
            _, down = self.cluster.call_all("ping")
        down = [*down, *self.foreign_hosts(state.job)]
        where = state.placement(spec, model)
        for sl, hosts in where.items():
            alive = [h for h in hosts if h not in down]
            for logical, local in sl.pieces(spec.shape):
                inter = box_intersect(logical, want)
                if inter is None:
                    continue
                if not alive:
                    raise PeerError(f"{name} [{sl.key()}]: every host holding it is down "
                                    f"({', '.join(hosts)})")
                src_box = translate(inter, logical, local)
                data = self._read_box_any(alive, state, name, sl.key(), src_box)
                region = tuple((a - w0, b - w0) for (a, b), (w0, _) in zip(inter, want))
                out[box_index(region)] = np.frombuffer(data, dtype=out.dtype).reshape(
                    [b - a for a, b in inter])
        return out

    def _read_box_any(self, hosts: list[str], state: JobState, name: str, part: str,
                      box: Box) -> memoryview:
        """A box from the first of ``hosts`` that has ``state``'s version
        committed (one rolling forward to it has it staging) and the piece
        (one whose store was wiped, or whose copy a scrub quarantined, lacks it;
        one whose data file was cut short cannot read it)."""
        for h in hosts[:-1]:
            try:
                return self.cluster.client(h).read_box(state.job, state.version, name, part, box)
            except (VersionNotCommitted, JobNotFound, VersionNotFound, TensorNotFound,
                    StoreDamaged):
                continue
        return self.cluster.client(hosts[-1]).read_box(state.job, state.version, name, part, box)

    def checksums(self, state: JobState) -> dict[str, str]:
        """sha256 of every logical tensor's C-order bytes."""
        out = {}
        _, down = self.cluster.call_all("ping")
        for spec in state.model_spec().tensors_for(state.config.pp):
            data = self.fetch_tensor(state, spec.name, down=down).data
            out[spec.name] = hashlib.sha256(data).hexdigest()
        return out

    def empty_hosts(self, state: JobState,
                    per_host: dict[str, list[dict[str, Any]]] | None = None) -> list[str]:
        """The hosts that answer but hold nothing of ``state``'s version (a
        store wiped, set aside or another host's): hosts that lost their
        copies, which a repair restores."""
        if per_host is None:
            per_host, _ = self.host_versions(state.job)
        return sorted(h for h, vs in per_host.items() if h not in state.lost and not any(
            v["version"] == state.version and v["state"] == "committed" for v in vs))

    def verify(self, state: JobState) -> list[str]:
        """Problems with the current version: hosts that lost their copies,
        missing copies, differing bytes."""
        model = state.model_spec()
        per_host, _ = self.host_versions(state.job)
        empty = self.empty_hosts(state, per_host)
        foreign = self.foreign_hosts(state.job)
        asked = [h for h in self.cluster.hosts if h not in empty]
        digests, down = self.cluster.call_all("digest", hosts=asked, job=state.job,
                                              version=state.version)
        problems = [f"host {h} does not answer" for h in down if h not in state.lost]
        health, _ = self.cluster.call_all("health", hosts=empty)
        for h in empty:
            problem = health.get(h, {}).get("store_problem")
            if problem is not None:
                problems.append(f"host {h} cannot serve its copies: {problem}")
            elif h in foreign:
                others = sorted({v["meta"].get("identity") for v in foreign[h]})
                problems.append(
                    f"host {h} holds another job named {state.job!r} (identity "
                    f"{', '.join(others)}; this job's is {state.identity}): a store from "
                    f"elsewhere, so it lost its copies; `ptcctl repair {state.job}` replaces "
                    "them")
            else:
                older = max((v["version"] for v in per_host.get(h, ())
                             if v["state"] == "committed"), default=None)
                has = f"it has version {older}" if older else "its store is empty"
                problems.append(
                    f"host {h} holds nothing of version {state.version} ({has}): "
                    f"it lost its copies; `ptcctl repair {state.job}` restores them")
        for spec in model.tensors_for(state.config.pp):
            where = state.placement(spec, model)
            for sl, hosts in where.items():
                key = f"{spec.name}\0{sl.key()}"
                seen = {h: digests[h].get(key) for h in hosts if h in digests}
                missing = [h for h, d in seen.items() if d is None]
                if missing:
                    problems.append(f"{spec.name} [{sl.key()}] missing on {', '.join(missing)}")
                if len({d for d in seen.values() if d}) > 1:
                    problems.append(f"{spec.name} [{sl.key()}] differs between copies on "
                                    f"{', '.join(seen)}")
                if len(hosts) < state.replicas:
                    problems.append(f"{spec.name} [{sl.key()}] has {len(hosts)} copies, "
                                    f"fewer than replicas={state.replicas}")
        return problems


def _pause_at(point: str) -> None:
    """Tests only (``PTC_TEST_PAUSE_AT``): stop here until killed, saying so
    on stderr, so a test can kill the coordinator at a known point."""
    if settings.get("PTC_TEST_PAUSE_AT") == point:
        print(f"paused at {point}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(0.1)
