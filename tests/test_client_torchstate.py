"""The training-side client on real daemons: load a rank's state into torch,
hand it to a module and Adam, save it back, and migrate it in place."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ptcfs.boxes import box_subtract  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.control.saving import begin_save, commit_step  # noqa: E402
from ptcfs.client.torch.migrate import migrate  # noqa: E402
from ptcfs.client.torch.module import load_into, module_for, state_of  # noqa: E402
from ptcfs.client.torch.state import load_rank, put_rank, to_numpy  # noqa: E402
from ptcfs.errors import InvalidRequest  # noqa: E402
from ptcfs.plan.reshard import cut  # noqa: E402
from ptcfs.sharding import parse_config  # noqa: E402
from ptcfs.types import box_volume  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import SMALL, ptcctl  # noqa: E402

pytestmark = pytest.mark.multihost


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("client"), 2) as (cf, co):
        yield cf, co.cluster


def create(cf, job: str, config: str, hosts: str, dtype: str = "fp32") -> None:
    ptcctl(cf, "job", "create", job, "--model", SMALL, "--optimizer", "adam", "--dtype", dtype,
           "--config", config, "--hosts", hosts, "--seed", "3")


def expected(co: Coordinator, job: str, rank: int) -> dict[str, np.ndarray]:
    """Each sub-tensor of ``rank``, cut from the logical tensors ptcctl reads."""
    st = co.state(job)
    from ptcfs.sharding import rank_tensors

    return {spec.name: cut(spec, sl, co.fetch_tensor(st, spec.name))
            for spec, sl in rank_tensors(st.model_spec(), st.config, rank)}


def same(t, want: np.ndarray) -> bool:
    return to_numpy(t).tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("dtype, local", [("fp16", True), ("bf16", True), ("fp16", False)])
def test_load_rank_gives_every_sub_tensor_bit_for_bit(cluster, dtype, local, monkeypatch):
    """From the host's store directly (it is on this machine) and through its daemon."""
    from ptcfs.client.torch import localread

    monkeypatch.setenv("PTC_CLIENT_LOCAL_STORE", str(int(local)))
    cf, c = cluster
    job = f"load-{dtype}-{int(local)}"
    create(cf, job, "tp=2,dp=2", "h0:2,h1:2", dtype)
    co = Coordinator(c)
    src = localread.source_for(c, "h1")
    assert isinstance(src, localread.LocalStore) == local
    for rank in (0, 3):
        rs = load_rank(c, job, rank, device="cpu")
        want = expected(co, job, rank)
        assert set(rs.tensors) == set(want)
        assert all(same(rs.tensors[n], want[n]) for n in want)
        assert rs.tensors["embedding.word_embeddings.weight"].shape == (512, 128)  # padded
        assert rs.step == 0 and rs.nbytes == sum(a.nbytes for a in want.values())
    with pytest.raises(InvalidRequest, match="rank 4 is not a rank"):
        load_rank(c, job, 4)


def test_module_and_adam_round_trip_through_a_save(cluster):
    cf, c = cluster
    create(cf, "train", "tp=2", "h0:1,h1:1")
    co = Coordinator(c)
    st = co.state("train")
    modules, opts = [], []
    for rank in range(2):
        rs = load_rank(c, "train", rank, device="cpu")
        m = module_for(st, rank)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        load_into(rs, m, opt)
        got = state_of(m, opt, st, rank)
        # no copies: the module's parameters and the optimizer's moments are the loaded tensors
        assert all(got[n].data_ptr() == rs.tensors[n].data_ptr() for n in rs.tensors)
        loss = sum((p.float() ** 2).sum() for p in m.parameters())
        loss.backward()
        opt.step()
        modules.append(m)
        opts.append(opt)
    version = begin_save(co, "train")
    for rank in range(2):
        put_rank(c, st, version, rank, state_of(modules[rank], opts[rank], st, rank))
    commit_step(co, "train", 1)
    for rank in range(2):
        rs = load_rank(c, "train", rank, device="cpu")
        assert rs.step == 1
        now = state_of(modules[rank], opts[rank], st, rank)
        # bit for bit (the random moments of `job create` make some values NaN)
        assert all(same(rs.tensors[n], to_numpy(now[n])) for n in now)
        m2 = module_for(rs.state, rank)
        opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
        load_into(rs, m2, opt2)
        assert all(float(s["step"]) == 1.0 for s in opt2.state.values())
    with pytest.raises(InvalidRequest, match="expected"):
        bad = state_of(modules[0], opts[0], st, 0)
        bad["encoder.final_layernorm.weight"] = torch.zeros(3)
        put_rank(c, st, begin_save(co, "train"), 0, bad)


def test_box_subtract_covers_exactly_the_rest():
    box = ((0, 10), (0, 4))
    cuts = [((2, 5), (0, 4)), ((4, 8), (1, 3)), ((20, 30), (0, 4))]
    rest = box_subtract(box, cuts)
    cover = np.zeros((10, 4), int)
    for b in rest:
        cover[b[0][0]:b[0][1], b[1][0]:b[1][1]] += 1
    for b in cuts:
        cover[max(b[0][0], 0):min(b[0][1], 10), b[1][0]:b[1][1]] += 1
    assert cover.min() >= 1 and sum(box_volume(b) for b in rest) == 40 - 12 - 8 + 2


@pytest.mark.parametrize(("old", "old_hosts", "new", "new_hosts", "kept_min"), [
    ("tp=2", "h0:2", "tp=4", "h0:2,h1:2", 0.45),    # each new rank keeps half its slice
    ("tp=2,dp=2", "h0:2,h1:2", "tp=1,dp=4", "h0:2,h1:2", 0.45),
    ("tp=2,dp=1", "h0:2", "tp=2,dp=2", "h1:2,h0:2", 1.0),     # same slices: nothing fetched
    ("fsdp=4", "h0:2,h1:2", "tp=2,fsdp=2", "h0:2,h1:2", 0.2),  # FSDP2 chunks of TP halves
    ("tp=2,dp=2", "h0:2,h1:2", "tp=2,dp=2,zero=1", "h0:2,h1:2", 1.0),  # ZeRO-1 keeps a part
])
def test_migrate_keeps_what_stays_and_fetches_the_rest(cluster, old, old_hosts, new, new_hosts,
                                                       kept_min):
    cf, c = cluster
    job = f"mig-{old}-{new}".replace("=", "").replace(",", "")
    create(cf, job, old, old_hosts)
    co = Coordinator(c)
    before = co.state(job)
    held = {r: load_rank(c, job, r, device="cpu") for r in range(before.config.world)}
    new_cfg = parse_config(new, new_hosts)
    co.reconfigure(job, new_cfg)
    after = co.state(job)
    kept = fetched = 0
    for rank in range(new_cfg.world):
        # the worker that runs new rank `rank` held old rank `rank % old world`
        old_rank = rank % before.config.world
        rs, stats = migrate(c, held[old_rank], rank)
        want = load_rank(c, job, rank, device="cpu")
        assert set(rs.tensors) == set(want.tensors)
        for n, t in want.tensors.items():
            assert torch.equal(rs.tensors[n], t), n
        kept += stats.bytes_kept
        fetched += stats.bytes_fetched
        assert stats.bytes_kept + stats.bytes_fetched + stats.bytes_zero == want.nbytes
    assert kept / (kept + fetched) >= kept_min
    assert (fetched == 0) == (kept_min == 1.0)
    assert after.version == before.version + 1


def test_loads_and_migrations_pause_the_collector(cluster):
    """No pass of the cyclic collector runs during a load or a migration
    (none with their modules' code on the stack, in any thread), even
    where one would run every few dozen allocations; the collector is left
    as the caller had it, enabled or not."""
    import gc
    import sys

    from ptcfs.client.torch import migrate as migrate_module
    from ptcfs.client.torch import state as torchstate

    ours = {torchstate.__file__, migrate_module.__file__}
    cf, c = cluster
    create(cf, "gc", "tp=2", "h0:2")
    held = load_rank(c, "gc", 0, device="cpu")
    Coordinator(c).reconfigure("gc", parse_config("tp=2,dp=2", "h0:2,h1:2"))
    during: list[str] = []  # the functions of ours on the stack at each pass
    passes = [0]

    def count(phase: str, info: dict) -> None:
        if phase != "start":
            return
        passes[0] += 1
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_filename in ours:
                during.append(f.f_code.co_name)
                return
            f = f.f_back

    threshold = gc.get_threshold()
    was = gc.isenabled()
    gc.callbacks.append(count)
    gc.set_threshold(50, 1, 1)  # a pass every 50 allocations, when enabled
    left = []
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            rs = load_rank(c, "gc", 3, device="cpu")
            moved, _ = migrate(c, held, 2)
            left.append(gc.isenabled())
            assert rs.nbytes and moved.nbytes
        before = passes[0]
        gc.collect()  # the hook sees passes
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
        (gc.enable if was else gc.disable)()
    assert passes[0] == before + 1
    assert during == []
    assert left == [True, False]


def test_migrate_refuses_tensors_older_than_the_job(cluster):
    cf, c = cluster
    create(cf, "stale", "tp=2", "h0:2")
    held = load_rank(c, "stale", 0, device="cpu")
    co = Coordinator(c)
    st = co.state("stale")
    version = begin_save(co, "stale")
    for rank in range(2):
        put_rank(c, st, version, rank, load_rank(c, "stale", rank, device="cpu").tensors)
    commit_step(co, "stale", 5)
    with pytest.raises(InvalidRequest, match="save and commit"):
        migrate(c, held, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, local", [("bf16", True), ("fp16", False)])
def test_loads_to_cuda_stream_in_pieces_bit_for_bit(cluster, dtype, local, monkeypatch):
    """Pieces of 4 KiB through three readers' pinned buffers, straight from
    the store and through the daemon: the bytes a load to the CPU gives."""
    cf, c = cluster
    job = f"cuda-{dtype}-{int(local)}"
    create(cf, job, "tp=2,dp=2", "h0:2,h1:2", dtype)
    monkeypatch.setenv("PTC_CLIENT_LOCAL_STORE", str(int(local)))
    cpu = load_rank(c, job, 3, device="cpu")
    monkeypatch.setenv("PTC_CLIENT_STAGING_BYTES", "12K")
    monkeypatch.setenv("PTC_CLIENT_READ_THREADS", "3")
    rs = load_rank(c, job, 3, device="cuda:0")
    assert {t.device.type for t in rs.tensors.values()} == {"cuda"}
    assert set(rs.tensors) == set(cpu.tensors)
    assert all(torch.equal(rs.tensors[n].cpu().view(torch.uint8), t.view(torch.uint8))
               for n, t in cpu.tensors.items())


@pytest.mark.gpu
def test_load_migrate_and_save_on_cuda(cluster):
    """A rank on the GPU migrates to a wider tensor parallelism on two hosts
    (kept on the device and fetched), then saves from the device."""
    cf, c = cluster
    create(cf, "cuda", "tp=2", "h0:2")
    co = Coordinator(c)
    held = {r: load_rank(c, "cuda", r, device="cuda:0") for r in range(2)}
    co.reconfigure("cuda", parse_config("tp=4", "h0:2,h1:2"))
    new, kept, fetched = {}, 0, 0
    for rank in range(4):  # ranks 0 and 3 hold their quarter already, 1 and 2 do not
        new[rank], stats = migrate(c, held[rank % 2], rank)
        want = load_rank(c, "cuda", rank, device="cpu")
        assert {t.device.type for t in new[rank].tensors.values()} == {"cuda"}
        assert all(torch.equal(new[rank].tensors[n].cpu(), t) for n, t in want.tensors.items())
        kept, fetched = kept + stats.bytes_kept, fetched + stats.bytes_fetched
        loaded = load_rank(c, "cuda", rank, device="cuda:0")  # views of the old version
        assert all(torch.equal(loaded.tensors[n].cpu(), t) for n, t in want.tensors.items())
    assert kept > 0 and fetched > 0
    st = co.state("cuda")
    version = begin_save(co, "cuda")
    for rank in range(4):
        for t in new[rank].tensors.values():
            t.add_(1)
        put_rank(c, st, version, rank, new[rank].tensors, owned=True)
    commit_step(co, "cuda", 1)
    for rank in range(4):
        back = load_rank(c, "cuda", rank, device="cpu")
        assert all(torch.equal(back.tensors[n], t.cpu()) for n, t in new[rank].tensors.items())
