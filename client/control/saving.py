"""Saving a job's state: open the next version, let ranks write, commit a step.

The call order (who calls what):

1. :func:`begin_save` (the job, once per save; idempotent): opens the next
   version as *staging* on every live host, with the current configuration.
   A writer with nothing of its own to put calls :func:`join_save` instead,
   which opens nothing once the step it saves is committed.
2. Writers (each rank, or the filesystem on a rank's behalf) ``put`` the
   rank's sub-tensors into that version on the rank's own host, keyed by
   tensor name and :meth:`~ptcfs.types.Slice.key`. Data-parallel replicas
   may all write the same slice; one copy is enough.
3. :func:`commit_step` (``ptcctl commit JOB --step N``): checks that every
   sub-tensor of the configuration was written somewhere — if not, nothing
   changes and the error lists what is missing (the version stays open, so
   the missing writes can still come); copies each sub-tensor to every host
   that must hold it and did not write it (the ``stage`` operation, fetching
   from the host that wrote it last). A copy is never a source: one that an
   earlier attempt to commit made (then failed) is made again, from what
   the ranks wrote since; commits the version everywhere with the step (the two-phase commit
   of :class:`~ptcfs.client.control.coordinator.Coordinator`); prunes old versions;
   and advances the dataset's read position, if the job has a dataset.

A failure before the commit leaves the previous version current and whole.
A save that no commit will end (its writers are gone, or failed for good)
is dropped by :func:`discard_save` (``ptcctl discard JOB``); until then it
keeps repairs of the job waiting, as every version staging does.
"""

from __future__ import annotations

from ptcfs.boxes import box_volume, full_box
from ptcfs.client.control import datastate
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.errors import HostFailures, IncompleteSave, InvalidRequest, PeerError
from ptcfs.jobstate import SAVE_MARK, JobState
from ptcfs.plan.stagework import HostWork, encode
from ptcfs.server.net.registry import JobLock
from ptcfs.types import Endpoint, Entry, ParallelConfig, Transfer

__all__ = ["begin_save", "commit_step", "discard_save", "join_save", "open_save", "SAVE_MARK"]


def open_save(coord: Coordinator, job: str) -> int | None:
    """The version opened for saving ``job``, if there is one."""
    answers, _ = coord.cluster.call_all("versions", job=job)
    opened = [v["version"] for vs in answers.values() for v in vs
              if v["state"] == "staging" and v["meta"].get(SAVE_MARK)]
    return max(opened) if opened else None


def begin_save(coord: Coordinator, job: str) -> int:
    """Step 1: the version that writers put into (opened now if needed, by
    the daemon operation ``open_save`` of any live host of the job)."""
    return int(_open(coord, job)["version"])


def join_save(coord: Coordinator, job: str, step: int) -> int | None:
    """Step 1 for a writer of ``step`` that has nothing of its own to put
    (a data-parallel replica, which waits for the commit): as
    :func:`begin_save`, but None, and nothing opened, when the job has
    committed ``step`` already. Such a writer can come after the commit of
    the save it belongs to; opening the next version would leave one open
    that no commit ends."""
    answer = _open(coord, job, step=step)
    return None if answer["committed"] else int(answer["version"])


def _open(coord: Coordinator, job: str, **args: int) -> dict:
    """The daemon's ``open_save`` answer, asked of the job's first host
    once every host of its configuration answers."""
    current = coord.state(job)
    _, down = coord.cluster.call_all("ping")
    needed = [h.name for h in current.config.hosts if h.name in down]
    if needed:
        raise PeerError(f"hosts of the job's configuration do not answer: {', '.join(needed)}")
    host = current.config.hosts[0].name
    answer: dict = coord.cluster.client(host).call("open_save", job=job, **args)
    return answer


def commit_step(coord: Coordinator, job: str, step: int, force: bool = False,
                dcp: str | None = None, spec_text: str | None = None,
                config: ParallelConfig | None = None) -> JobState:
    """Step 3: commit the saved version as ``step`` (see the module docstring).
    A step before the dataset's read position is refused unless ``force``.
    ``dcp``: the record's :attr:`~ptcfs.jobstate.JobState.dcp` (a save made by
    ``dcp.save`` through the mount); ``spec_text``: the record's
    :attr:`~ptcfs.jobstate.JobState.spec` when the save changes it (the model
    files a ``save_pretrained`` through the mount wrote; the same tensors);
    ``config``: the layout the ranks wrote when it is not the committed one
    (a live change's durable copy: the workers changed their mesh in place
    and save under the new one), recorded with the step. Holds the job's
    lock; the decision is recorded before any host commits."""
    with coord.lock(job) as lock:
        return _commit_step(coord, job, step, force, lock, dcp, spec_text, config)


def _commit_step(coord: Coordinator, job: str, step: int, force: bool, lock: JobLock,
                 dcp: str | None = None, spec_text: str | None = None,
                 config: ParallelConfig | None = None) -> JobState:
    if step < 0:
        raise InvalidRequest(f"step must be >= 0, not {step}")
    current = coord.state(job)
    version = open_save(coord, job)
    if version is None or version <= current.version:
        raise InvalidRequest(f"nothing was saved for job {job!r}: write the ranks' state into "
                             f"/ptc/{job}/ranks/<rank>/ first (or use the client's save)")
    if step < current.step:
        raise InvalidRequest(f"step {step} is before the committed step {current.step} of "
                             f"job {job!r}")
    new = current.with_(version=version, step=step, **({} if dcp is None else {"dcp": dcp}),
                        **({} if spec_text is None else {"spec": spec_text}),
                        **({} if config is None else {"config": config}))
    if not force:
        datastate.check_forward(datastate.latest_record(coord.cluster, job), job, step)
    answers, down = coord.cluster.call_all("entries", job=job, version=version)
    needed = [h.name for h in new.config.hosts if h.name in down]
    if needed:
        raise PeerError(f"hosts of the job's configuration do not answer: {', '.join(needed)}")
    # who wrote each sub-tensor, and when: a copy the stage of an earlier
    # attempt to commit made is no source, and is made again
    written: dict[tuple[str, str], dict[str, float]] = {}
    for h, listed in answers.items():
        for e in listed:
            if e.get("written") is not None:
                written.setdefault((e["tensor"], e["part"]), {})[h] = float(e["written"])
    model = new.model_spec()
    missing: list[str] = []
    entries: dict[str, list[Entry]] = {}
    moves: dict[str, list[Transfer]] = {}
    for spec in model.tensors_for(new.config.pp):
        where = new.placement(spec, model, frozenset(down))
        for sl, hosts in where.items():
            writers = written.get((spec.name, sl.key()), {})
            if not writers:
                missing.append(f"{spec.name} [{sl.key()}]")
                continue
            newest = max(writers, key=writers.__getitem__)
            shape = sl.local_shape(spec.shape)
            box = full_box(shape)
            for h in hosts:
                if h in writers:
                    continue
                entries.setdefault(h, []).append(Entry(spec.name, sl, shape, spec.dtype))
                moves.setdefault(h, []).append(Transfer(
                    Endpoint(newest, -1, spec.name, sl, box),
                    Endpoint(h, -1, spec.name, sl, box),
                    spec.itemsize * box_volume(box)))
    work = {h: encode(HostWork(h, tuple(e), tuple(moves[h]))) for h, e in entries.items()}
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                         else "")
        raise IncompleteSave(f"version {version} of {job!r} is not complete; not written: "
                             f"{shown}. Write them, then commit again.")
    if work:
        failures: dict[str, str] = {}
        coord.cluster.call_hosts(sorted(work), "stage", job=job, old_version=version,
                                 new_version=version, per_host=lambda h: work[h])
        coord._wait_staged(job, version, sorted(work), failures, {}, None)
        if failures:
            raise HostFailures(f"copying the saved state of {job!r} to its replicas "
                               f"(version {current.version} stays current)", failures)
    live = [h for h in coord.cluster.hosts if h not in down]
    meta = {**new.to_meta(), SAVE_MARK: False}
    told = coord.decide(job, current.version, version, live, meta, lock)
    coord._commit_all(job, version, live, meta, told)
    coord.prune(job, live)
    datastate.advance_data(coord.cluster, job, step, new.config.data_parallel, force=True)
    return new


def discard_save(coord: Coordinator, job: str) -> int | None:
    """Drop ``job``'s open save on every host that answers: what its ranks
    wrote since the last commit. The version dropped, or None where no save
    is open. Holds the job's lock, so no commit of it is under way; a save
    whose commit was decided is committed (rolled forward), not dropped. A
    host that is down drops its copy when a later command finds it staging."""
    with coord.lock(job):
        current = coord.state(job)  # rolls a decided commit forward
        answers, _ = coord.cluster.call_all("versions", job=job)
        saves = {h: {v["version"] for v in vs if v["state"] == "staging"
                     and v["meta"].get(SAVE_MARK) and v["version"] > current.version}
                 for h, vs in answers.items()}
        version = max((n for ns in saves.values() for n in ns), default=None)
        if version is not None:
            coord.cluster.call_hosts([h for h, ns in saves.items() if version in ns], "abort",
                                     job=job, version=version)
        return version
