"""A job's spec from a live FSDP2 + tensor-parallel module, and its rank state
in and out of the module shard by shard (ptcfs.client.torch.dtensor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from ptcfs.client.torch.dtensor_spec import _stages, module_parameters  # noqa: E402
from tests.dtensor_gang import PRESET, gang  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_stages_from_names() -> None:
    names = ["emb.weight", "blocks.0.w", "blocks.1.w", "blocks.1.b", "norm.weight", "head.w"]
    assert _stages(names) == (["first", 0, 1, 1, "last", "last"], 2)
    assert _stages(["a", "b"]) == (["first", "first"], 1)


def test_wrapper_names_are_dropped() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrapped = torch.nn.Module()
    wrapped.add_module("module", torch.nn.Module())
    wrapped.module.add_module("_orig_mod", m)
    assert list(module_parameters(wrapped)) == ["0.weight", "0.bias"]


def _worker(rank: int, world: int, out: str) -> None:
    """Every check of one rank, written to ``out/<rank>.json``."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from ptcfs.client.torch.dtensor import load_into, local_of, state_of
    from ptcfs.client.torch.dtensor_spec import config_of, mesh_degrees, mesh_rank, spec_from_module
    from ptcfs.client.torch.state import RankState, to_numpy
    from ptcfs.errors import InvalidConfig
    from ptcfs.jobstate import JobState
    from ptcfs.model.presets import parse_model
    from ptcfs.model.specfile import encode_spec
    from ptcfs.plan.reshard import cut
    from ptcfs.sharding import rank_tensors
    from ptcfs.types import Host
    from tests.dtensor_gang import parallel_llama, train_step

    res: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    a = parallel_llama(mesh, seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train_step(a, opt_a, 0)

    spec, degrees = spec_from_module(a, mesh, optimizer=opt_a)
    preset = parse_model(PRESET, dtype="fp32", optimizer="adamw")
    res["degrees"] = degrees
    res["spec_is_preset"] = (spec.tensors == preset.tensors, spec.layers == preset.layers,
                             spec.pp_only == preset.pp_only)
    rank = mesh_rank(mesh)
    res["rank"] = rank
    cfg = config_of(degrees, (Host("h0", 4),))
    state = JobState("j", 1, "module", "fp32", "adamw", cfg, 1, spec=encode_spec(spec))

    # state_of: the local shards are ptcfs's sub-tensors of the logical tensors
    mine = state_of(a, opt_a, state, rank)
    params = module_parameters(a)
    wrong = []
    for s, sl in rank_tensors(spec, cfg, rank):
        kind, _, pname = s.name.partition("/")[2].partition("/") if s.is_optim else ("", "", "")
        p = params[pname or s.name]
        full = (opt_a.state[p][kind] if kind else p).full_tensor()  # collective, same order
        if not np.array_equal(to_numpy(mine[s.name]), cut(s, sl, to_numpy(full))):
            wrong.append(s.name)
    res["state_of_wrong"] = wrong

    # load_into another module: the same shards and moments, the same next step
    b = parallel_llama(mesh, seed=1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    slices = {s.name: sl for s, sl in rank_tensors(spec, cfg, rank)}
    given = {n: t.clone() for n, t in mine.items()}
    load_into(RankState(state, rank, given, slices, 1), b, opt_b)
    pb = module_parameters(b)
    res["loaded_equal"] = all(torch.equal(local_of(p), local_of(pb[n])) for n, p in params.items())
    res["moments_equal"] = all(
        torch.equal(local_of(opt_a.state[p][k]), local_of(opt_b.state[pb[n]][k]))
        and float(opt_b.state[pb[n]]["step"]) == 1.0
        for n, p in params.items() for k in ("exp_avg", "exp_avg_sq"))
    res["moments_are_the_rank_tensors"] = all(
        local_of(opt_b.state[pb[n]]["exp_avg"]).data_ptr()
        == given[f"optim/exp_avg/{n}"].data_ptr() for n in pb)
    res["next_losses"] = [train_step(a, opt_a, 1), train_step(b, opt_b, 1)]

    # a bf16 job with fp32 masters from the fp32 FSDP2 module
    spec16, _ = spec_from_module(a, mesh, optimizer="adamw", dtype="bf16")
    st16 = dataclasses.replace(state, dtype="bf16", spec=encode_spec(spec16))
    half = state_of(a, opt_a, st16, rank)
    res["bf16"] = all(
        half[n].dtype == torch.bfloat16 and torch.equal(half[n], local_of(p).bfloat16())
        and torch.equal(half[f"optim/master/{n}"], local_of(p))
        and half[f"optim/exp_avg/{n}"].dtype == torch.float32 for n, p in params.items())
    c = parallel_llama(mesh, seed=2)
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    load_into(RankState(st16, rank, half, {s.name: sl for s, sl in rank_tensors(
        spec16, cfg, rank)}, 2), c, opt_c)
    pc = module_parameters(c)
    res["bf16_masters_loaded"] = all(torch.equal(local_of(pc[n]), local_of(p))
                                     for n, p in params.items())

    # refusals, one line each
    errors = []
    for bad in (lambda: mesh_degrees(init_device_mesh("cpu", (2, 2),
                                                      mesh_dim_names=("tp", "dp_shard"))),
                lambda: mesh_degrees(init_device_mesh("cpu", (4,), mesh_dim_names=("dp_cp",))),
                lambda: spec_from_module(torch.nn.Linear(4, 4), mesh)):
        try:
            bad()
            errors.append("accepted")
        except InvalidConfig as e:
            errors.append(str(e))
    res["errors"] = errors
    Path(out, f"{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_fsdp2_tp_module_round_trip(tmp_path: Path) -> None:
    """Four gloo ranks on a 2x2 (dp_shard, tp) mesh: the spec of the module
    is the llama preset's, every local shard is ptcfs's sub-tensor, and the
    state goes into a fresh module and optimizer and trains on the same."""
    gang(_worker, 4, tmp_path, str(tmp_path))
    for r in range(4):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        assert res["rank"] == r
        assert res["degrees"] == {"pp": 1, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2}
        assert res["spec_is_preset"] == [True, True, True]
        assert res["state_of_wrong"] == []
        assert res["loaded_equal"] and res["moments_equal"]
        assert res["moments_are_the_rank_tensors"]
        a, b = res["next_losses"]
        assert a == b
        assert res["bf16"] and res["bf16_masters_loaded"]
        order, unknown, plain = res["errors"]
        assert "not in ptcfs's order" in order
        assert "'dp_cp' is not one ptcfs knows" in unknown
        assert "plain tensor but the mesh has fsdp=2" in plain
        assert all("\n" not in e for e in res["errors"])


def _pp_worker(rank: int, world: int, out: str) -> None:
    """One rank of a (pp, tp) = (2, 2) mesh whose stages hold layers 0 and
    1..2 of a 3-layer TinyLlama: its spec, sub-tensors and load, and a split
    ptcfs cannot hold, written to ``out/<rank>.json``."""
    from torch.distributed.device_mesh import init_device_mesh

    from ptcfs.client.torch.dtensor import load_into, local_of, state_of
    from ptcfs.client.torch.dtensor_spec import config_of, mesh_rank, spec_from_module
    from ptcfs.client.torch.state import RankState, to_numpy
    from ptcfs.errors import InvalidConfig
    from ptcfs.jobstate import JobState
    from ptcfs.model.presets import parse_model
    from ptcfs.model.specfile import encode_spec
    from ptcfs.plan.reshard import cut
    from ptcfs.sharding import rank_tensors
    from ptcfs.types import Host
    from tests.dtensor_gang import TinyLlama, stage_llama

    res: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]
    keep = [[0], [1, 2]][stage]

    def build(seed: int, layers: list[int]) -> torch.nn.Module:
        return stage_llama(mesh, seed, 3, layers, stage == 0, stage == 1)

    a = build(0, keep)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    spec, degrees = spec_from_module(a, mesh, optimizer=opt_a)
    preset = parse_model(PRESET.replace("layers=2", "layers=3"), dtype="fp32",
                         optimizer="adamw")
    res["spec_is_preset"] = (spec.tensors == preset.tensors, spec.layers == preset.layers)
    res["degrees"] = [dict(degrees), list(degrees.pp_layers)]
    rank = mesh_rank(mesh)
    res["rank"] = rank
    cfg = config_of(degrees, (Host("h0", 4),))
    res["config"] = cfg.degrees_text()
    state = JobState("j", 1, "module", "fp32", "adamw", cfg, 0, spec=encode_spec(spec))

    torch.manual_seed(0)
    whole = dict(TinyLlama(3).named_parameters())  # the values every stage was cut from
    mine = state_of(a, opt_a, state, rank)
    slices = {s.name: sl for s, sl in rank_tensors(spec, cfg, rank)}
    wrong = []
    for s, sl in rank_tensors(spec, cfg, rank):
        full = whole[s.name.rpartition("/")[2]].detach()
        want = np.zeros(sl.local_shape(s.shape), np.float32) if s.is_optim else \
            cut(s, sl, full.numpy())
        if not np.array_equal(to_numpy(mine[s.name]), want):
            wrong.append(s.name)
    res["state_of_wrong"] = wrong
    res["held"] = sorted({n.rpartition("/")[2] for n in mine})

    b = build(1, keep)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    load_into(RankState(state, rank, {n: t.clone() for n, t in mine.items()}, slices, 0),
              b, opt_b)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    res["loaded_equal"] = all(torch.equal(local_of(p), local_of(pb[n])) for n, p in pa.items())

    try:  # stage 0 holding layers 0 and 2, stage 1 layer 1: refused on every rank
        spec_from_module(build(0, [[0, 2], [1]][stage]), mesh)
        res["refused"] = "accepted"
    except InvalidConfig as e:
        res["refused"] = str(e)
    Path(out, f"{rank}.json").write_text(json.dumps(res))


def _vpp_worker(rank: int, world: int, out: str) -> None:
    """An interleaved pipeline: each stage's model parts (torchtitan's
    ``model_parts``) hold every other layer of a 4-layer LLaMA."""
    from torch.distributed.device_mesh import init_device_mesh

    from ptcfs.client.torch.dtensor import load_into, local_of, state_of
    from ptcfs.client.torch.dtensor_spec import config_of, mesh_rank, spec_from_module
    from ptcfs.client.torch.state import RankState, to_numpy
    from ptcfs.errors import InvalidConfig
    from ptcfs.jobstate import JobState
    from ptcfs.model.presets import parse_model
    from ptcfs.model.specfile import encode_spec
    from ptcfs.plan.reshard import cut
    from ptcfs.sharding import rank_tensors
    from ptcfs.types import Host
    from tests.dtensor_gang import TinyLlama, stage_llama

    res: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_coordinate()[0]

    def parts(seed: int, chunks: list[int]) -> list[torch.nn.Module]:
        return [stage_llama(mesh, seed, 4, [c], c == 0, c == 3) for c in chunks]

    a = parts(0, [stage, stage + 2])
    opt_a = torch.optim.AdamW([p for m in a for p in m.parameters()], lr=1e-2)
    spec, degrees = spec_from_module(a, mesh, optimizer=opt_a)
    preset = parse_model(PRESET.replace("layers=2", "layers=4"), dtype="fp32",
                         optimizer="adamw")
    res["spec_is_preset"] = spec.tensors == preset.tensors
    res["degrees"] = [dict(degrees), degrees.vpp, list(degrees.pp_layers)]
    rank = mesh_rank(mesh)
    cfg = config_of(degrees, (Host("h0", 4),))
    res["config"] = cfg.degrees_text()
    state = JobState("j", 1, "module", "fp32", "adamw", cfg, 0, spec=encode_spec(spec))
    torch.manual_seed(0)
    whole = dict(TinyLlama(4).named_parameters())
    mine = state_of(a, opt_a, state, rank)
    slices = {s.name: sl for s, sl in rank_tensors(spec, cfg, rank)}
    res["state_of_wrong"] = [
        s.name for s, sl in rank_tensors(spec, cfg, rank)
        if not np.array_equal(to_numpy(mine[s.name]), np.zeros(sl.local_shape(s.shape),
                              np.float32) if s.is_optim else cut(s, sl, whole[
                                  s.name].detach().numpy()))]
    res["layers"] = sorted({int(n.split(".")[2]) for n in mine if ".layers." in n})
    b = parts(1, [stage, stage + 2])
    opt_b = torch.optim.AdamW([p for m in b for p in m.parameters()], lr=1e-2)
    load_into(RankState(state, rank, {n: t.clone() for n, t in mine.items()}, slices, 0),
              b, opt_b)
    res["loaded_equal"] = all(torch.equal(local_of(p), local_of(q)) for ma, mb in zip(a, b)
                              for p, q in zip(ma.parameters(), mb.parameters()))
    try:  # stage 0 holding layers 0 and 3, stage 1 layers 1 and 2: no pipeline
        spec_from_module([stage_llama(mesh, 0, 4, [c], c == 0, c == 2)
                          for c in [[0, 3], [1, 2]][stage]], mesh)
        res["refused"] = "accepted"
    except InvalidConfig as e:
        res["refused"] = str(e)
    Path(out, f"{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_an_interleaved_pipeline_gives_its_virtual_stages(tmp_path: Path) -> None:
    """Model parts of an interleaved pipeline (pp=2, two chunks a stage):
    every rank derives the 4-layer preset, vpp=2 and a layer per chunk, and
    its sub-tensors are its parts' local shards, in and out."""
    gang(_vpp_worker, 4, tmp_path, str(tmp_path))
    for r in range(4):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        assert res["spec_is_preset"]
        assert res["degrees"] == [{"pp": 2, "dp": 1, "fsdp": 1, "cp": 1, "tp": 2}, 2,
                                  [1, 1, 1, 1]]
        assert "vpp=2,pp_layers=1:1:1:1" in res["config"]
        assert res["state_of_wrong"] == []
        assert res["layers"] == ([0, 2] if r < 2 else [1, 3])
        assert res["loaded_equal"]
        assert "pipeline stage 0 holds layers 0, 3" in res["refused"], res["refused"]


@pytest.mark.slow
def test_pipeline_stages_give_the_whole_model_and_their_split(tmp_path: Path) -> None:
    """Four gloo ranks on a (pp, tp) = (2, 2) mesh, each holding its stage
    only, torchtitan's way: every rank derives the 3-layer preset's spec and
    the stages' split 1:2 (not ptcfs's even 2:1), and its sub-tensors under
    that configuration are its local shards, in and out."""
    gang(_pp_worker, 4, tmp_path, str(tmp_path))
    held = []
    for r in range(4):
        res = json.loads((tmp_path / f"{r}.json").read_text())
        assert res["rank"] == r
        assert res["spec_is_preset"] == [True, True]
        assert res["degrees"] == [{"pp": 2, "dp": 1, "fsdp": 1, "cp": 1, "tp": 2}, [1, 2]]
        assert "pp_layers=1:2" in res["config"]
        assert res["state_of_wrong"] == []
        assert res["loaded_equal"]
        held.append(res["held"])
        assert "pipeline stage 0 holds layers 0, 2" in res["refused"]
        assert "\n" not in res["refused"]
    first = {n for n in held[0] if ".layers." not in n}
    assert first == {"model.embed_tokens.weight"}
    assert {n for n in held[2] if ".layers." not in n} == {"model.norm.weight", "lm_head.weight"}
    assert {n.split(".")[2] for n in held[0] if ".layers." in n} == {"0"}
    assert {n.split(".")[2] for n in held[2] if ".layers." in n} == {"1", "2"}


def _cuda_worker(rank: int, world: int, cf: str, out: str) -> None:
    """One NCCL rank on a (dp_shard, tp) = (1, 1) CUDA mesh: an FSDP2 +
    tensor-parallel module on the GPU saves a trained step through the
    daemons, a fresh module loads it onto the GPU and takes the same next
    step, and saves again from the device."""
    from torch.distributed.device_mesh import init_device_mesh

    from ptcfs.client.control.conn import Cluster
    from ptcfs.client.control.coordinator import Coordinator
    from ptcfs.client.control.saving import begin_save, commit_step
    from ptcfs.client.torch.dtensor import load_into, local_of, state_of
    from ptcfs.client.torch.dtensor_spec import mesh_rank, module_parameters
    from ptcfs.client.torch.state import load_rank, put_rank
    from tests.dtensor_gang import parallel_llama, train_step

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().contiguous().view(torch.uint8)

    def save(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        st = co.state("llama")
        version = begin_save(co, "llama")
        put_rank(cluster, st, version, rank, state_of(m, opt, st, rank), owned=True)
        commit_step(co, "llama", step)

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    assert mesh_rank(mesh) == rank
    cluster = Cluster.load(cf)
    co = Coordinator(cluster)
    res: dict[str, object] = {}
    a = parallel_llama(mesh, seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train_step(a, opt_a, 0)
    save(a, opt_a, 1)
    b = parallel_llama(mesh, seed=5)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    rs = load_rank(cluster, "llama", rank)  # default device: cuda:LOCAL_RANK
    load_into(rs, b, opt_b)
    pa, pb = module_parameters(a), module_parameters(b)
    res["devices"] = sorted({str(local_of(p).device) for p in pb.values()}
                            | {str(t.device) for t in rs.tensors.values()})
    res["loaded"] = all(torch.equal(bits(local_of(p)), bits(local_of(pb[n])))
                        and torch.equal(bits(opt_a.state[p]["exp_avg_sq"]),
                                        bits(opt_b.state[pb[n]]["exp_avg_sq"]))
                        for n, p in pa.items())
    res["next_losses"] = [train_step(a, opt_a, 1), train_step(b, opt_b, 1)]
    save(b, opt_b, 2)
    back = load_rank(cluster, "llama", rank, device="cpu")
    res["saved"] = all(torch.equal(bits(back.tensors[n]), bits(local_of(p)))
                       for n, p in pb.items())
    cluster.close()
    Path(out, f"{rank}.json").write_text(json.dumps(res))


@pytest.mark.gpu
def test_fsdp2_tp_module_on_cuda_through_the_daemons(tmp_path: Path) -> None:
    from tests.daemons import running
    from tests.test_cluster import ptcctl

    with running(tmp_path / "cluster", 1) as lc:
        ptcctl(lc.cluster_file, "job", "create", "llama", "--model", PRESET, "--dtype", "fp32",
               "--optimizer", "adamw", "--config", "tp=1", "--hosts", "h0:1", "--seed", "3")
        gang(_cuda_worker, 1, tmp_path, str(lc.cluster_file), str(tmp_path),
             backend="cpu:gloo,cuda:nccl")
    res = json.loads((tmp_path / "0.json").read_text())
    assert res["devices"] == ["cuda:0"]
    assert res["loaded"] and res["saved"]
    a, b = res["next_losses"]
    assert a == b and math.isfinite(a)
