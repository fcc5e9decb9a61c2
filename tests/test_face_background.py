"""The training face's default save, in the background, on a gang of gloo
ranks: two ranks train an FSDP2 module and save at every step; each save
returns before its step is committed (rank 0's commit waits until every
rank's ``save`` has returned: a save that waited for its commit would never
let it through), every committed step holds what the ranks held when they
saved, a failed save is reported at ``close`` in one line on every rank, and
three ranks then resume the last committed step and save in the background
too."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests.daemons import running  # noqa: E402
from tests.dtensor_gang import gang  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: the steps the two ranks train and save (one save per step)
STEPS = 4
#: how long rank 0's commit waits for every rank's save to return
GATE_S = 30.0


def _crc(a: Any) -> int:
    return zlib.crc32(a.tobytes())


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """The checksum of every tensor of the job, by its name in the job,
    whole (collective, in the same order on every rank)."""
    from ptcfs.client.torch.dtensor_spec import module_parameters

    out: dict[str, int] = {}
    for n, p in module_parameters(model).items():
        out[n] = _crc(p.full_tensor().detach().numpy())
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim/{k}/{n}"] = _crc(st[k].full_tensor().numpy())
    return out


def _gate_commits(out: str, world: int, res: dict[str, Any]) -> None:
    """On rank 0: each commit of a background save first waits until every
    rank has marked that its ``save`` of the step returned, and then, the
    step committed, reads every tensor of it back from the stores."""
    import ptcfs.client.torch.background as bg

    real = bg.commit_step

    def gated(coord: Any, job: str, step: int, *a: Any, **kw: Any) -> Any:
        marks = [Path(out, f"returned-{step}-{r}") for r in range(world)]
        deadline = time.monotonic() + GATE_S
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.005)
        opened = all(m.exists() for m in marks)
        st = real(coord, job, step, *a, **kw)
        res["commits"][str(step)] = {
            "time": time.time(), "gate_opened": opened, "version": st.version,
            "tensors": {t.name: _crc(coord.fetch_tensor(st, t.name))
                        for t in st.model_spec().tensors}}
        return st

    bg.commit_step = gated


def _train_and_save(rank: int, world: int, cf: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import ptcfs.client.torch as ptc
    from tests.dtensor_gang import parallel_llama, train_step

    res: dict[str, Any] = {"saves": {}, "held": {}, "commits": {}}
    if rank == 0:
        _gate_commits(out, world, res)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = parallel_llama(mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job = ptc.attach("bg", model, opt, mesh, cluster=cf, host=f"h{rank}")  # the default saver
    res["created"] = job.attached.created
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
        res["held"][str(step)] = _held(model, opt)
        t0 = time.time()
        job.save(step)
        returned = time.time()
        Path(out, f"returned-{step}-{rank}").touch()
        res["saves"][str(step)] = {"called": t0, "returned": returned, "committed": job.step}
    last = job.wait()  # the last save, committed
    res["waited"] = [last.step, job.step]
    train_step(model, opt, STEPS + 1)
    job.save(1)  # behind the committed step: rank 0's commit refuses it in the background
    try:
        job.close()
        res["failed"] = None
    except ptc.WorkerError as e:
        res["failed"] = str(e)
    res["after_failure"] = job.step
    Path(out, f"run-{rank}.json").write_text(json.dumps(res))


def _resume(rank: int, world: int, cf: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import ptcfs.client.torch as ptc
    from tests.dtensor_gang import parallel_llama, train_step

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = parallel_llama(mesh, seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ptc.attach("bg", model, opt, mesh, cluster=cf, host="h0" if rank < 2 else "h1") as job:
        res: dict[str, Any] = {"attached": [job.attached.reconfigured, job.step, job.describe()],
                               "loaded": _held(model, opt)}
        train_step(model, opt, job.step + 1)
        res["held"] = _held(model, opt)
        job.save(job.step + 1)
    res["closed"] = [job.step, job.state.version]  # the block's end waited for the save
    Path(out, f"resume-{rank}.json").write_text(json.dumps(res))


def test_the_default_save_returns_before_its_commit_and_keeps_every_step(
        tmp_path: Path) -> None:
    with running(tmp_path / "cluster", 2) as lc:
        cf = str(lc.cluster_file)
        gang(_train_and_save, 2, tmp_path, cf, str(tmp_path), timeout_s=120)
        runs = [json.loads((tmp_path / f"run-{r}.json").read_text()) for r in range(2)]
        gang(_resume, 3, tmp_path, cf, str(tmp_path), timeout_s=120)
        resumed = [json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in range(3)]

    commits = runs[0]["commits"]
    assert sorted(int(s) for s in commits) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        c = commits[str(step)]
        # every rank's save returned while its step was not committed yet
        assert c["gate_opened"], f"step {step}: a save did not return before its commit"
        for r, run in enumerate(runs):
            s = run["saves"][str(step)]
            assert s["returned"] < c["time"], (r, step)
            assert s["committed"] == step - 1, (r, step)  # the one before, waited for
        # the committed step holds what the ranks held when they saved it
        assert runs[0]["held"][str(step)] == runs[1]["held"][str(step)]
        assert c["tensors"] == runs[0]["held"][str(step)], f"step {step}"
    assert [commits[str(s)]["version"] for s in range(1, STEPS + 1)] == sorted(
        {commits[str(s)]["version"] for s in range(1, STEPS + 1)})
    for run in runs:
        assert run["created"] is True
        assert run["waited"] == [STEPS, STEPS]
        err = run["failed"]
        assert err is not None and "\n" not in err, err
        assert err.startswith("rank 0: SaveFailed:") and "stays current" in err, err
        # rank 1 fails too where rank 0 dropped the save before rank 1's part was in,
        # and says so (rank 0 says why)
        first, _, then = err.partition("; rank 1: ")
        assert first.endswith("stays current: InvalidRequest: step 1 is before the "
                              f"committed step {STEPS} of job 'bg'"), err
        assert not then or then.endswith("its save was dropped (rank 0's part failed; "
                                         "rank 0 says why)"), err
        assert run["after_failure"] == STEPS

    last = runs[0]["held"][str(STEPS)]
    for r, res in enumerate(resumed):
        assert res["attached"] == [True, STEPS, "tp=1,pp=1,dp=1,fsdp=3 on h0:2,h1:1"], r
        assert res["loaded"] == last, r
        assert res["held"] == resumed[0]["held"] and res["held"] != last
        assert res["closed"][0] == STEPS + 1
    assert len({tuple(res["closed"]) for res in resumed}) == 1
