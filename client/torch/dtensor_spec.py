"""A job's model spec and mesh degrees from a live module parallelized on a DeviceMesh.

A module sharded with FSDP2 (``fully_shard``) and/or tensor parallelism
(``parallelize_module``) carries everything ptcfs needs: each parameter's
name, logical shape and dtype, and its DTensor placements on named mesh
dimensions. :func:`spec_from_module` turns them into a
:class:`~ptcfs.types.ModelSpec` and the mesh degrees, so a torchtitan-style
model needs no preset.

Mesh dimensions are named as torchtitan names them, or as ptcfs does
(:data:`MESH_NAMES`): ``pp``; ``dp_replicate`` or ``dp`` (replicas: ptcfs's
``dp``); ``dp_shard`` or ``fsdp`` (FSDP2's shards: ``fsdp``); ``cp``; ``tp``.
They must come in ptcfs's order ``pp, dp, fsdp, cp, tp`` (any may be
missing), with the ranks in row-major order, as ``init_device_mesh`` builds
them. A parameter's placements map to a rule:

- ``Shard(d)`` on ``tp``: ``split_dim = d``; ``Replicate()``: no split;
- on ``fsdp``: ``Shard(0)``, or ``_StridedShard(0, split_factor=tp)`` when
  tensor parallelism splits dimension 0 too (FSDP2's layout of a TP
  tensor); a mesh with ``fsdp > 1`` needs every parameter sharded so;
- with ``cp > 1``, either of FSDP's two layouts
  (:attr:`~ptcfs.types.ParallelConfig.fsdp_shards`): FSDP on ``fsdp``
  (``dp_shard``) alone, the context-parallel ranks keeping replicas
  (``cp_shard=0``, as Megatron-Core's context parallelism keeps them), or
  the same placement on the flattened dimension torchtitan names
  ``dp_shard_cp`` (``fsdp * cp`` ranks: ``cp_shard=1``, which
  :func:`spec_from_module` records in the degrees when any parameter is
  sharded so and :func:`config_of` puts in the configuration);
- ``Replicate()`` on ``pp``, ``dp`` and ``cp``.

Anything else (``Partial``, FSDP2's ``shard_placement_fn`` on another
dimension, a shard over ``dp`` or ``cp``, some modules sharded on
``dp_shard_cp`` and others on ``dp_shard``, tensor parallelism that does
not divide the dimension) is refused with one line naming the parameter
and what to change.
Pipeline stages: a tensor's layer is the first dotted number of its name
(``model.layers.3.mlp...``); tensors before the first layer are on the
first stage, those after the last layer on the last stage. On a mesh with
``pp > 1`` each rank's module holds its own stage only, as torchtitan's
pipeline split leaves it (the layers it keeps under their global numbers,
the embedding on the first stage, the final norm and output on the last):
:func:`spec_from_module` gathers the stages' parameters over the ``pp``
dimension, so every rank gets the whole model's spec, and the degrees it
returns carry each stage's layer count (``pp_layers``), which
:func:`config_of` puts in the configuration.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ptcfs.client.torch.state import DTYPE_NAMES
from ptcfs.errors import InvalidConfig
from ptcfs.model.modelkit import with_optimizer
from ptcfs.sharding import pipeline_split, rank_of, validate
from ptcfs.types import MESH_DIMS, Host, ModelSpec, ParallelConfig, ShardRule, Stage, TensorSpec

__all__ = ["FSDP_CP", "MESH_NAMES", "Degrees", "Modules", "config_of", "cp_shard_of",
           "mesh_degrees", "mesh_rank", "module_parameters", "optimizer_name",
           "spec_from_module", "split_dim_of"]

#: A rank's model: one module, or its model parts (a pipeline stage's
#: chunks, as torchtitan's ``model_parts`` holds them for interleaved schedules).
Modules = torch.nn.Module | Sequence[torch.nn.Module]

#: Mesh dimension names (torchtitan's and ptcfs's) → the ptcfs degree they are.
MESH_NAMES: dict[str, str] = {"pp": "pp", "dp_replicate": "dp", "dp": "dp", "dp_shard": "fsdp",
                              "fsdp": "fsdp", "cp": "cp", "tp": "tp"}

#: A parameter mesh's dimension for FSDP over ``fsdp * cp`` (torchtitan's name).
FSDP_CP = "dp_shard_cp"

_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


class Degrees(dict[str, int]):
    """A mesh's degrees ``{"pp", "dp", "fsdp", "cp", "tp"}``, with each
    pipeline stage's layer count where the module's stages say it
    (``pp_layers``; empty: the layers split evenly) and, for an interleaved
    pipeline, its virtual stages (``vpp``; ``pp_layers`` then counts each
    chunk's layers) and, for FSDP over ``fsdp * cp`` (``dp_shard_cp``),
    ``cp_shard=1``."""

    pp_layers: tuple[int, ...] = ()
    vpp: int = 1
    cp_shard: int = 0


def _degree_names(names: tuple[str, ...] | None, what: str) -> list[str]:
    if names is None:
        raise InvalidConfig(f"{what} has no dimension names; build it with "
                            "init_device_mesh(..., mesh_dim_names=(...))")
    out = []
    for n in names:
        if n not in MESH_NAMES:
            raise InvalidConfig(
                f"{what}: mesh dimension {n!r} is not one ptcfs knows; use "
                + ", ".join(f"{k} ({v})" if k != v else k for k, v in MESH_NAMES.items()))
        out.append(MESH_NAMES[n])
    return out


def mesh_degrees(mesh: Any) -> Degrees:
    """The degrees ``{"pp", "dp", "fsdp", "cp", "tp"}`` of a DeviceMesh, each 1
    when the mesh has no such dimension (all 1 for ``None``: a module on one
    process); InvalidConfig when its dimensions or rank order are not ptcfs's."""
    if mesh is None:
        return Degrees(dict.fromkeys(MESH_DIMS, 1))
    dims = _degree_names(mesh.mesh_dim_names, "the mesh")
    order = [MESH_DIMS.index(d) for d in dims]
    if order != sorted(set(order)):
        raise InvalidConfig(f"mesh dimensions {list(mesh.mesh_dim_names)} are not in ptcfs's "
                            "order pp, dp_replicate, dp_shard, cp, tp (each at most once)")
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(len(ranks))):
        raise InvalidConfig(f"the mesh's ranks {ranks[:8]} are not 0..{len(ranks) - 1} in "
                            "row-major order; use the whole world in init_device_mesh's order")
    out = Degrees(dict.fromkeys(MESH_DIMS, 1))
    for d, size in zip(dims, mesh.mesh.shape):
        out[d] = int(size)
    return out


def config_of(degrees: Mapping[str, int], hosts: tuple[Host, ...]) -> ParallelConfig:
    """The configuration of mesh ``degrees`` on ``hosts`` (with their stages'
    layer counts and FSDP's layout where they are :class:`Degrees` that
    carry them)."""
    return ParallelConfig(degrees["tp"], degrees["pp"], degrees["dp"], hosts,
                          fsdp=degrees["fsdp"], cp=degrees["cp"],
                          pp_layers=getattr(degrees, "pp_layers", ()),
                          vpp=getattr(degrees, "vpp", 1),
                          cp_shard=getattr(degrees, "cp_shard", 0))


def mesh_rank(mesh: Any) -> int:
    """This process's rank in the job: its mesh coordinates in ptcfs's order
    (0 for ``None``: a module on one process)."""
    if mesh is None:
        return 0
    deg = mesh_degrees(mesh)
    coord = dict(zip(_degree_names(mesh.mesh_dim_names, "the mesh"), mesh.get_coordinate()))
    return rank_of(config_of(deg, (Host("any", 1),)), coord.get("tp", 0), coord.get("dp", 0),
                   coord.get("pp", 0), coord.get("fsdp", 0), coord.get("cp", 0))


def _clean(name: str) -> str:
    """A parameter name as the state dict names it: DDP's leading ``module.``,
    torch.compile's and activation checkpointing's wrappers dropped."""
    parts = [p for p in name.split(".") if p not in _WRAPPERS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def model_parts(module: Modules) -> list[torch.nn.Module]:
    """A rank's modules: ``module`` alone, or its model parts."""
    return [module] if isinstance(module, torch.nn.Module) else list(module)


def module_parameters(module: Modules) -> dict[str, torch.nn.Parameter]:
    """The parameters of a module (or of model parts) by state-dict name
    (shared ones once); InvalidConfig where two parts have one name."""
    out: dict[str, torch.nn.Parameter] = {}
    for part in model_parts(module):
        for n, p in part.named_parameters():
            n = _clean(n)
            if out.get(n, p) is not p:
                raise InvalidConfig(f"two model parts have a parameter {n}: each part must "
                                    "hold its own layers, by their global names")
            out[n] = p
    return out


def cp_shard_of(module: Modules, degrees: Mapping[str, int]) -> int:
    """FSDP's layout in ``module``: 1 where ``cp > 1`` and a parameter is
    sharded on the flattened ``dp_shard_cp`` dimension (torchtitan), else 0
    (context-parallel replicas); :func:`split_dim_of` checks every parameter
    against it."""
    from torch.distributed.tensor import DTensor

    if degrees["cp"] == 1:
        return 0
    return int(any(isinstance(p, DTensor) and FSDP_CP in (p.device_mesh.mesh_dim_names or ())
                   for p in module_parameters(module).values()))


def split_dim_of(name: str, param: torch.Tensor, degrees: Mapping[str, int]) -> int | None:
    """The tensor-parallel split dimension of one parameter (see the module
    docstring), checked against the mesh ``degrees`` (and their ``cp_shard``
    where they are :class:`Degrees`)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    cp, cp_shard = degrees["cp"], getattr(degrees, "cp_shard", 0)
    shards = degrees["fsdp"] * cp if cp_shard else degrees["fsdp"]
    over = f"fsdp*cp={shards} ({FSDP_CP})" if cp_shard else f"fsdp={shards}"
    if not isinstance(param, DTensor):
        if shards > 1 and param.dim() > 0:
            raise InvalidConfig(f"{name} is a plain tensor but the mesh has {over}: apply "
                                "fully_shard to the module that holds it (ptcfs shards "
                                "every tensor over FSDP's ranks)")
        return None
    mesh = param.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    dims = [FSDP_CP if n == FSDP_CP else _degree_names((n,), f"{name}'s mesh")[0]
            for n in names] if FSDP_CP in names else \
        _degree_names(mesh.mesh_dim_names, f"{name}'s mesh")
    sizes = {**degrees, FSDP_CP: degrees["fsdp"] * cp}
    where = f"{name} {tuple(param.placements)} on {names}"
    tp_dim: int | None = None
    strided: int | None = None  # FSDP's split factor; 1: Shard(0); None: not sharded
    for d, size, pl in zip(dims, mesh.mesh.shape, param.placements):
        if int(size) != sizes[d]:
            raise InvalidConfig(f"{where}: its {d} dimension has {int(size)} ranks, the mesh "
                                f"{sizes[d]}; pass the mesh the module was parallelized on")
        if pl.is_replicate():
            continue
        if not isinstance(pl, Shard | _StridedShard):
            raise InvalidConfig(f"{where}: ptcfs keeps whole values, not {pl} (reduce it "
                                "before saving)")
        if d == "tp" and isinstance(pl, Shard):
            tp_dim = int(pl.dim)
        elif d == "fsdp" and cp_shard:
            raise InvalidConfig(f"{where}: other parameters are sharded on {FSDP_CP} "
                                "(cp_shard=1); apply fully_shard on one mesh to every module")
        elif d == FSDP_CP and cp > 1 and not cp_shard:
            raise InvalidConfig(f"{where}: sharded on {FSDP_CP}, but the degrees say "
                                "cp_shard=0 (context-parallel replicas); take them from "
                                "spec_from_module")
        elif d in ("fsdp", FSDP_CP) and pl.dim == 0:
            strided = int(pl.split_factor) if isinstance(pl, _StridedShard) else 1
        elif d == "tp":
            raise InvalidConfig(f"{where}: tensor parallelism must be Shard(d), not {pl}")
        elif d in ("fsdp", FSDP_CP):
            raise InvalidConfig(f"{where}: ptcfs's FSDP shards dimension 0 (drop "
                                "fully_shard's shard_placement_fn)")
        else:
            raise InvalidConfig(f"{where}: ptcfs replicates model state over {d}; shard "
                                f"over the fsdp (dp_shard, or {FSDP_CP}) dimension only")
    if strided is None:
        if shards > 1 and param.dim() > 0:
            raise InvalidConfig(f"{where}: not sharded over {over}; apply "
                                "fully_shard to the module that holds it")
        return tp_dim
    want = degrees["tp"] if tp_dim == 0 else 1
    if strided != want:
        shown = "Shard(0)" if want == 1 else f"_StridedShard(0, split_factor={want})"
        raise InvalidConfig(f"{where}: FSDP's placement must be {shown} (fsdp shards what "
                            "tensor parallelism leaves); apply parallelize_module before "
                            "fully_shard")
    return tp_dim


def _stages(names: list[str]) -> tuple[list[Stage], int]:
    """Each name's stage (see the module docstring) and the layer count."""
    layers = [int(m.group(1)) if (m := _LAYER.search(n)) else None for n in names]
    known = [i for i, v in enumerate(layers) if v is not None]
    first = known[0] if known else len(names)
    out: list[Stage] = []
    for i, v in enumerate(layers):
        out.append(v if v is not None else ("first" if i < first else "last"))
    return out, 1 + max((v for v in layers if v is not None), default=0)


def optimizer_name(optimizer: torch.optim.Optimizer | str | None) -> str:
    if optimizer is None:
        return "none"
    if isinstance(optimizer, str):
        return optimizer
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    raise InvalidConfig(f"ptcfs keeps Adam state; {type(optimizer).__name__} is not "
                        "torch.optim.Adam or AdamW")


def spec_from_module(module: Modules, mesh: Any, *,
                     optimizer: torch.optim.Optimizer | str | None = None,
                     dtype: str | None = None, name: str | None = None,
                     tp_divides: Mapping[str, int] | None = None
                     ) -> tuple[ModelSpec, Degrees]:
    """The job's model spec and mesh degrees from ``module``, parallelized on
    ``mesh`` (the whole mesh, not a sub-mesh; None: a plain module on one
    process): names, logical shapes and
    dtypes (``dtype`` overrides them, e.g. ``"bf16"`` for a job that keeps
    bf16 parameters and fp32 masters of an fp32 FSDP2 module), split
    dimensions from the placements, stages from the names; the state of
    ``optimizer`` (Adam, AdamW or their names) added; ``tp_divides`` such as
    ``{"heads": 16}`` recorded for validation. The degrees are
    ``{"pp", "dp", "fsdp", "cp", "tp"}`` (with the stages' layer counts when
    ``pp > 1``, a collective over the ``pp`` dimension then, and
    ``cp_shard`` from :func:`cp_shard_of`); :func:`config_of`
    makes them a configuration on hosts. ``module`` may be a rank's model
    parts (a list): an interleaved pipeline's chunks, whose layers go round
    the stages, give ``vpp`` and each chunk's layer count."""
    degrees = mesh_degrees(mesh)
    mine: tuple[int, list[_Param]] | str
    try:
        degrees.cp_shard = cp_shard_of(module, degrees)
        mine = (degrees.cp_shard, _parameters(module, degrees, dtype))
    except InvalidConfig as e:
        mine = str(e)
    stages: list[list[_Param]] = []
    layouts: set[int] = set()
    for part in _gather_stages(mesh, mine) if degrees["pp"] > 1 else [mine]:
        if isinstance(part, str):  # raised on every rank, after the collective
            raise InvalidConfig(part)
        layouts.add(part[0])
        stages.append(part[1])
    if len(layouts) > 1:
        raise InvalidConfig(f"some pipeline stages shard FSDP on {FSDP_CP} and others on "
                            "dp_shard: apply fully_shard on one mesh in every stage")
    degrees.cp_shard = layouts.pop()
    if degrees["pp"] > 1:
        degrees.vpp, degrees.pp_layers = _stage_layers(stages)
    params = [p for part in stages for p in part]
    if degrees.vpp > 1:  # the stages' chunks interleave: back to model order
        head = [p for p in stages[0] if _LAYER.search(p[0]) is None]
        params = head + sorted(params[len(head):], key=_model_order)
    if not params:
        raise InvalidConfig(f"{_kind(module)} has no parameters")
    kinds, layers = _stages([p[0] for p in params])
    tensors = [TensorSpec(n, shape, dt, ShardRule(split_dim=split, stage=stage))
               for (n, shape, dt, split), stage in zip(params, kinds)]
    model = ModelSpec(name or _kind(module), layers, tuple(tensors),
                      tuple((tp_divides or {}).items()))
    model = with_optimizer(model, optimizer_name(optimizer))
    validate(model, config_of(degrees, (Host("any", 1 << 30),)))
    return model, degrees


#: One parameter as a stage reports it: name, logical shape, dtype, split dimension.
_Param = tuple[str, tuple[int, ...], str, int | None]


def _model_order(p: _Param) -> float:
    """Where a tensor after the first stage's head goes in model order: its
    layer's place; the last stage's tensors without a layer after them all."""
    m = _LAYER.search(p[0])
    return int(m.group(1)) if m else math.inf


def _kind(module: Modules) -> str:
    return type(model_parts(module)[0]).__name__ if model_parts(module) else "model"


def _parameters(module: Modules, degrees: Mapping[str, int],
                dtype: str | None) -> list[_Param]:
    out = []
    for n, p in module_parameters(module).items():
        if p.dtype not in DTYPE_NAMES:
            raise InvalidConfig(f"{n}: dtype {p.dtype} has no ptcfs equivalent")
        out.append((n, tuple(p.shape), dtype or DTYPE_NAMES[p.dtype],
                    split_dim_of(n, p, degrees)))
    return out


def _gather_stages(mesh: Any, mine: tuple[int, list[_Param]] | str
                   ) -> list[tuple[int, list[_Param]] | str]:
    """Every pipeline stage's parameters (or the error it met), in stage
    order, on every rank: the ranks of this rank's ``pp`` group report."""
    import torch.distributed as dist

    pp = mesh.mesh_dim_names[_degree_names(mesh.mesh_dim_names, "the mesh").index("pp")]
    group = mesh[pp].get_group()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def _stage_layers(stages: list[list[_Param]]) -> tuple[int, tuple[int, ...]]:
    """``(vpp, pp_layers)``, checked: the stages hold consecutive layers in
    order (or chunks of them going round the stages), every tensor once,
    and tensors without a layer only on the first stage (before its
    layers) or the last (after its layers)."""
    seen: dict[str, int] = {}
    held: list[set[int]] = []
    for s, part in enumerate(stages):
        numbers = []
        for n, *_ in part:
            if n in seen:
                raise InvalidConfig(f"{n} is on pipeline stages {seen[n]} and {s}: each "
                                    "stage's module must hold its own layers only, and ptcfs "
                                    "keeps one copy of each tensor (untie weights that stages "
                                    "share)")
            seen[n] = s
            m = _LAYER.search(n)
            if m is not None:
                numbers.append(int(m.group(1)))
            elif s == len(stages) - 1 or (s == 0 and not numbers):
                continue
            else:
                raise InvalidConfig(f"{n} has no layer number but is on pipeline stage {s}"
                                    + (" after its layers" if s == 0 else "")
                                    + ": such tensors go before the first stage's layers or "
                                    "on the last stage")
        held.append(set(numbers))
    return pipeline_split(held)
