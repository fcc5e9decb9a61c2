"""Saving a job's state through the daemons and committing it as a step."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.saving import SAVE_MARK, begin_save, commit_step
from ptcfs.errors import IncompleteSave, JobBusy, TensorNotFound, VersionImmutable
from ptcfs.plan.reshard import cut
from ptcfs.sharding import host_ranks, rank_tensors
from tests.daemons import paused
from tests.test_cluster import SMALL, checksums, ptcctl

pytestmark = pytest.mark.multihost


def new_values(spec, step: int) -> np.ndarray:
    """A deterministic 'trained' value of a tensor at ``step``."""
    n = int(np.prod(spec.shape))
    from ptcfs.dtypes import numpy_dtype

    return (np.arange(n, dtype=np.float64) % 97 * 0.01 + step).reshape(spec.shape).astype(
        numpy_dtype(spec.dtype))


def save_ranks(co: Coordinator, job: str, step: int, skip: str | None = None) -> int:
    """Every rank puts its sub-tensors into the open version on its own host."""
    state = co.state(job)
    version = begin_save(co, job)
    model = state.model_spec()
    for host, ranks in host_ranks(state.config).items():
        for rank in ranks:
            for spec, sl in rank_tensors(model, state.config, rank):
                if spec.name == skip:
                    continue
                co.cluster.client(host).put(job, version, spec.name, sl.key(),
                                            cut(spec, sl, new_values(spec, step)), spec.dtype)
    return version


def test_saved_ranks_commit_as_a_step_with_replicas(local_cluster):
    lc = local_cluster(3, replicas=2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--optimizer", "adam",
           "--config", "tp=2,dp=2", "--hosts", "h0:2,h1:2", "--seed", "1")
    co = Coordinator(Cluster.load(cf))
    try:
        version = save_ranks(co, "j", step=10)
        assert begin_save(co, "j") == version  # idempotent while open
        out = json.loads(ptcctl(cf, "commit", "j", "--step", "10", "--json").stdout)
        assert out == {"job": "j", "version": version, "step": 10,
                       "config": "tp=2,pp=1,dp=2 on h0:2,h1:2"}
        state = co.state("j")
        assert (state.version, state.step) == (version, 10)
        for spec in state.model_spec().tensors_for(1):
            want = new_values(spec, 10)
            got = co.fetch_tensor(state, spec.name)
            np.testing.assert_array_equal(got, want[tuple(slice(0, n) for n in got.shape)])
        v = json.loads(ptcctl(cf, "verify", "j", "--json").stdout)
        assert v["ok"], v["problems"]
        # a reconfiguration keeps the saved bytes and the step
        before = checksums(cf, "j")
        ptcctl(cf, "reconfigure", "j", "--to", "tp=1,dp=3", "--hosts", "h0:1,h1:1,h2:1")
        assert checksums(cf, "j") == before and co.state("j").step == 10
    finally:
        co.cluster.close()


def test_a_partial_save_never_becomes_current(local_cluster):
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "2")
    co = Coordinator(Cluster.load(cf))
    try:
        before = checksums(cf, "j")
        r = ptcctl(cf, "commit", "j", "--step", "5", check=False)
        assert r.returncode != 0 and "nothing was saved" in r.stderr
        assert "Traceback" not in r.stderr
        save_ranks(co, "j", step=5, skip="encoder.final_layernorm.weight")
        with pytest.raises(IncompleteSave, match="encoder.final_layernorm.weight"):
            commit_step(co, "j", 5)
        assert co.state("j").version == 1 and checksums(cf, "j") == before
        # the missing tensor arrives later: now the commit goes through
        state = co.state("j")
        version = begin_save(co, "j")
        spec = next(s for s in state.model_spec().tensors
                    if s.name == "encoder.final_layernorm.weight")
        co.cluster.client("h1").put("j", version, spec.name, "full", new_values(spec, 5),
                                    spec.dtype)
        assert commit_step(co, "j", 5).step == 5
        r = ptcctl(cf, "commit", "j", "--step", "-1", check=False)
        assert r.returncode == 2 and "--step: -1 is below 0" in r.stderr
    finally:
        co.cluster.close()


def save_put(c, version: int, spec, step: int) -> None:
    """A save's put of a whole tensor into job ``j``, as the mount sends it."""
    arr = new_values(spec, step)
    c.peer.call("put", frames=[arr.tobytes()], job="j", version=version, tensor=spec.name,
                part="full", shape=list(arr.shape), dtype=spec.dtype, saving=True)


def test_a_stale_save_put_never_lands_in_a_reconfiguration(local_cluster):
    """A writer (the mount) got its save's version from ``open_save``; then a
    reconfiguration dropped that save and staged the same version number for
    itself. The writer's put is refused (the job is busy: write again), and
    the reconfiguration commits the job's bytes unchanged (it used to take
    the writer's, and commit them as the old step)."""
    lc = local_cluster(2, keys=False)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "3")
    before = checksums(cf, "j")
    co = Coordinator(Cluster.load(cf))
    c = co.cluster.client("h0")
    try:
        version = int(c.call("open_save", job="j")["version"])
        spec = next(s for s in co.state("j").model_spec().tensors
                    if s.name == "encoder.final_layernorm.weight")
        with paused(cf, "told", "reconfigure", "j", "--to", "tp=1", "--hosts", "h0:1"):
            # the reconfiguration's new version is the number the writer holds (staging,
            # or committed already by h0's reconcile loop from the decision it was told)
            states = {v["version"]: v["state"] for v in c.call("versions", job="j")}
            assert states.get(version) in ("staging", "committed"), states
            # refused: the job is busy while the version stages; once told, a host may
            # commit it from the decision on its own (its reconcile loop), and then the
            # version is committed, which no put changes either
            with pytest.raises((JobBusy, VersionImmutable)) as refused:
                save_put(c, version, spec, 9)
            assert isinstance(refused.value, VersionImmutable) or \
                "no longer open for saving" in str(refused.value)
        deadline = time.monotonic() + 30  # told: every host commits it by itself
        while co.state("j").version != version:
            assert time.monotonic() < deadline, "the told version was not committed"
            time.sleep(0.1)
        assert checksums(cf, "j") == before
    finally:
        co.cluster.close()


def test_a_reconfiguration_that_begins_a_save_s_version_drops_its_writes(local_cluster):
    """``begin_at`` of a version that is open for saving, for something else
    (a reconfiguration that lost a race with ``open_save``), drops what the
    save wrote there; the other way round it is refused."""
    lc = local_cluster(1)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "4")
    co = Coordinator(Cluster.load(cf))
    c = co.cluster.client("h0")
    try:
        state = co.state("j")
        version = int(c.call("open_save", job="j")["version"])
        spec = state.model_spec().tensors[0]
        save_put(c, version, spec, 9)
        assert [e["tensor"] for e in c.call("entries", job="j", version=version)] == [spec.name]
        meta = state.with_(version=version).to_meta()
        c.call("begin_at", job="j", version=version, meta=meta)
        assert c.call("entries", job="j", version=version) == []
        # and a save never takes over a version staged for something else
        with pytest.raises(JobBusy, match="being staged by a reconfiguration"):
            c.call("begin_at", job="j", version=version, meta={**meta, SAVE_MARK: True})
    finally:
        co.cluster.close()


def test_a_save_left_on_a_host_that_was_down_is_not_rolled_forward(local_cluster):
    """A host killed with a save open misses a reconfiguration that takes
    the save's version number without it. When it is back, reading the job's
    state rolls forward hosts that missed the commit: its save is dropped,
    not committed as the reconfiguration's version (which it used to be,
    with the save's bytes under the reconfiguration's record). Left out of
    that version, it gets its record and holds none of its bytes."""
    lc = local_cluster(3, keys=False)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "6")
    co = Coordinator(Cluster.load(cf))
    try:
        spec = next(s for s in co.state("j").model_spec().tensors
                    if s.name == "encoder.final_layernorm.weight")
        before = co.fetch_tensor(co.state("j"), spec.name)
        c0 = co.cluster.client("h0")
        version = int(c0.call("open_save", job="j")["version"])
        save_put(c0, version, spec, 9)  # rank 0's replicated tensor, into h0's save
        lc.kill("h0", signal.SIGKILL)
        ptcctl(cf, "reconfigure", "j", "--to", "tp=1,pp=2", "--hosts", "h1:1,h2:1")
        lc.start("h0")
        state = co.state("j")  # rolls forward the hosts that missed the commit
        assert state.version == version
        listed = {v["version"]: v["state"] for v in c0.call("versions", job="j")}
        assert listed.get(version) == "committed" and "h0" not in state.ring
        with pytest.raises(TensorNotFound):  # not the save's bytes: none at all
            c0.read_box("j", version, spec.name, "full", ((0, spec.shape[0]),))
        np.testing.assert_array_equal(co.fetch_tensor(state, spec.name), before)
    finally:
        co.cluster.close()


def tp2_job(lc, seed: int) -> tuple[Path, Coordinator]:
    """Job ``j`` at tp=2 on h0 and h1 of ``lc``, and a coordinator of it."""
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", str(seed))
    return cf, Coordinator(Cluster.load(cf))


def holds_step(co: Coordinator, cf: Path, state, step: int) -> None:
    """Every copy of the job's current version agrees (``verify``), and each
    tensor is what the ranks saved at ``step``."""
    v = json.loads(ptcctl(cf, "verify", "j", "--json", check=False).stdout)
    assert v["ok"], v["problems"]
    for spec in state.model_spec().tensors_for(state.config.pp):
        np.testing.assert_array_equal(co.fetch_tensor(state, spec.name), new_values(spec, step))


def test_a_retried_commit_never_keeps_copies_of_an_earlier_attempt(local_cluster):
    """A commit copies each saved sub-tensor to the replicas that must hold
    it, then fails (here: killed after the copies). The ranks save again,
    at a later step, into the same open version, and the commit goes
    through: every copy holds the later step, not the first attempt's bytes
    (the copies used to count as written, and stayed)."""
    lc = local_cluster(3, keys=False, replicas=2)
    cf, co = tp2_job(lc, 7)
    try:
        version = save_ranks(co, "j", step=5)
        with paused(cf, "staged", "commit", "j", "--step", "5"):
            pass  # killed once it has copied to the replicas
        assert save_ranks(co, "j", step=6) == version  # the same open version
        ptcctl(cf, "commit", "j", "--step", "6")
        state = co.state("j")
        assert (state.version, state.step) == (version, 6)
        holds_step(co, cf, state, 6)
    finally:
        co.cluster.close()


def test_a_save_begun_under_an_older_configuration_is_dropped(local_cluster):
    """A host down while a reconfiguration commits keeps the save that was
    open there (under a number the reconfiguration did not take: a dead
    coordinator's leftover version had it). That save holds the old
    layout's bytes: the next save drops it and opens a new version, and
    nothing of it is committed under the new layout."""
    lc = local_cluster(3, keys=False, replicas=2)
    cf, co = tp2_job(lc, 8)
    try:
        state = co.state("j")
        # a reconfiguration's coordinator died, its version 2 left staging on h2
        co.cluster.client("h2").call("begin_at", job="j", version=2,
                                     meta=state.with_(version=2).to_meta())
        old = save_ranks(co, "j", step=5)
        assert old == 3
        lc.kill("h2", signal.SIGKILL)
        ptcctl(cf, "reconfigure", "j", "--to", "tp=1", "--hosts", "h0:1")
        lc.start("h2")
        assert co.state("j").version == 2
        new = save_ranks(co, "j", step=6)
        assert new > old
        assert all(v["version"] != old for vs in co.host_versions("j")[0].values() for v in vs)
        ptcctl(cf, "commit", "j", "--step", "6")
        state = co.state("j")
        assert (state.version, state.step, state.config.tp) == (new, 6, 1)
        holds_step(co, cf, state, 6)
    finally:
        co.cluster.close()


def test_a_save_open_on_some_hosts_is_begun_where_a_writer_asks(local_cluster):
    """An ``open_save`` half way (its version begun on h0, not yet on h1)
    is found by a second one on h1, which answers that version: h1 begins it
    too before answering, so a writer there puts into it (the answer used to
    name a version h1 did not have: VersionNotFound, and the save failed)."""
    lc = local_cluster(2, keys=False)
    cf, co = tp2_job(lc, 4)
    try:
        state = co.state("j")
        new = state.version + 1
        co.cluster.client("h0").call("begin_at", job="j", version=new,
                                     meta={**state.with_(version=new).to_meta(), SAVE_MARK: True})
        c1 = co.cluster.client("h1")
        assert c1.call("open_save", job="j") == {"version": new, "opened": False,
                                                  "committed": False}
        assert (new, "staging") in [(v["version"], v["state"])
                                    for v in c1.call("versions", job="j")]
        spec = next(s for s in state.model_spec().tensors
                    if s.name == "encoder.final_layernorm.weight")
        save_put(c1, new, spec, 3)
    finally:
        co.cluster.close()


def staging(co: Coordinator) -> dict[str, list[int]]:
    """Each answering host's staging versions of job ``j``."""
    answers, _ = co.cluster.call_all("versions", job="j")
    return {h: [v["version"] for v in vs if v["state"] == "staging"]
            for h, vs in answers.items()}


def test_a_save_that_will_not_be_committed_is_discarded_and_the_repair_runs(local_cluster):
    """A save whose writers are gone keeps a repair waiting: ``repair``
    says so in one line and names ``ptcctl discard``, which drops it on every
    host (the current version untouched); the repair then runs."""
    lc = local_cluster(4, keys=False)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2,dp=2",
           "--hosts", "h0:1,h1:1,h2:1,h3:1", "--seed", "5")
    before = checksums(cf, "j")
    co = Coordinator(Cluster.load(cf))
    try:
        version = save_ranks(co, "j", step=3, skip="encoder.final_layernorm.weight")
        lc.kill("h1", signal.SIGKILL)
        r = ptcctl(cf, "repair", "j", "--wait", check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"version {version} of 'j' is a save open on" in r.stderr
        assert "ptcctl discard j" in r.stderr
        out = json.loads(ptcctl(cf, "discard", "j", "--json").stdout)
        assert out == {"job": "j", "discarded": version}
        assert staging(co) == {"h0": [], "h2": [], "h3": []}
        assert co.state("j").version == 1 and checksums(cf, "j") == before
        rep = json.loads(ptcctl(cf, "repair", "j", "--wait", "--json").stdout)
        assert rep["state"] == "done" and rep["lost"] == ["h1"]
        assert ptcctl(cf, "verify", "j").returncode == 0
        assert checksums(cf, "j") == before
        # h1 comes back with its copy of the dropped save: nothing to drop
        lc.start("h1")
        co.cluster.down.clear()
        assert ptcctl(cf, "discard", "j").stdout.strip() == "j: no save is open"
        assert co.state("j").version == rep["new_version"]
    finally:
        co.cluster.close()


def test_discard_commits_a_save_whose_commit_was_decided(local_cluster, monkeypatch):
    """A commit that told every host its decision and died before any
    host committed is rolled forward by ``discard``, not dropped: the step
    is committed, as every reader of the decision already takes it to be
    (without a registry the decision is recorded on the hosts)."""
    monkeypatch.setenv("PTC_LOCK_TTL_S", "2")
    lc = local_cluster(2, keys=False)
    cf, co = tp2_job(lc, 6)
    try:
        version = save_ranks(co, "j", step=10)
        with paused(cf, "told", "commit", "j", "--step", "10"):
            pass
        out = json.loads(ptcctl(cf, "discard", "j", "--json").stdout)
        assert out == {"job": "j", "discarded": None}
        state = co.state("j")
        assert (state.version, state.step) == (version, 10)
        assert staging(co) == {"h0": [], "h1": []}
    finally:
        co.cluster.close()
