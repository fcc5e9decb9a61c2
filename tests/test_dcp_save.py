"""``dcp.save`` into ``/ptc/<job>/dcp/step-<N>/`` on real mounts of real
daemons: two gloo ranks of an FSDP2 job save with DCP's own writer, the save
becomes the job's version at step N with its non-tensor entries, which
``dcp.load`` gives back, also after a reconfiguration; bad saves get one
error and change nothing; removing a step folder drops its versions."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from torch.distributed import checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from tests.dtensor_gang import PRESET, gang  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two hosts, mounted; job ``w``: the gang's LLaMA with Adam, tp=2."""
    from ptcfs.server.testing.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("dcpsave"))
    try:
        lc.up(2, gpus=2, replicas=1, mount=True)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "w", "--model", PRESET, "--optimizer", "adam", "--dtype",
               "fp32", "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "3")
        co = Coordinator(Cluster.load(cf))
        yield lc, co
        co.cluster.close()
    finally:
        lc.down()


TRAIN = {"step": 7, "tokens": 12345, "notes": ["a", "b"]}


def _save(rank: int, world: int, paths: list[str]) -> None:
    """FSDP2 over ``world`` ranks: one Adam step, then dcp.save of the model,
    the optimizer and a train state to each of ``paths``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dtensor_gang import parallel_llama, train_step

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    m = parallel_llama(mesh, seed=11)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 0)
    msd, osd = get_state_dict(m, opt)
    for p in paths:
        dcp.save({"model": msd, "optim": osd, "train_state": dict(TRAIN)}, checkpoint_id=p)


def _whole(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items()
           if hasattr(v, "size") and (keys is None or k in keys)}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _key(name: str) -> str:
    if name.startswith("optim/"):
        _, kind, rest = name.split("/", 2)
        return f"optim.state.{rest}.{kind}"
    return f"model.{name}"


def test_dcp_save_becomes_the_next_version_and_survives_a_reconfiguration(cluster, tmp_path):
    lc, co = cluster
    before = co.state("w")
    target = lc.mount_dir("h0") / "w" / "dcp" / "step-7"
    gang(_save, 2, tmp_path, [str(tmp_path / "ref"), str(target)])
    st = co.state("w")
    assert (st.step, st.version > before.version) == (7, True)
    ref = _whole(tmp_path / "ref")
    for s in st.model_spec().tensors:
        np.testing.assert_array_equal(co.fetch_tensor(st, s.name), ref[_key(s.name)].numpy(),
                                      s.name)
    assert "step-7" in os.listdir(target.parent)
    assert sorted(os.listdir(target))[0] == ".metadata"
    # read back with the keys it was saved with, the train state too
    back = {"train_state": {k: None for k in TRAIN}, "optim": {"param_groups": [{"lr": None}]}}
    dcp.load(back, checkpoint_id=str(target), no_dist=True)
    assert back["train_state"] == TRAIN and back["optim"]["param_groups"][0]["lr"] == 1e-2
    got = _whole(target)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=0, msg=k)
    # reconfigured: step-7 is the new layout's version, with the same keys and entries
    ptcctl(lc.cluster_file, "reconfigure", "w", "--to", "fsdp=2", "--hosts", "h0:1,h1:1")
    after = co.state("w")
    assert (after.step, after.version > st.version) == (7, True)
    got = _whole(target)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=0, msg=k)
    back = {"train_state": {k: None for k in TRAIN}}
    dcp.load(back, checkpoint_id=str(target), no_dist=True)
    assert back["train_state"] == TRAIN


def _refused(folder: Path) -> str:
    return (folder / ".refused").read_text()


def test_bad_saves_change_nothing(cluster, tmp_path):
    lc, co = cluster
    before = co.state("w")
    spec = before.model_spec()
    dcp_dir = lc.mount_dir("h0") / "w" / "dcp"
    good = {_key(s.name): torch.zeros(s.shape) for s in spec.tensors}
    # another shape than the job's
    bad = dict(good)
    name = next(k for k in bad if k.startswith("model."))
    bad[name] = torch.zeros(3, 3)
    folder = dcp_dir / "step-20"
    with pytest.raises(CheckpointException):  # DCP wraps the rename's EINVAL in its own
        dcp.save(bad, checkpoint_id=str(folder), no_dist=True)
    assert f"{name} is fp32 [3, 3]" in _refused(folder)
    assert co.state("w").version == before.version
    shutil.rmtree(folder)
    assert "step-20" not in os.listdir(dcp_dir)
    # half-written: the metadata of a save whose data files are not all there
    ref = tmp_path / "ref"
    dcp.save(good, checkpoint_id=str(ref), no_dist=True)
    folder = dcp_dir / "step-21"
    folder.mkdir()
    shutil.copyfile(ref / ".metadata", folder / ".metadata.tmp")
    with pytest.raises(OSError):
        os.rename(folder / ".metadata.tmp", folder / ".metadata")
    assert "missing or half-written" in _refused(folder)
    # a writer that died before its metadata: a folder without one, the job unchanged
    shutil.copyfile(ref / "__0_0.distcp", folder / "__0_0.distcp")
    with pytest.raises(CheckpointException, match="No such file or directory"):
        dcp.load(dict(good), checkpoint_id=str(folder), no_dist=True)
    # a second writer of the same step
    with pytest.raises(FileExistsError):
        with open(folder / "__0_0.distcp", "wb") as f:
            f.write(b"x")
    assert co.state("w").version == before.version
    shutil.rmtree(folder)
    # a step that is committed is not written again
    with pytest.raises(FileExistsError):
        (dcp_dir / f"step-{before.step}").mkdir()


def test_removing_a_step_folder_drops_its_versions(cluster, tmp_path):
    lc, co = cluster
    st = co.state("w")
    dcp_dir = lc.mount_dir("h0") / "w" / "dcp"
    good = {_key(s.name): torch.full(s.shape, 2.0) for s in st.model_spec().tensors}
    dcp.save(good, checkpoint_id=str(dcp_dir / f"step-{st.step + 5}"), no_dist=True)
    new = co.state("w")
    assert new.step == st.step + 5
    # the current version stays
    with pytest.raises(OSError) as e:
        os.rmdir(dcp_dir / f"step-{new.step}")
    assert e.value.errno == errno.EBUSY
    shutil.rmtree(dcp_dir / f"step-{st.step}")  # as rm -r and torchtitan's purge do
    assert f"step-{st.step}" not in os.listdir(dcp_dir)
    assert co.state("w").version == new.version
