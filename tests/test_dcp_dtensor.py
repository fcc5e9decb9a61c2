"""DCP checkpoints of DTensor jobs through ptcfs: four gloo ranks of an FSDP2 +
tensor-parallel LLaMA save with ``dcp.save``; ``ptcctl import`` takes it
(the model recognised from its names), the job is reconfigured to fsdp=2
and fsdp=3 and exported in each layout, and jobs of 2 and 3 ranks on their
own meshes ``dcp.load`` the exports into their DTensor state dicts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from torch.distributed import checkpoint as dcp  # noqa: E402

from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.formats.common import new_state  # noqa: E402
from ptcfs.client.torch.state import to_numpy  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from ptcfs.sharding import layout_of, parse_config  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.dtensor_gang import HEADS, LAYERS, PRESET, VOCAB, gang  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("dcpdt"), 2, gpus=2) as cc:
        yield cc


#: the job's AdamW settings; the loading jobs build theirs with torch's defaults
SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-6}


def _save(rank: int, world: int, path: str) -> None:
    """The 4-rank FSDP2 + TP job: two AdamW steps (settings of its own, not
    torch's defaults), then dcp.save."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dtensor_gang import parallel_llama, train_step

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    m = parallel_llama(mesh, seed=0)
    opt = torch.optim.AdamW(m.parameters(), **SETTINGS)
    for step in range(2):
        train_step(m, opt, step)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(rank: int, world: int, path: str, out: str,
          stages: list[list[int]] | None = None) -> None:
    """A job of ``world`` ranks with FSDP2 only (or, with ``stages``, a
    pipeline of stages holding those layers of a LLaMA of as many layers,
    tensor parallel within) loads ``path`` with dcp.load and writes every
    local shard with its global offset to ``out/<world or pp>-<rank>.pt``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ptcfs.client.torch.dtensor_spec import module_parameters
    from tests.dtensor_gang import parallel_llama, stage_llama, train_step

    if stages is None:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        m = parallel_llama(mesh, seed=5)
    else:
        mesh = init_device_mesh("cpu", (len(stages), world // len(stages)),
                                mesh_dim_names=("pp", "tp"))
        s = mesh.get_coordinate()[0]
        m = stage_llama(mesh, 5, sum(map(len, stages)), stages[s], s == 0,
                        s == len(stages) - 1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    shards: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
    for n, p in module_parameters(m).items():
        st = opt.state[p]
        for key, t in (("model." + n, p), (f"optim.state.{n}.exp_avg", st["exp_avg"]),
                       (f"optim.state.{n}.exp_avg_sq", st["exp_avg_sq"])):
            if not hasattr(t, "device_mesh"):  # not sharded (a norm without FSDP)
                shards[key] = ((0,) * t.dim(), t.detach().clone())
                continue
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
            shards[key] = (tuple(offset), t.to_local().detach().clone())
        shards[f"optim.state.{n}.step"] = ((), st["step"].clone())
    shards["param_groups"] = ((), [{k: v for k, v in g.items() if k != "params"}
                                   for g in opt.param_groups])
    if stages is None:
        train_step(m, opt, 2)  # and it trains on
    torch.save(shards, Path(out, f"{'pp' if stages else world}-{rank}.pt"))


def _full(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _chunks(path: Path, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return sorted((tuple(c.offsets), tuple(c.sizes))
                  for c in md.state_dict_metadata[key].chunks)


def _saved_and_imported(cf: Path, tmp_path: Path, save, orig: Path, job: str
                        ) -> tuple[dict[str, torch.Tensor], dict]:
    """``save`` run on four ranks into ``orig``, then imported as ``job``
    with no --config: the checkpoint's tensors and the import's JSON."""
    gang(save, 4, tmp_path, str(orig))
    out = json.loads(ptcctl(cf, "import", job, str(orig), "--format", "torch-dcp",
                            "--json").stdout)
    return _full(orig), out


def _same_as_saved(co: Coordinator, st, full: dict[str, torch.Tensor]) -> None:
    """Every tensor of the job ``st`` is the one the checkpoint ``full`` saved."""
    for s in st.model_spec().tensors:
        _, kind, name = s.name.split("/", 2) if s.is_optim else ("", "", s.name)
        key = f"optim.state.{name}.{kind}" if kind else f"model.{name}"
        np.testing.assert_array_equal(co.fetch_tensor(st, s.name), full[key].numpy(), s.name)


def test_fsdp2_tp_checkpoint_to_other_meshes(cluster, tmp_path):
    cf, co = cluster
    orig = tmp_path / "orig"
    # without --config: the mesh it was saved under, read from its chunks
    full, out = _saved_and_imported(cf, tmp_path, _save, orig, "dt-mesh")
    assert out["config"] == "tp=2,pp=1,dp=1,fsdp=2 on h0:2,h1:2"
    assert any("from its chunks: dp=1,fsdp=2,tp=2" in n for n in out["notes"]), out["notes"]

    out = json.loads(ptcctl(cf, "import", "dt", str(orig), "--format", "torch-dcp", "--config",
                            "fsdp=2,tp=2", "--hosts", "h0:2,h1:2", "--json").stdout)
    assert (out["step"], out["optimizer"], out["config"]) == (2, "adam",
                                                              "tp=2,pp=1,dp=1,fsdp=2 on h0:2,h1:2")
    assert out["model"] == "llama (hf names, heads unknown)"
    st = co.state("dt")
    preset = parse_model(PRESET, dtype="fp32", optimizer="adam")
    assert st.model_spec().tensors == preset.tensors
    _same_as_saved(co, st, full)
    # a spec file instead of the names
    ptcctl(cf, "spec", "--model", PRESET, "--dtype", "fp32", "--out", str(tmp_path / "m.toml"))
    ptcctl(cf, "import", "dt-spec", str(orig), "--format", "torch-dcp", "--model-spec",
           str(tmp_path / "m.toml"), "--hosts", "h1:1")
    assert co.checksums(co.state("dt-spec")) == co.checksums(st)

    exports = {}
    for fsdp, hosts in ((2, "h0:1,h1:1"), (3, "h0:2,h1:1")):
        ptcctl(cf, "reconfigure", "dt", "--to", f"fsdp={fsdp}", "--hosts", hosts)
        exports[fsdp] = tmp_path / f"fsdp{fsdp}"
        ptcctl(cf, "export", "dt", str(exports[fsdp]), "--format", "torch-dcp")
        # stored in the job's own layout: one chunk per sub-tensor
        cfg = parse_config(f"fsdp={fsdp}", hosts)
        emb = next(s for s in preset.tensors if s.name == "model.embed_tokens.weight")
        want = sorted((tuple(a for a, _ in lb), tuple(b - a for a, b in lb))
                      for sl in layout_of(emb, cfg).slices() for lb, _ in sl.pieces(emb.shape))
        assert _chunks(exports[fsdp], "model.model.embed_tokens.weight") == want
        assert len(want) == fsdp and want[-1][1][0] == VOCAB - (fsdp - 1) * -(-VOCAB // fsdp)

    for world in (2, 3):
        gang(_load, world, tmp_path, str(exports[world]), str(tmp_path))
        _loaded_as_saved(tmp_path, str(world), world, full, 2)
        # the job's optimizer settings, not torch's defaults the loaders built
        for r in range(world):
            (group,) = torch.load(tmp_path / f"{world}-{r}.pt")["param_groups"][1]
            assert {k: group[k] for k in SETTINGS} == SETTINGS, (world, r, group)
    assert len([k for k in full if k.endswith(".step")]) == 2 + 9 * LAYERS + 1
    # and in the other formats' optimizer files: the Trainer's two groups, one of
    # torch.save (hf needs the heads, which DCP does not record)
    r = ptcctl(cf, "export", "dt", str(tmp_path / "nohf"), "--format", "hf", check=False)
    assert r.returncode == 2 and "records no heads" in r.stderr and "Traceback" not in r.stderr
    ptcctl(cf, "import", "dt-heads", str(orig), "--format", "torch-dcp", "--heads",
           str(HEADS), "--hosts", "h1:1")
    ptcctl(cf, "export", "dt-heads", str(tmp_path / "hf"), "--format", "hf")
    groups = torch.load(tmp_path / "hf" / "optimizer.pt")["param_groups"]
    assert [len(g["params"]) for g in groups] == [2 + 7 * LAYERS, 2 * LAYERS + 1]
    for g in groups:
        assert {k: g[k] for k in SETTINGS} == SETTINGS, g
    ptcctl(cf, "export", "dt", str(tmp_path / "pt"), "--format", "torch")
    (group,) = torch.load(tmp_path / "pt" / "model.pt")["optimizer"]["param_groups"]
    assert {k: group[k] for k in SETTINGS} == SETTINGS, group


def _loaded_as_saved(tmp_path: Path, tag: str, world: int, full: dict[str, torch.Tensor],
                     step: int) -> None:
    """The shards ``_load`` wrote on ``world`` ranks are the saved tensors,
    every element at least once (replicas once), at ``step``."""
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    for r in range(world):
        for key, (offset, local) in torch.load(tmp_path / f"{tag}-{r}.pt").items():
            if key == "param_groups":
                continue
            if key.endswith(".step"):
                assert float(local) == step, key
                continue
            region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            assert torch.equal(local, full[key][region]), (tag, r, key)
            seen[key, offset] = local.numel()
    assert sum(seen.values()) == sum(full[k].numel() for k in full if not k.endswith(".step"))


def test_bf16_job_keeps_fp32_masters_and_moments(cluster, tmp_path):
    """A bf16 job with Adam exported to DCP: ``model.<name>`` is the fp32
    master (what dcp.load into an fp32 model reads), the moments are fp32,
    the bf16 parameter is ``ptcfs_param.<name>``; and it imports back as
    it was, with no --model or --heads."""
    cf, co = cluster
    cfg = parse_config("fsdp=2,tp=2", "h0:2,h1:2")
    state = new_state("half", PRESET, "bf16", "adam", cfg, 7, co)
    co.create(state, seed=3)
    ptcctl(cf, "export", "half", str(tmp_path / "half"), "--format", "torch-dcp")
    spec = parse_model(PRESET, dtype="bf16", optimizer="adam")
    params = [s for s in spec.tensors if not s.is_optim]
    want = {f"model.{s.name}": torch.empty(s.shape, dtype=torch.float32) for s in params}
    sd = {"model": {s.name: want[f"model.{s.name}"] for s in params},
          "optim": {"state": {s.name: {k: torch.empty(s.shape) for k in ("exp_avg", "exp_avg_sq")}
                              for s in params}}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "half"), no_dist=True)
    for s in params:
        master = co.fetch_tensor(state, f"optim/master/{s.name}")
        assert not np.array_equal(master.astype(np.float32),
                                  to_numpy(torch.from_numpy(master).bfloat16().float()))
        np.testing.assert_array_equal(to_numpy(sd["model"][s.name]), master, s.name)
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(to_numpy(sd["optim"]["state"][s.name][k]),
                                          co.fetch_tensor(state, f"optim/{k}/{s.name}"))
    half = _full(tmp_path / "half")
    assert all(half[f"ptcfs_param.{s.name}"].dtype == torch.bfloat16 for s in params)

    out = json.loads(ptcctl(cf, "import", "half2", str(tmp_path / "half"), "--format",
                            "torch-dcp", "--config", "tp=2", "--hosts", "h1:2",
                            "--json").stdout)
    assert (out["model"], out["dtype"], out["step"]) == (PRESET, "bf16", 7)
    assert co.checksums(co.state("half2")) == co.checksums(state)


def _save_stages(rank: int, world: int, path: str, layers: int = 3,
                 keep: tuple[list[int], list[int]] = ([0], [1, 2])) -> None:
    """A (pp, tp) = (2, 2) job whose stages hold layers ``keep`` of a
    ``layers``-layer LLaMA, torchtitan's way (by default 0 and 1..2 of 3;
    layers 0, 2 and 1, 3 of 4: an interleaved pipeline): one AdamW step on
    fixed gradients, then dcp.save of each stage's state dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dtensor_gang import stage_llama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    m = stage_llama(mesh, 0, layers, keep[stage], stage == 0, stage == 1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def test_an_interleaved_pipeline_checkpoint_imports_on_its_chunks(cluster, tmp_path):
    """The chunks of an interleaved pipeline's checkpoint give vpp and each
    chunk's layers; the job moves to a plain pipeline, and both its exports
    load into jobs of those meshes."""
    cf, co = cluster
    gang(_save_stages, 4, tmp_path, str(tmp_path / "vpp"), 4, ([0, 2], [1, 3]))
    full = _full(tmp_path / "vpp")
    out = json.loads(ptcctl(cf, "import", "dt-vpp", str(tmp_path / "vpp"), "--format",
                            "torch-dcp", "--json").stdout)
    assert any("from its chunks: pp=2,vpp=2,pp_layers=1:1:1:1,dp=1,fsdp=1,tp=2" in n
               for n in out["notes"]), out["notes"]
    st = co.state("dt-vpp")
    assert (st.config.pp, st.config.vpp, st.config.tp) == (2, 2, 2)
    _same_as_saved(co, st, full)
    ptcctl(cf, "export", "dt-vpp", str(tmp_path / "vpp-out"), "--format", "torch-dcp")
    gang(_load, 4, tmp_path, str(tmp_path / "vpp-out"), str(tmp_path), [[0, 2], [1, 3]])
    _loaded_as_saved(tmp_path, "pp", 4, full, 1)
    ptcctl(cf, "reconfigure", "dt-vpp", "--to", "tp=2,pp=2", "--hosts", "h0:2,h1:2")
    st = co.state("dt-vpp")
    assert st.config.vpp == 1
    _same_as_saved(co, st, full)
    ptcctl(cf, "export", "dt-vpp", str(tmp_path / "pp-out"), "--format", "torch-dcp")
    gang(_load, 4, tmp_path, str(tmp_path / "pp-out"), str(tmp_path), [[0, 1], [2, 3]])
    _loaded_as_saved(tmp_path, "pp", 4, full, 1)


def test_a_pipeline_checkpoint_imports_on_its_stages(cluster, tmp_path):
    """The mesh of a pipeline job's checkpoint, stages and their uneven split
    included, is read from which ranks wrote which tensors' chunks."""
    cf, co = cluster
    full, out = _saved_and_imported(cf, tmp_path, _save_stages, tmp_path / "stages", "dt-pp")
    assert any("from its chunks: pp=2,pp_layers=1:2,dp=1,fsdp=1,tp=2" in n
               for n in out["notes"]), out["notes"]
    st = co.state("dt-pp")
    assert (st.config.pp, st.config.pp_layers, st.config.tp) == (2, (1, 2), 2)
    assert st.step == 1
    names = [s.name for s in st.model_spec().tensors]
    assert "model.layers.2.mlp.down_proj.weight" in names
    assert len(names) == len([k for k in full if not k.endswith(".step")])
    for version in (1, 2):
        if version == 2:  # on to the even split of the same stages, and back whole
            ptcctl(cf, "reconfigure", "dt-pp", "--to", "tp=2,pp=2", "--hosts", "h0:2,h1:2")
            st = co.state("dt-pp")
            assert st.config.pp_layers == ()
        _same_as_saved(co, st, full)
    # exported, and loaded by a job whose stages hold layers 0..1 and 2
    ptcctl(cf, "export", "dt-pp", str(tmp_path / "even"), "--format", "torch-dcp")
    gang(_load, 4, tmp_path, str(tmp_path / "even"), str(tmp_path), [[0, 1], [2]])
    _loaded_as_saved(tmp_path, "pp", 4, full, 1)
    # and imported again: at the configuration it was exported at
    out = json.loads(ptcctl(cf, "import", "dt-pp2", str(tmp_path / "even"), "--format",
                            "torch-dcp", "--json").stdout)
    assert out["config"] == "tp=2,pp=2,dp=1 on h0:2,h1:2"
    assert any("the mesh it was exported at: tp=2,pp=2,dp=1" in n for n in out["notes"])
    assert co.checksums(co.state("dt-pp2")) == co.checksums(st)
