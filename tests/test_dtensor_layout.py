"""Every rank's sub-tensors are PyTorch DTensor's local shards.

For a Llama model with Hugging Face names and Adam state, each rank of a
configuration holds, in ptcfs, the sub-tensors ``ptcctl plan --shapes``
prints; here eight gloo processes build every logical tensor, distribute it
with ``torch.distributed.tensor.distribute_tensor`` on the DeviceMesh
``["pp", "dp", "fsdp", "cp", "tp"]`` with the placements FSDP2, ZeRO-1 and
tensor parallelism use, and report ``to_local()``'s shape and values: both
must be ptcfs's (shape from ``--shapes``, values from ``reshard.cut``).

Placements (outer mesh dimension first): tensor parallelism is ``Shard(d)``
on ``tp``; FSDP ``Shard(0)`` on ``fsdp`` and, for optimizer state under
``zero=1``, ``Shard(0)`` on ``dp``; with context parallelism the state is
``Replicate()`` on ``cp`` (``cp_shard=0``, Megatron-Core's layout), or
with ``cp_shard=1`` FSDP's dimension is torchtitan's ``dp_shard_cp``
(``fsdp`` flattened with ``cp``), which the spec reader must recognise
(``cp_shard_of``). The shards of dimension 0 are taken innermost first (tp, then
fsdp, then dp: right to left), which DTensor writes as
``_StridedShard(0, split_factor=k)`` on a mesh dimension with ``k`` shards
of dimension 0 to its right. Exact for two levels with any
sizes; three uneven levels (tp on dim 0, fsdp and zero together) have no
DTensor placement that gives nested ``torch.chunk``, so no case here has
them. Pipeline parallelism: DTensor replicates over ``pp``; only the
tensors of a rank's stage (ptcfs's ``rank_tensors``) are compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.presets import parse_model, with_optimizer
from ptcfs.plan.reshard import cut
from ptcfs.sharding import parse_config, rank_coords, rank_tensors
from ptcfs.types import MESH_DIMS, ModelSpec, ParallelConfig, ShardRule, TensorSpec

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN = 4, 256, 8, 2, 1000, 688
MODEL = (f"llama:layers={LAYERS},hidden={HIDDEN},heads={HEADS},kv_heads={KV_HEADS},"
         f"vocab={VOCAB},ffn={FFN},names=hf")
HOSTS = "h0:8"
CONFIGS = ["fsdp=4,tp=2", "pp=2,dp=2,zero=1,tp=2", "fsdp=2,cp=2,tp=2",
           "fsdp=2,cp=2,tp=2,cp_shard=1"]


def hf_llama() -> tuple[ModelSpec, dict[str, int | None]]:
    """LlamaForCausalLM's tensors by their Hugging Face names, and the
    dimension tensor parallelism splits in each (torchtitan's and HF's TP
    plan: column-parallel dim 0, row-parallel dim 1, norms replicated)."""
    hd = HIDDEN // HEADS
    tensors: list[tuple[str, tuple[int, ...], int | None, int | str]] = [
        ("model.embed_tokens.weight", (VOCAB, HIDDEN), 0, "first")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", (HIDDEN,), None, i),
            (p + "self_attn.q_proj.weight", (HEADS * hd, HIDDEN), 0, i),
            (p + "self_attn.k_proj.weight", (KV_HEADS * hd, HIDDEN), 0, i),
            (p + "self_attn.v_proj.weight", (KV_HEADS * hd, HIDDEN), 0, i),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * hd), 1, i),
            (p + "post_attention_layernorm.weight", (HIDDEN,), None, i),
            (p + "mlp.gate_proj.weight", (FFN, HIDDEN), 0, i),
            (p + "mlp.up_proj.weight", (FFN, HIDDEN), 0, i),
            (p + "mlp.down_proj.weight", (HIDDEN, FFN), 1, i),
        ]
    tensors += [("model.norm.weight", (HIDDEN,), None, "last"),
                ("lm_head.weight", (VOCAB, HIDDEN), 0, "last")]
    specs = tuple(TensorSpec(n, s, "fp16", ShardRule(split_dim=d, stage=st))
                  for n, s, d, st in tensors)
    model = ModelSpec("llama", LAYERS, specs, (("heads", HEADS), ("kv_heads", KV_HEADS)))
    return with_optimizer(model, "adam"), {n: d for n, _, d, _ in tensors}


HAND, TP_DIM = hf_llama()


def _preset() -> ModelSpec | None:
    """The llama preset, or None while ptcfs has none."""
    try:
        return parse_model(MODEL, dtype="fp16", optimizer="adam")
    except InvalidConfig as e:
        if "unknown model" in str(e):
            return None
        raise


PRESET = _preset()


def param_of(name: str) -> str:
    """``optim/<state>/<param>`` → ``<param>``."""
    return name.split("/", 2)[2] if name.startswith("optim/") else name


def ptcfs_shapes(cfg_text: str) -> dict[int, dict[str, tuple[int, ...]]]:
    """Every rank's sub-tensor shapes: ``ptcctl plan --shapes --json`` once the
    llama preset exists, the same library call on the hand-built model before."""
    if PRESET is None:
        cfg = parse_config(cfg_text, HOSTS)
        return {r: {s.name: sl.local_shape(s.shape) for s, sl in rank_tensors(HAND, cfg, r)}
                for r in range(cfg.world)}
    from ptcfs.client.cli.app import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--model", MODEL, "--optimizer", "adam", "--from", "tp=1",
                   "--from-hosts", HOSTS, "--to", cfg_text, "--to-hosts", HOSTS, "--shapes",
                   "--json"])
    assert rc == 0
    ranks = json.loads(out.getvalue())["ranks"]
    assert all(info["host"] == "h0" for info in ranks.values())
    return {int(r): {n: tuple(d) for n, d in info["tensors"].items()}
            for r, info in ranks.items()}


# --- DTensor's side -------------------------------------------------------------


def mesh_of(cfg: ParallelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The DeviceMesh's dimension names and sizes: ptcfs's, or with
    ``cp_shard=1`` as torchtitan builds its FSDP mesh, ``dp_shard_cp`` (fsdp
    flattened with cp)."""
    if not cfg.cp_shard:
        return MESH_DIMS, (cfg.pp, cfg.dp, cfg.fsdp, cfg.cp, cfg.tp)
    return ("pp", "dp", "dp_shard_cp", "tp"), (cfg.pp, cfg.dp, cfg.fsdp * cfg.cp, cfg.tp)


def placements(cfg: ParallelConfig, name: str) -> list[object]:
    """The DTensor placements of a tensor on the mesh :func:`mesh_of`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp_dim = TP_DIM[param_of(name)]
    zero = cfg.zero == 1 and name.startswith("optim/")
    names, shape = mesh_of(cfg)
    sizes = dict(zip(names, shape))
    # the tensor dimension each mesh dimension shards (None: replicated)
    dims = {"pp": None, "dp": 0 if zero else None, "fsdp": 0, "cp": None, "dp_shard_cp": 0,
            "tp": tp_dim}
    out: list[object] = []
    for i, m in enumerate(names):
        d = dims[m] if sizes[m] > 1 else None
        if d is None:
            out.append(Replicate())
            continue
        inner = 1
        for m2 in names[i + 1:]:
            if dims[m2] == d and sizes[m2] > 1:
                inner *= sizes[m2]
        out.append(Shard(d) if inner == 1 else _StridedShard(d, split_factor=inner))
    return out


def logical(shape: tuple[int, ...]) -> np.ndarray:
    """A logical tensor whose every element says where it is."""
    return np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)


#: The key of a worker's result that holds what the spec reader made of the
#: mesh: ``cp_shard_of`` a module of the rank's distributed parameters.
CP_SHARD = "<cp_shard>"


def _dtensor_worker(rank: int, world: int, store_path: str, out_dir: str,
                    jobs: list[tuple[str, list[tuple[str, tuple[int, ...]]]]]) -> None:
    """One rank: for each (configuration, tensors), distribute every logical
    tensor and write its local shard's shape and a digest of its values to
    ``out_dir/<rank>.json``: ``{config: {name: [shape, digest]}}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from ptcfs.client.torch.dtensor_spec import cp_shard_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        result: dict[str, dict[str, list]] = {}
        for cfg_text, specs in jobs:
            cfg = parse_config(cfg_text, HOSTS)
            names, shape = mesh_of(cfg)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            result[cfg_text] = {}
            module = torch.nn.Module()
            for name, shape in specs:
                full = torch.from_numpy(logical(shape))
                dt = distribute_tensor(full, mesh, placements(cfg, name))
                local = dt.to_local()
                digest = hashlib.sha1(local.contiguous().numpy().tobytes()).hexdigest()
                result[cfg_text][name] = [list(local.shape), digest]
                if not name.startswith("optim/"):
                    module.register_parameter(name.replace(".", "_"),
                                              torch.nn.Parameter(dt, requires_grad=False))
            degrees = dict(zip(MESH_DIMS, (cfg.pp, cfg.dp, cfg.fsdp, cfg.cp, cfg.tp)))
            result[cfg_text][CP_SHARD] = cp_shard_of(module, degrees)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dtensor_locals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """Run eight gloo ranks once for every configuration (all have 8 ranks):
    config → rank → ``{name: [local shape, digest]}``. The ranks are started
    from a fork server that imported torch once; every one is gone at the end."""
    import multiprocessing

    out = tmp_path_factory.mktemp("dtensor")
    cfgs = [parse_config(c, HOSTS) for c in CONFIGS]
    world = cfgs[0].world
    assert all(c.world == world for c in cfgs)
    jobs = [(text, [(s.name, s.shape) for s in HAND.tensors_for(c.pp)])
            for text, c in zip(CONFIGS, cfgs)]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", __name__])
    procs = [ctx.Process(target=_dtensor_worker,
                         args=(r, world, str(out / "store"), str(out), jobs), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"DTensor ranks exited with {codes}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    ranks = {r: json.loads((out / f"{r}.json").read_text()) for r in range(world)}
    return {c: {r: v[c] for r, v in ranks.items()} for c in CONFIGS}


# --- the tests ----------------------------------------------------------------------


def test_placements_give_nested_torch_chunks() -> None:
    """The placement mapping, checked without processes: DTensor's local shape
    and first offset for every mesh coordinate are those of
    ``torch.chunk(torch.chunk(x, tp)[t], fsdp)[f]``, for sizes FSDP leaves
    uneven or empty."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    def chunk(x: torch.Tensor, parts: int, i: int) -> torch.Tensor:
        c = torch.chunk(x, parts) if len(x) else ()
        return c[i] if i < len(c) else x[:0]

    for n in range(1, 41):
        for tp in (1, 2, 4):
            if n % tp:
                continue
            for fsdp in (2, 3, 4, 8):
                x = torch.arange(n)
                for t in range(tp):
                    for f in range(fsdp):
                        want = chunk(chunk(x, tp, t), fsdp, f)
                        pl = [_StridedShard(0, split_factor=tp) if tp > 1 else Shard(0), Shard(0)]
                        shape, offset = _compute_local_shape_and_global_offset(
                            (n,), (fsdp, tp), [f, t], pl)
                        assert shape == (len(want),), (n, tp, fsdp, t, f)
                        if len(want):
                            assert offset == (int(want[0]),), (n, tp, fsdp, t, f)


def test_llama_tensors_are_hugging_face_llamas() -> None:
    """Once the preset exists: its tensors are LlamaForCausalLM's (names,
    shapes, dtypes) with Adam's state, and its TP split dims are HF's plan."""
    if PRESET is None:
        pytest.skip("ptcfs has no llama preset yet; the hand-built model stands in")
    got = {s.name: (s.shape, s.dtype) for s in PRESET.tensors_for(1)}
    want = {s.name: (s.shape, s.dtype) for s in HAND.tensors_for(1)}
    assert got == want
    for s in PRESET.tensors_for(1):
        assert s.rule.split_dim == TP_DIM[param_of(s.name)], s.name


@pytest.mark.slow
@pytest.mark.parametrize("cfg_text", CONFIGS)
def test_rank_shapes_are_dtensor_local_shapes(cfg_text: str, dtensor_locals: dict) -> None:
    cfg = parse_config(cfg_text, HOSTS)
    ours = ptcfs_shapes(cfg_text)
    theirs = dtensor_locals[cfg_text]
    # the spec reader takes the layout from the module: dp_shard_cp is cp_shard=1
    assert {theirs[r][CP_SHARD] for r in theirs} == {cfg.cp_shard}
    specs = HAND.tensors_for(cfg.pp)

    def stage(st: int | str) -> int:
        return 0 if st == "first" else cfg.pp - 1 if st == "last" else int(st) * cfg.pp // LAYERS

    for c in rank_coords(cfg):
        rank = c.rank
        want = {s.name for s in specs if stage(s.rule.stage) == c.pp_rank}
        assert set(ours[rank]) == want, f"rank {rank} holds another stage's tensors"
        for name, shape in ours[rank].items():
            dshape, digest = theirs[rank][name]
            assert shape == tuple(dshape), (
                f"rank {rank} {name}: ptcfs {shape}, DTensor {tuple(dshape)} "
                f"with {placements(cfg, name)}")
        # the values too: ptcfs's sub-tensor is DTensor's local shard
        for spec, sl in rank_tensors(HAND, cfg, rank):
            as_int = dataclasses.replace(spec, dtype="int32")
            mine = hashlib.sha1(cut(as_int, sl, logical(spec.shape)).tobytes()).hexdigest()
            assert mine == theirs[rank][spec.name][1], f"rank {rank} {spec.name} [{sl.key()}]"


def test_the_spec_reader_takes_either_layout_over_cp() -> None:
    """``spec_from_module`` on one process of a fake 8-rank group: FSDP on
    ``dp_shard`` with the state replicated over ``cp`` is ``cp_shard=0``
    (Megatron-Core's layout), FSDP on torchtitan's ``dp_shard_cp`` is
    ``cp_shard=1``; a module with both, or sharded over ``cp``, is refused in
    one line naming the parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ptcfs.client.torch.dtensor_spec import config_of, spec_from_module
    from ptcfs.types import Host

    def module(**params: tuple[object, list[object]]) -> torch.nn.Module:
        m = torch.nn.Module()
        for name, (mesh, pls) in params.items():
            t = distribute_tensor(torch.zeros(8, 4), mesh, pls)
            m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        return m

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        flat = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard_cp", "tp"))
        replicas = [Shard(0), Replicate(), Shard(1)]
        hosts = (Host("h0", 8),)
        _, deg = spec_from_module(module(w=(mesh, replicas), b=(mesh, replicas)), mesh)
        assert deg.cp_shard == 0 and config_of(deg, hosts).fsdp_shards == 2
        _, deg = spec_from_module(module(w=(flat, [Shard(0), Shard(1)]),
                                         b=(flat, [Shard(0), Replicate()])), mesh)
        cfg = config_of(deg, hosts)
        assert (deg.cp_shard, cfg.cp_shard, cfg.fsdp_shards) == (1, 1, 4)
        assert cfg.degrees_text() == "tp=2,pp=1,dp=1,fsdp=2,cp=2,cp_shard=1"
        for bad, what in ((module(w=(flat, [Shard(0), Shard(1)]), b=(mesh, replicas)), "b "),
                          (module(w=(mesh, [Shard(0), Shard(0), Shard(1)])), "over cp")):
            with pytest.raises(InvalidConfig) as e:
                spec_from_module(bad, mesh)
            assert what in str(e.value) and "\n" not in str(e.value)
    finally:
        dist.destroy_process_group()
