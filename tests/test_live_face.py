"""The training face's live mover on real daemons: four gloo workers move
a job to another mesh in place device to device (``LiveMover``), and the
result is the store mover's bit for bit, each rank received the plan's
bytes, the durable copy begins only after the first step on the new mesh,
and the stores then hold the new version (a fresh attach resumes it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests.daemons import running  # noqa: E402
from tests.dtensor_gang import gang  # noqa: E402
from tests.test_client_face import _same, _whole  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.filterwarnings("ignore::UserWarning")]


def _worker(rank: int, world: int, cf: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import ptcfs.client.torch as ptc
    from ptcfs.client.live import LiveMover
    from tests.dtensor_gang import parallel_llama, train_step

    host = "h0" if rank < 2 else "h1"
    res: dict[str, object] = {}
    mesh_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    a = parallel_llama(mesh_a, seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train_step(a, opt_a, 0)  # Adam moments that are not zeros
    live = LiveMover()
    by_store = ptc.attach("stored", a, opt_a, mesh_a, cluster=cf, host=host)
    by_live = ptc.attach("live", a, opt_a, mesh_a, cluster=cf, host=host, mover=live)
    res["created"] = [by_store.attached.created, by_live.attached.created]
    res["version_a"] = by_live.state.version

    # the same workers, the same state, to a 1-D mesh of four FSDP2 ranks:
    # one job through the stores, the other device to device
    mesh_b = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    bs = parallel_llama(mesh_b, seed=5)
    opt_bs = torch.optim.AdamW(bs.parameters(), lr=1e-2)
    by_store.reconfigure(mesh_b, bs, opt_bs, step=1)
    bl = parallel_llama(mesh_b, seed=7)
    opt_bl = torch.optim.AdamW(bl.parameters(), lr=1e-2)
    by_live.reconfigure(mesh_b, bl, opt_bl, step=1)
    res["store"] = [by_store.step, by_store.describe(), by_store.rank]
    assert live.last is not None
    res["bytes"] = [live.last.bytes_received, live.last.bytes_planned_in,
                    live.last.bytes_kept, live.last.bytes_sent]
    whole_l = {n: t.clone() for n, t in _whole(bl, opt_bl).items()}  # bl trains on below
    res["live_vs_store"] = _same(_whole(bs, opt_bs), whole_l)
    res["live_vs_old"] = _same(_whole(a, opt_a), whole_l)
    # the durable copy waits for the first step on the new mesh, then runs behind it
    commit = live.commit
    assert commit is not None
    res["before_step"] = [commit.started, by_live.state.version]
    train_step(bl, opt_bl, 1)
    res["after_step"] = commit.started
    res["live"] = [by_live.step, by_live.describe(), by_live.rank, by_live.wait().version]
    res["timings"] = sorted(commit.timings, key=commit.timings.__getitem__)
    t = commit.timings  # seconds from the move's end to the commit's start, and the commit's
    res["commit_s"] = [t["began"] - t["moved"], t["committed"] - t["began"]] if rank == 0 else []
    by_store.close()
    by_live.close()

    # a restart on mesh b: the stores hold the live job's new version
    c = parallel_llama(mesh_b, seed=9)
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    with ptc.attach("live", c, opt_c, mesh_b, cluster=cf, host=host) as again:
        res["again"] = [again.attached.created, again.attached.reconfigured, again.step,
                        again.state.version, again.attached.bytes_loaded > 0]
        res["resumed_wrong"] = _same(whole_l, _whole(c, opt_c))
    Path(out, f"{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_a_live_reconfigure_moves_device_to_device_and_commits(tmp_path: Path) -> None:
    with running(tmp_path / "cluster", 2) as lc:
        gang(_worker, 4, tmp_path, str(lc.cluster_file), str(tmp_path))
    received = 0
    for r in range(4):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        assert res["created"] == [True, True]
        mesh_b = "tp=1,pp=1,dp=1,fsdp=4 on h0:2,h1:2"
        assert res["store"] == [1, mesh_b, r]
        assert res["live"][:3] == [1, mesh_b, r]
        got, planned, kept, sent = res["bytes"]
        assert got == planned and kept > 0 and sent > 0, res["bytes"]
        received += got
        assert res["live_vs_store"] == [] and res["live_vs_old"] == []
        assert res["again"] == [False, False, 1, res["live"][3], True]
        # the commit had not begun when reconfigure returned (the job still on the
        # version saved before the move); every rank began it after the first step
        # (rank 0 reconfigures the committed version on the daemons)
        assert res["before_step"] == [False, res["version_a"] + 1], res
        assert res["live"][3] > res["before_step"][1]
        assert res["after_step"] is True
        assert res["timings"] == ["moved", "began", "committed"]
        assert res["resumed_wrong"] == []
    assert received > 0
