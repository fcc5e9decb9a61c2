"""The training face (``ptcfs.client.torch``) on real daemons: four gloo workers
attach an FSDP2 + tensor-parallel module to a new job, save, move the job
to another mesh in place, and attach again as a restart would; and one
process without a process group keeps a plain module's state, in the call
(``background=False``) or with saves in the background (the default)."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from ptcfs.server.testing.localcluster import LocalCluster  # noqa: E402
from tests.daemons import running  # noqa: E402
from tests.dtensor_gang import gang  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.filterwarnings("ignore::UserWarning")]


def _whole(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment of a DTensor module, whole
    (collective, in the same order on every rank), and Adam's steps."""
    from ptcfs.client.torch.dtensor_spec import module_parameters

    out: dict[str, torch.Tensor] = {}
    for n, p in module_parameters(model).items():
        out[n] = p.full_tensor()
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}/{n}"] = st[k].full_tensor()
        out[f"step/{n}"] = st["step"].reshape(1).float()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit for bit the same."""
    return sorted(n for n in a.keys() | b.keys()
                  if n not in a or n not in b or not torch.equal(a[n], b[n]))


def _worker(rank: int, world: int, cf: str, tokens: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ptcfs.client.torch as ptc
    from tests.dtensor_gang import parallel_llama, stage_llama, train_step

    host = "h0" if rank < 2 else "h1"
    res: dict[str, object] = {}

    def rows_of(data: object, step: int) -> list[int]:
        import zlib

        mine = [zlib.crc32(r.tobytes()) for r in data.rows(step)]  # type: ignore[attr-defined]
        seen: list = [None] * world
        dist.all_gather_object(seen, mine)
        return sorted({c for s in seen for c in s})

    # a new job from the module's own values, on (dp_shard, tp) = (2, 2)
    mesh_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    a = parallel_llama(mesh_a, seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    job = ptc.attach("face", a, opt_a, mesh_a, cluster=cf, host=host)
    res["attach"] = [job.attached.created, job.attached.reconfigured, job.step,
                     job.describe(), job.rank]
    data = job.data(file=tokens, batch=8, seed=1)
    res["data_ranks"] = [job.data_rank]
    train_step(a, opt_a, 0)
    job.save(1)  # in the background: committed once waited for
    res["saved"] = [job.wait().step, job.state.version]
    rows_a = rows_of(data, 1)

    # the same workers move the job to a 1-D mesh of four FSDP2 ranks, in place
    mesh_b = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    b = parallel_llama(mesh_b, seed=5)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    job.reconfigure(mesh_b, b, opt_b, step=1)
    res["reconfigured"] = [job.step, job.describe(), job.rank]
    res["data_ranks"].append(job.data_rank)  # type: ignore[attr-defined]
    res["moved_wrong"] = _same(_whole(a, opt_a), _whole(b, opt_b))
    res["rows_same"] = rows_of(data, 1) == rows_a
    res["losses_1"] = [train_step(a, opt_a, 1), train_step(b, opt_b, 1)]
    job.save(2)  # b's state: the job is on mesh b now
    job.close()

    # a restart on mesh a: attach reconfigures the job back and loads it
    c = parallel_llama(mesh_a, seed=9)
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    with ptc.attach("face", c, opt_c, mesh_a, cluster=cf, host=host) as again:
        res["again"] = [again.attached.created, again.attached.reconfigured, again.step,
                        again.describe(), again.attached.bytes_loaded > 0]
        res["loaded_wrong"] = _same(_whole(b, opt_b), _whole(c, opt_c))
        res["losses_2"] = [train_step(b, opt_b, 2), train_step(c, opt_c, 2)]
        res["position"] = again.position()  # no dataset ingested

    # another model is refused on every worker, in one line
    other = stage_llama(mesh_a, 0, 3, [0, 1, 2], True, True)
    try:
        ptc.attach("face", other, torch.optim.AdamW(other.parameters()), mesh_a, cluster=cf,
                   host=host)
        res["refused"] = "accepted"
    except ptc.WorkerError as e:
        res["refused"] = str(e)
    Path(out, f"{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_attach_save_reconfigure_and_restart_keep_the_state(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(64 * 9, dtype=np.int32).reshape(64, 9) % 126)
    with running(tmp_path / "cluster", 2) as lc:
        gang(_worker, 4, tmp_path, str(lc.cluster_file), str(tokens), str(tmp_path))
    for r in range(4):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        assert res["attach"] == [True, False, 0, "tp=2,pp=1,dp=1,fsdp=2 on h0:2,h1:2", r]
        assert res["data_ranks"] == [r // 2, r]
        assert res["saved"][0] == 1
        assert res["reconfigured"] == [1, "tp=1,pp=1,dp=1,fsdp=4 on h0:2,h1:2", r]
        assert res["moved_wrong"] == [] and res["loaded_wrong"] == []
        assert res["rows_same"]
        for a, b in (res["losses_1"], res["losses_2"]):
            assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(a)
        assert res["again"] == [False, True, 2, "tp=2,pp=1,dp=1,fsdp=2 on h0:2,h1:2", True]
        assert res["position"] is None
        assert "another model" in res["refused"] and "\n" not in res["refused"]


def test_one_process_without_a_process_group_keeps_a_plain_module(tmp_path: Path) -> None:
    import ptcfs.client.torch as ptc

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss)

    with running(tmp_path / "cluster", 2) as lc:
        torch.manual_seed(0)
        a = model()
        opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
        with ptc.attach("solo", a, opt_a, cluster=lc.cluster_file, background=False) as job:
            assert job.attached.created and job.describe() == "tp=1,pp=1,dp=1 on h0:1"
            step(a, opt_a)
            job.save(1)  # in the call: committed when it returns
            assert job.step == 1
        b = model()
        opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
        with ptc.attach("solo", b, opt_b, cluster=lc.cluster_file, background=False) as job:
            assert not job.attached.created and not job.attached.reconfigured
            assert job.step == 1
            assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
            assert step(a, opt_a) == step(b, opt_b)
            with pytest.raises(ptc.WorkerError, match="step 0 is before the committed step 1"):
                job.save(0)


@contextmanager
def _stopped(lc: LocalCluster) -> Iterator[None]:
    """Every daemon of ``lc`` stopped (SIGSTOP) while the block runs: no
    request is answered, no commit can land."""
    procs = list(lc.procs.values())
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)


def test_a_background_save_returns_before_its_commit_and_the_next_call_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ptcfs.client.torch as ptc

    # the background save waits for the stopped daemons instead of giving them up
    monkeypatch.setenv("PTC_PING_TIMEOUT_S", "120")

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def values() -> list[torch.Tensor]:
        return [p.detach().clone() for p in m.parameters()]

    with running(tmp_path / "cluster", 2) as lc:
        job = ptc.attach("bg", m, opt, cluster=lc.cluster_file)  # saves in the background
        step()
        job.save(1)
        assert job.wait().step == 1  # nothing in flight when the daemons stop
        with _stopped(lc):  # the daemons answer nothing: the save only copies
            step()
            job.save(2)
            assert job.step == 1  # step 1 is committed, step 2 not
        step()  # training goes on; the save keeps what it copied
        job.save(3)  # waits for step 2 first
        assert job.step == 2
        at_3 = values()
        step()
        job.save(1)  # waits for step 3, then fails in the background: 1 is behind 3
        assert job.step == 3
        with pytest.raises(ptc.WorkerError, match="step 1 is before the committed step 3") as e:
            job.close()  # reported at the next call
        assert "\n" not in str(e.value) and "stays current" in str(e.value)
        assert job.step == 3
        torch.manual_seed(1)
        other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        with ptc.attach("bg", other, torch.optim.Adam(other.parameters()),
                        cluster=lc.cluster_file) as again:
            assert again.step == 3
            assert all(torch.equal(a, b) for a, b in zip(at_3, other.parameters()))


def test_a_cpu_save_copies_until_the_optimizers_next_step(tmp_path: Path) -> None:
    """``save`` returns before a CPU rank's tensors are copied; the
    optimizer's next step waits in a hook until they are, so the step right
    after the save does not reach what is stored."""
    import ptcfs.client.torch as ptc
    from ptcfs.client.torch.stephooks import waiting

    torch.manual_seed(0)
    m = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()

    with running(tmp_path / "cluster", 1) as lc:
        with ptc.attach("late", m, opt, cluster=lc.cluster_file) as job:
            step()
            saved = {n: p.detach().clone() for n, p in m.named_parameters()}
            moments = [opt.state[p]["exp_avg"].clone() for p in m.parameters()]
            job.save(1)
            assert waiting(opt) == 1 and len(opt._optimizer_step_pre_hooks) == 1  # the wait
            step()  # at once: it waits for the copy, then changes every tensor
            assert waiting(opt) == 0  # its hook stays, for the next save's wait
            assert job.wait().step == 1
        torch.manual_seed(1)
        other = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))
        opt_o = torch.optim.Adam(other.parameters(), lr=1e-2)
        with ptc.attach("late", other, opt_o, cluster=lc.cluster_file) as again:
            assert again.step == 1
            assert all(torch.equal(saved[n], p) for n, p in other.named_parameters())
            assert all(torch.equal(a, opt_o.state[p]["exp_avg"])
                       for a, p in zip(moments, other.parameters()))


@pytest.mark.parametrize("module", ["ptcfs.client.formats.common", "ptcfs.client.torch.state",
                                    "ptcfs.client.cli"])
def test_the_lower_modules_import_first_without_the_face(module: str) -> None:
    """A checkpoint format or the command line that imports the package's
    lower modules first neither pulls the face in nor meets a cycle through it."""
    import subprocess
    import sys

    code = (f"import sys, {module}; "
            "assert 'ptcfs.client.torch.job' not in sys.modules, 'the face was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
