"""``/ptc/<job>/dcp/step-<N>/`` read with DCP's own ``FileSystemReader``, on
real mounts of two real daemons: whole tensors in one process, FSDP2
``Shard(0)`` on three gloo processes and FSDP2 + tensor parallelism on two,
values equal to the job's (``ptcctl tensor get``), each rank reading only
the chunks its shards meet."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from torch.distributed import checkpoint as dcp  # noqa: E402

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from tests.dtensor_gang import LAYERS, PRESET, gang  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two hosts, one copy of everything (h0's mount reads h1's pieces from
    h1), mounted; job ``t``: the gang's LLaMA with Adam, tp=2 over both."""
    from ptcfs.server.testing.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("dcpview"))
    try:
        lc.up(2, gpus=2, replicas=1, mount=True)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "t", "--model", PRESET, "--optimizer", "adam", "--dtype",
               "fp32", "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "3")
        co = Coordinator(Cluster.load(cf))
        yield lc, co
        co.cluster.close()
    finally:
        lc.down()


def _key(name: str) -> str:
    if name.startswith("optim/"):
        _, kind, rest = name.split("/", 2)
        return f"optim.state.{rest}.{kind}"
    return f"model.{name}"


class CountingReader(dcp.FileSystemReader):
    """DCP's reader, counting the bytes of the stored items it reads."""

    read_bytes = 0

    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        seen = {(self.storage_data[r.storage_index].relative_path,
                 self.storage_data[r.storage_index].offset): self.storage_data[
                     r.storage_index].length for r in plan.items}
        self.read_bytes += sum(seen.values())
        return super().read_data(plan, planner)


def test_step_folder_lists_the_checkpoint(cluster):
    lc, co = cluster
    d = lc.mount_dir("h0") / "t"
    assert "dcp" in os.listdir(d)
    st = co.state("t")
    assert os.listdir(d / "dcp") == [f"step-{st.step}"]
    files = sorted(os.listdir(d / "dcp" / f"step-{st.step}"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with pytest.raises(FileNotFoundError):
        os.stat(d / "dcp" / "step-999")
    with pytest.raises(FileNotFoundError):
        os.stat(d / "dcp" / "nostep")


def test_whole_tensors_equal_the_jobs(cluster, tmp_path):
    lc, co = cluster
    st = co.state("t")
    path = lc.mount_dir("h0") / "t" / "dcp" / f"step-{st.step}"
    reader = dcp.FileSystemReader(str(path))
    md = reader.read_metadata()
    specs = st.model_spec().tensors
    sd = {_key(s.name): torch.empty(s.shape) for s in specs}
    assert set(sd) <= set(md.state_dict_metadata)
    small = {"step": None, "ptcfs_config": None}
    dcp.load({**sd, **small}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    for s in specs:
        np.testing.assert_array_equal(sd[_key(s.name)].numpy(), co.fetch_tensor(st, s.name),
                                      s.name)
    name = "model.layers.1.mlp.down_proj.weight"
    out = tmp_path / "get.npy"
    ptcctl(lc.cluster_file, "tensor", "get", "t", name, "--out", str(out))
    np.testing.assert_array_equal(sd[f"model.{name}"].numpy(), np.load(out))


def _load_view(rank: int, world: int, path: str, out: str, tp: int) -> None:
    """A job of ``world`` ranks (FSDP2 over world/tp, TP over tp) loads the
    view with dcp.load into its model's and optimizer's DTensors, and writes
    each local shard with its global offset, and the bytes it read."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ptcfs.client.torch.dtensor_spec import module_parameters
    from tests.dtensor_gang import parallel_llama

    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    m = parallel_llama(mesh, seed=5)
    opt = torch.optim.Adam(m.parameters())
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    reader = CountingReader(path)
    dcp.load(sd, storage_reader=reader)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    shards = {}
    own = 0
    for n, p in module_parameters(m).items():
        st = opt.state[p]
        for key, t in (("model." + n, p), (f"optim.state.{n}.exp_avg", st["exp_avg"]),
                       (f"optim.state.{n}.exp_avg_sq", st["exp_avg_sq"])):
            if not hasattr(t, "device_mesh"):
                shards[key] = ((0,) * t.dim(), t.detach().clone())
                continue
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
            local = t.to_local().detach().clone()
            own += local.numel() * local.element_size()
            shards[key] = (tuple(offset), local)
        shards[f"optim.state.{n}.step"] = ((), st["step"].clone())
    torch.save({"shards": shards, "read": reader.read_bytes, "own": own},
               Path(out, f"{world}-{tp}-{rank}.pt"))


@pytest.mark.parametrize("world,tp", [(3, 1), (2, 2)])
def test_dtensor_meshes_load_the_view(cluster, tmp_path, world, tp):
    lc, co = cluster
    st = co.state("t")
    path = lc.mount_dir("h0") / "t" / "dcp" / f"step-{st.step}"
    gang(_load_view, world, tmp_path, str(path), str(tmp_path), tp)
    whole = {_key(s.name): co.fetch_tensor(st, s.name) for s in st.model_spec().tensors}
    for r in range(world):
        got = torch.load(tmp_path / f"{world}-{tp}-{r}.pt")
        for key, (offset, t) in got["shards"].items():
            if key.endswith(".step"):
                assert float(t) == float(st.step), key
                continue
            box = tuple(slice(o, o + n) for o, n in zip(offset, t.shape))
            np.testing.assert_array_equal(t.numpy(), whole[key][box], f"rank {r}: {key}")
        if tp == 2:
            # the job's own tp=2 layout: each rank reads its own sub-tensors (and the
            # replicated norms, the small entries and the archives' frames), not the others'
            assert got["read"] < got["own"] + (64 << 10) + _replicated_bytes(st), got
    assert len(whole) == 3 * (2 + 9 * LAYERS + 1)


def _replicated_bytes(st) -> int:
    from ptcfs.sharding import layout_of

    return sum(s.nbytes for s in st.model_spec().tensors
               if len(layout_of(s, st.config).slices()) == 1)
