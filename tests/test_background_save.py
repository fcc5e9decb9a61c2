"""Background saves through real daemons: a save returns once the rank's
tensors are copied, stores what they were at that moment, the next save waits
for the last, a failure is reported at the next call and leaves the last
commit current, and two ranks' saves commit once both have put."""

from __future__ import annotations

import threading
import time
from contextlib import closing

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.control.saving import open_save  # noqa: E402
from ptcfs.client.torch.background import BackgroundSaver  # noqa: E402
from ptcfs.client.torch.state import load_rank, to_numpy  # noqa: E402
from ptcfs.errors import SaveFailed  # noqa: E402
from ptcfs.plan.reshard import cut  # noqa: E402
from ptcfs.sharding import owned_tensors, rank_tensors  # noqa: E402
from tests.test_cluster import SMALL, ptcctl  # noqa: E402

pytestmark = pytest.mark.multihost


@pytest.fixture
def job(local_cluster):
    lc = local_cluster(1)
    ptcctl(lc.cluster_file, "job", "create", "b", "--model", SMALL, "--optimizer", "adam",
           "--config", "tp=2", "--hosts", "h0:2", "--seed", "1")
    cluster = Cluster.load(lc.cluster_file)
    try:
        yield cluster, Coordinator(cluster)
    finally:
        cluster.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_save_stores_the_tensors_as_they_were_when_it_returned(job, device):
    """On CUDA the copies run on a side stream: the updates right after the
    save (on the training stream) must not reach them."""
    cluster, co = job
    ranks = [load_rank(cluster, "b", r, device=device) for r in (0, 1)]
    savers = [BackgroundSaver(cluster, r) for r in (0, 1)]
    want: dict[str, np.ndarray] = {}
    for rs in ranks:
        for t in rs.tensors.values():
            t.add_(1.0)
    for step in (3, 4):
        for rs, saver in zip(ranks, savers):
            saver.save(rs.state, step, rs.tensors)
            if rs.rank == 0:
                want = {n: to_numpy(t).copy() for n, t in rs.tensors.items()}
            for t in rs.tensors.values():
                t.add_(1.0)  # training goes on: the save keeps what it copied
    for saver in savers:
        saver.close()
    st = co.state("b")
    assert st.step == 4
    model = st.model_spec()
    for spec, sl in rank_tensors(model, st.config, 0):
        got = cut(spec, sl, co.fetch_tensor(st, spec.name))
        np.testing.assert_array_equal(got, want[spec.name], spec.name)


def test_a_failed_save_is_reported_at_the_next_call_and_changes_nothing(job):
    cluster, co = job
    before = co.state("b")
    rs = load_rank(cluster, "b", 0)
    saver = BackgroundSaver(cluster, 0)
    bad = dict(rs.tensors)
    name = next(iter(bad))
    bad[name] = torch.zeros(3)  # not the sub-tensor's shape: the put fails
    saver.save(rs.state, 9, bad)
    with pytest.raises(SaveFailed, match="stays current"):
        saver.save(rs.state, 10, rs.tensors)
    assert co.state("b").version == before.version
    # the next save after a failure stores as usual
    saver2 = [BackgroundSaver(cluster, r) for r in (0, 1)]
    threads = [threading.Thread(target=s.save, args=(r.state, 11, r.tensors))
               for s, r in zip(saver2, [rs, load_rank(cluster, "b", 1)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in saver2:
        s.close()
    assert co.state("b").step == 11


def test_a_rank_stops_waiting_when_rank_0_fails(job):
    """Rank 0's part fails: it drops the save, and rank 1, waiting for the
    commit, says so at once rather than at its time limit."""
    cluster, co = job
    ranks = [load_rank(cluster, "b", r) for r in (0, 1)]
    bad = dict(ranks[0].tensors)
    name = next(iter(bad))
    bad[name] = torch.zeros(3)  # not the sub-tensor's shape: rank 0's put fails
    before = co.state("b")
    savers = [BackgroundSaver(cluster, 0), BackgroundSaver(cluster, 1, timeout_s=120)]
    savers[1].save(ranks[1].state, 12, ranks[1].tensors)
    deadline = time.monotonic() + 60  # rank 1's part is in the open save before rank 0 starts
    owned = len(owned_tensors(before.model_spec(), before.config, 1))
    while _written(co, "b") < owned:
        assert time.monotonic() < deadline, "rank 1's save did not put its part"
        time.sleep(0.01)
    savers[0].save(ranks[0].state, 12, bad)
    for s, match in zip(savers, ["expected", "its save was dropped"]):
        with pytest.raises(SaveFailed, match=match):
            s.close()
    assert co.state("b").version == before.version


def _written(co: Coordinator, job: str) -> int:
    """Sub-tensors in the job's open save on h0."""
    v = open_save(co, job)
    return 0 if v is None else len(co.cluster.client("h0").call("entries", job=job, version=v))


def test_a_replica_saving_after_the_commit_opens_nothing(local_cluster):
    """Data-parallel rank 1 owns no sub-tensor: rank 0 commits the step
    alone, and rank 1's save of that step, coming after the commit, opens no
    version (one that no commit would end) and returns without error."""
    lc = local_cluster(1)
    ptcctl(lc.cluster_file, "job", "create", "r", "--model", SMALL, "--config", "dp=2",
           "--hosts", "h0:2", "--seed", "1")
    with closing(Cluster.load(lc.cluster_file)) as cluster:
        co = Coordinator(cluster)
        ranks = [load_rank(cluster, "r", r) for r in (0, 1)]
        assert not owned_tensors(ranks[1].state.model_spec(), ranks[1].state.config, 1)
        savers = [BackgroundSaver(cluster, r, timeout_s=60) for r in (0, 1)]
        savers[0].save(ranks[0].state, 5, ranks[0].tensors)
        savers[0].close()
        committed = co.state("r")
        assert committed.step == 5
        savers[1].save(ranks[1].state, 5, ranks[1].tensors)
        savers[1].close()
        assert open_save(co, "r") is None
        assert co.state("r").version == committed.version
        # the next step's save still waits for rank 0: rank 1 joins the version it opens
        savers[1].save(ranks[1].state, 6, ranks[1].tensors)
        savers[0].save(ranks[0].state, 6, ranks[0].tensors)
        for s in savers:
            s.close()
        assert co.state("r").step == 6 and open_save(co, "r") is None
