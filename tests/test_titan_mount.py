"""torchtitan's ``CheckpointManager`` with its folder on the mount.

A job imported from a torchtitan checkpoint (``tests/titan_job.py save``,
then ``ptcctl import --format torchtitan``) shows ``/ptc/<job>/dcp/`` as
torchtitan's checkpoint folder: its keys are the ones torchtitan saved, the
fused query/key/value Adam moments gathered from the job's ``wq``/``wk``/``wv``
moments. Two gloo ranks of torchtitan's llama3 under FSDP2, whose
``CheckpointManager`` folder is the job's ``dcp`` folder on a real mount
(absolute, as a user sets ``checkpoint.folder``; ``tests/titan_job.py
resume``), load step 2 (everything the saving job had, bit for bit),
train a step and save step 3 into the mount: the job's next
version, its fused moments split back into the job's tensors. After
``ptcctl reconfigure`` to tp=2 on the other host the same trainer resumes
step 3 through the mount, bit for bit, and saves step 4. A save whose fused
moment has another shape is refused in one line and changes nothing. The
same for torchtitan's qwen3 (dense; ``extended``). The same for
torchtitan's mixture-of-experts deepseek_v3 (qwen3 with experts:
``extended``), its stacked experts served whole and split back by a save,
reconfigured to ``fsdp=2,ep=2`` on the other host.
"""

from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install "
                    "'ptcfs[titan]' as deploy/setup.sh does")

from torch.distributed import checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from tests.daemons import mounted_pair  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402
from tests.test_titan_ckpt import _holds_what_was_saved, _same, _torchrun  # noqa: E402
from tests.titan_job import DIM, EXPERTS, HEADS, QWEN3_HEAD_DIM, STEP  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

FUSED = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with mounted_pair(tmp_path_factory.mktemp("titanmount")) as both:
        yield both


def _resumed(out, step: int) -> None:
    """Each rank loaded step ``step`` as the job that saved it had it."""
    for r in (0, 1):
        saved = out / (f"save-{r}.pt" if step == STEP else f"save-{step}-{r}.pt")
        _same(torch.load(saved), torch.load(out / f"load-{step}-{r}.pt"), f"rank {r}")


@pytest.mark.parametrize("model", ["llama3", pytest.param("qwen3", marks=pytest.mark.extended)])
def test_torchtitan_saves_and_resumes_through_the_mount(cluster, tmp_path, model):
    """qwen3 (dense, ``extended``): its head size is not hidden / heads."""
    lc, co = cluster
    cf = lc.cluster_file
    out = tmp_path / "out"
    out.mkdir()
    _torchrun("save", tmp_path / "orig", out, model)
    orig = tmp_path / "orig" / "checkpoint" / f"step-{STEP}"
    job = f"tm-{model}"
    ptcctl(cf, "import", job, str(orig), "--format", "torchtitan",
           *(["--heads", str(HEADS)] if model == "llama3" else []))
    head_dim = DIM // HEADS if model == "llama3" else QWEN3_HEAD_DIM
    base = lc.mount_dir("h0") / job

    # the view: torchtitan's keys, the fused moments whole and as saved
    view = base / "dcp" / f"step-{STEP}"
    want = dcp.FileSystemReader(str(orig)).read_metadata().state_dict_metadata
    have = dcp.FileSystemReader(str(view)).read_metadata().state_dict_metadata
    assert sorted(have) == sorted(want)
    assert {k: tuple(m.size) for k, m in have.items() if hasattr(m, "size")} == {
        k: tuple(m.size) for k, m in want.items() if hasattr(m, "size")}
    # its chunks are runs of the parts' stored sub-tensors, each in the file of the rank
    # that holds it: a rank's Shard(0) of the fused rows (its key/value group) meets
    # only its own rank's bytes
    files = {(i.fqn, tuple(i.offset or ())): info.relative_path for i, info in
             dcp.FileSystemReader(str(view)).read_metadata().storage_data.items()}
    half = have[FUSED].size[0] // 2
    for c in have[FUSED].chunks:
        lo, hi = c.offsets[0], c.offsets[0] + c.sizes[0]
        assert hi <= half or lo >= half, c  # within one rank's rows
        rank = 0 if hi <= half else 1
        assert files[(FUSED, tuple(c.offsets))] == f"__{rank}_0.distcp", c
    assert sum(c.sizes.numel() for c in have[FUSED].chunks) == have[FUSED].size.numel()
    sd = {FUSED: torch.empty(have[FUSED].size)}
    dcp.load(sd, checkpoint_id=str(view), no_dist=True)
    _same(torch.load(out / "save-0.pt")["optimizer"][FUSED.removeprefix("optimizer.")],
          sd[FUSED], FUSED)

    # torchtitan resumes step 2 from the mount and saves step 3 into it
    before = co.state(job).version
    dump = tmp_path / "dump"  # the trainer's dump folder; its checkpoint folder the mount's
    _torchrun("resume", dump, out, model, str(base / "dcp"), str(STEP))
    _resumed(out, STEP)
    st = co.state(job)
    assert (st.step, st.version > before) == (STEP + 1, True)
    _holds_what_was_saved(co, job, out, head_dim, dump=f"save-{STEP + 1}-0.pt")

    # reconfigured: resumed again through the mount, and saved again
    ptcctl(cf, "reconfigure", job, "--to", "tp=2", "--hosts", "h1:2")
    _torchrun("resume", dump, out, model, str(base / "dcp"), str(STEP + 1))
    _resumed(out, STEP + 1)
    st = co.state(job)
    assert (st.step, st.config.tp) == (STEP + 2, 2)
    _holds_what_was_saved(co, job, out, head_dim, dump=f"save-{STEP + 2}-0.pt")
    assert {f"step-{STEP + 1}", f"step-{STEP + 2}"} <= set(os.listdir(base / "dcp"))

    # a fused moment of another shape: refused in one line, nothing changes
    before = co.state(job)
    folder = base / "dcp" / "step-20"
    sd = {k: torch.zeros(m.size) for k, m in have.items() if hasattr(m, "size")}
    sd[FUSED] = torch.zeros(3, 3)
    with pytest.raises(CheckpointException):  # DCP wraps the rename's EINVAL in its own
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)
    refused = (folder / ".refused").read_text()
    assert f"{FUSED} is fp32 [3, 3]" in refused and len(refused.splitlines()) == 1, refused
    assert co.state(job).version == before.version
    shutil.rmtree(folder)


_W1 = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
MOMENT = f"optimizer.state.{_W1}.exp_avg"


def _files(view) -> dict:
    """Each stored chunk of the view → the file it is in."""
    return {(i.fqn, tuple(i.offset or ())): info.relative_path for i, info in
            dcp.FileSystemReader(str(view)).read_metadata().storage_data.items()}


@pytest.mark.parametrize("model", ["deepseek_v3",
                                   pytest.param("qwen3_moe", marks=pytest.mark.extended)])
def test_torchtitan_moe_saves_and_resumes_through_the_mount(cluster, tmp_path, model):
    """torchtitan's mixture of experts: each layer's routed experts stacked in
    one key per projection (and its Adam moments), the job keeping one tensor
    per expert. The view serves the stacked keys as torchtitan saved them,
    each chunk one expert's rows in the file of the rank that holds them; a
    save into the mount splits them back (the load-balancing bias, a buffer,
    has no optimizer state: its moments stay zeros); after ``ptcctl
    reconfigure`` to ``fsdp=2,ep=2`` on the other host (each rank holding
    half of the experts, whole) torchtitan's FSDP2 shard of a stacked key is
    one rank's file, and it resumes bit for bit. A stacked key with another
    number of experts is refused in one line. qwen3 with experts
    (``extended``): the same path, with fused query/key/value moments too."""
    lc, co = cluster
    cf = lc.cluster_file
    out = tmp_path / "out"
    out.mkdir()
    _torchrun("save", tmp_path / "orig", out, model)
    orig = tmp_path / "orig" / "checkpoint" / f"step-{STEP}"
    job = f"tm-{model}"
    ptcctl(cf, "import", job, str(orig), "--format", "torchtitan")
    head_dim = QWEN3_HEAD_DIM if model == "qwen3_moe" else DIM // HEADS
    base = lc.mount_dir("h0") / job

    # the view: torchtitan's keys, the stacked experts and their moments whole
    view = base / "dcp" / f"step-{STEP}"
    want = dcp.FileSystemReader(str(orig)).read_metadata().state_dict_metadata
    have = dcp.FileSystemReader(str(view)).read_metadata().state_dict_metadata
    assert sorted(have) == sorted(want)
    assert {k: tuple(m.size) for k, m in have.items() if hasattr(m, "size")} == {
        k: tuple(m.size) for k, m in want.items() if hasattr(m, "size")}
    # fsdp=2: each chunk is one expert's half of its rows, in the file of the rank
    # that holds that half
    files = _files(view)
    rows = have[_W1].size[1]
    for key in (_W1, MOMENT):
        for c in have[key].chunks:
            assert c.sizes[0] == 1 and c.offsets[1] + c.sizes[1] <= rows, c
            rank = 0 if c.offsets[1] + c.sizes[1] <= rows // 2 else 1
            assert c.offsets[1] >= rank * rows // 2, c
            assert files[(key, tuple(c.offsets))] == f"__{rank}_0.distcp", c
        assert sum(c.sizes.numel() for c in have[key].chunks) == have[key].size.numel()
    sd = {k: torch.empty(have[k].size) for k in (_W1, MOMENT)}
    dcp.load(sd, checkpoint_id=str(view), no_dist=True)
    saved = torch.load(out / "save-0.pt")
    _same(saved["model"][_W1], sd[_W1], _W1)
    _same(saved["optimizer"][MOMENT.removeprefix("optimizer.")], sd[MOMENT], MOMENT)

    # torchtitan resumes step 2 from the mount and saves step 3 into it
    before = co.state(job).version
    dump = tmp_path / "dump"
    _torchrun("resume", dump, out, model, str(base / "dcp"), str(STEP))
    _resumed(out, STEP)
    st = co.state(job)
    assert (st.step, st.version > before) == (STEP + 1, True)
    _holds_what_was_saved(co, job, out, head_dim, dump=f"save-{STEP + 1}-0.pt")

    # expert parallel on the other host: each rank holds half of the experts whole,
    # so torchtitan's FSDP2 Shard(0) of a stacked key reads one rank's file
    ptcctl(cf, "reconfigure", job, "--to", "fsdp=2,ep=2", "--hosts", "h1:2")
    # ptcfs keeps the newest PTC_KEEP_VERSIONS (2) versions, whatever torchtitan's
    # keep_latest_k: the reconfiguration's shares step 3 with the save it came from, so
    # step 2 is gone (docs/filesystem.md)
    assert sorted(os.listdir(base / "dcp")) == [f"step-{STEP + 1}"]
    view = base / "dcp" / f"step-{STEP + 1}"
    meta = dcp.FileSystemReader(str(view)).read_metadata().state_dict_metadata[_W1]
    files = _files(view)
    for c in meta.chunks:
        assert tuple(c.sizes) == (1, *meta.size[1:]), c
        rank = c.offsets[0] // (EXPERTS // 2)
        assert files[(_W1, tuple(c.offsets))] == f"__{rank}_0.distcp", c
    _torchrun("resume", dump, out, model, str(base / "dcp"), str(STEP + 1))
    _resumed(out, STEP + 1)
    st = co.state(job)
    assert (st.step, st.config.ep) == (STEP + 2, 2)
    _holds_what_was_saved(co, job, out, head_dim, dump=f"save-{STEP + 2}-0.pt")
    assert {f"step-{STEP + 1}", f"step-{STEP + 2}"} <= set(os.listdir(base / "dcp"))

    # a stacked key of another number of experts: refused in one line, nothing changes
    before = co.state(job)
    folder = base / "dcp" / "step-20"
    sd = {k: torch.zeros(m.size) for k, m in have.items() if hasattr(m, "size")}
    sd[_W1] = torch.zeros(EXPERTS - 1, *have[_W1].size[1:])
    with pytest.raises(CheckpointException):
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)
    refused = (folder / ".refused").read_text()
    assert f"{_W1} is fp32 [{EXPERTS - 1}," in refused and f"its {EXPERTS} experts" in refused
    assert len(refused.splitlines()) == 1, refused
    assert co.state(job).version == before.version
    shutil.rmtree(folder)
