"""DeepSpeed pipeline-parallel checkpoints: a ``PipelineModule`` trained by
``PipelineEngine`` with ZeRO-1 (the ``deepspeed`` format reads and writes
them beside the data-parallel ones of :mod:`ptcfs.client.formats.zero`).

Layout (``PipelineModule.save_state_dict`` and ``engine._save_checkpoint``;
``S`` the pipeline stage, which DeepSpeed calls the model-parallel rank)::

    DIR/latest                                        "global_step<N>"
    DIR/global_step<N>/layer_<LL>-model_states.pt     layer LL's state_dict (every
                                                      layer of the module, by its
                                                      global index; {} without parameters)
    DIR/global_step<N>/mp_rank_<SS>_model_states.pt   module None; param_shapes: the
                                                      stage's parameters ("<LL>.weight")
    DIR/global_step<N>/[bf16_]zero_pp_rank_<r>_mp_rank_<SS>_optim_states.pt

Each stage's optimizer states are ZeRO-1's at the data-parallel degree
(:mod:`ptcfs.client.formats.zero_layout`), over that stage's parameters
only. A job's tensors are named ``layers.<LL>.<name>`` (the module's
``<LL>.<name>``), each owned by its layer's stage; the job has as many
layers as the module (the highest layer file's index + 1) and its mesh is
``pp=<stages>,dp=<N>,zero=1``, with ``pp_layers`` where DeepSpeed's
uniform cut would not give each stage the layers its parameters are in.

An export writes the job's pp and ``dp * fsdp`` (tp, cp and vpp must be 1),
cutting the layers as the job does; DeepSpeed's ``PipelineModule`` must cut
them the same way to load it (``partition_method="uniform"`` is the job's
even cut). Not read: tensor-parallel pipelines (``layer_00-model_01-...``),
tied layers, buffers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions, zero
from ptcfs.client.formats.common import Source, torch_load
from ptcfs.client.formats.zero import allowed, finish, flats_of, model_states, optim, tag_dir
from ptcfs.client.formats.zero_layout import (
    LATEST,
    LAYER_FILE,
    PARAM,
    layer_name,
    model_name,
    optim_name,
)
from ptcfs.client.formats.zero_write import common, optim12, prepare
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.hfmodels import with_param
from ptcfs.sharding import pp_layers_of, stage_layers, stage_of

__all__ = ["read", "write", "is_pipe", "is_pipe_job", "read_pipe", "write_pipe", "job_name",
           "ds_name"]

_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def is_pipe(d: Path) -> bool:
    """Whether the tag directory ``d`` holds a pipeline's layer files."""
    return any(d.glob("layer_*"))


def job_name(ds: str, where: str) -> str:
    """``layers.<LL>.<name>`` of the module's parameter ``<LL>.<name>``."""
    idx, _, rest = ds.partition(".")
    if not idx.isdigit() or not rest:
        raise CheckpointError(f"{where}: parameter {ds!r} is not named '<layer>.<name>' as a "
                              "PipelineModule names its layers' parameters")
    return f"layers.{int(idx)}.{rest}"


def ds_name(name: str) -> tuple[int, str]:
    """The layer and the module's name (``<LL>.<name>``) of job tensor ``name``."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise CheckpointError(f"tensor {name!r} is not named layers.<index>.<name>: a DeepSpeed "
                              "pipeline checkpoint needs each parameter's layer (reconfigure "
                              "the job to pp=1 for a ZeRO one)")
    return int(m[1]), f"{int(m[1])}.{m[2]}"


def _layers(d: Path, trust: bool) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted(d.glob("layer_*")):
        m = re.fullmatch(LAYER_FILE, f.name)
        if m is None:
            raise CheckpointError(f"{f}: a tensor-parallel pipeline layer file; only pipelines "
                                  "without tensor parallelism are read")
        sd = torch_load(f, trust, allowed())
        if not isinstance(sd, dict):
            raise CheckpointError(f"{f}: not a layer's state_dict")
        out[int(m[1])] = sd
    return out


def _stages(d: Path) -> int:
    found = sorted(int(m[1]) for f in d.glob("mp_rank_*_model_states.pt")
                   if (m := re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", f.name)))
    if not found or found != list(range(len(found))):
        raise CheckpointError(f"{d}: pipeline stages' model states {found}; need "
                              f"{model_name(None)} and one for each following stage")
    return len(found)


def _cut(held: list[set[int]], layers: int) -> tuple[int, ...]:
    """``pp_layers`` of stages holding the parameters of layers ``held``
    (empty where the even cut, DeepSpeed's uniform one, does)."""
    pp = len(held)
    even = stage_layers(layers, pp)
    if all(h <= set(r) for h, r in zip(held, even, strict=True)):
        return ()
    firsts = [min(h) if h else None for h in held]
    starts = [0] + [f for f in firsts[1:] if f is not None]
    if len(starts) != pp:
        raise CheckpointError("a pipeline stage holds no parameters")
    counts = [b - a for a, b in zip(starts, [*starts[1:], layers], strict=True)]
    pp_layers_of([set(range(a, a + n)) for a, n in zip(starts, counts, strict=True)])
    return tuple(counts)


def read_pipe(d: Path, options: ReadOptions) -> Source:
    """A :class:`Source` from the pipeline checkpoint in tag directory ``d``."""
    where = str(d)
    pp = _stages(d)
    layer_sd = _layers(d, options.trust)
    layers = max(layer_sd) + 1 if layer_sd else 0
    merged: dict[str, Any] = {}
    flats: dict[str, dict[str, torch.Tensor]] = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    held: list[set[int]] = []
    groups: list[Any] = []
    head: dict[str, Any] = {}
    steps: list[float] = []
    for s in range(pp):
        ms, stage = model_states(d, options.trust, s)
        if stage != 1:
            raise CheckpointError(f"{d / model_name(None, s)}: ZeRO stage {stage}; a pipeline "
                                  "checkpoint is read with ZeRO-1")
        if not merged:
            merged = {**ms, "param_shapes": [OrderedDict() for _ in ms["param_shapes"]]}
        optims, _ = optim(d, int(ms["dp_world_size"]), options.trust, s)
        for kind, by in flats_of(ms, optims, 1, where).items():
            flats[kind].update({job_name(n, where): t for n, t in by.items()})
        held.append(set())
        for g, shapes in enumerate(ms["param_shapes"]):
            if g >= len(merged["param_shapes"]):
                raise CheckpointError(f"{d / model_name(None, s)}: {len(ms['param_shapes'])} "
                                      "optimizer groups, stage 0 has fewer")
            for n, shape in shapes.items():
                name = job_name(n, where)
                held[-1].add(int(n.partition(".")[0]))
                merged["param_shapes"][g][name] = shape
        inner = optims[0].get("base_optimizer_state", {})
        if s == 0:
            head, groups = optims[0], inner.get("param_groups", [])
        steps += [float(v["step"]) for v in (inner.get("state") or {}).values() if "step" in v]
    module = {}
    for name in (n for g in merged["param_shapes"] for n in g):
        layer, ds = ds_name(name)
        key = ds.partition(".")[2]
        if layer not in layer_sd:
            raise CheckpointError(f"{d / layer_name(layer)}: missing; the pipeline checkpoint "
                                  f"needs each layer's file (parameter {ds})")
        if key not in layer_sd[layer]:
            raise CheckpointError(f"{d / layer_name(layer)}: no {key!r}, which the optimizer "
                                  f"states hold ({ds})")
        module[name] = layer_sd[layer][key]
    extra = sorted(f"{i}.{k}" for i, sd in layer_sd.items() for k in sd
                   if f"layers.{i}.{k}" not in module)
    if extra:
        raise CheckpointError(f"{d / layer_name(int(extra[0].partition('.')[0]))}: holds "
                              f"{extra[0]}, which no stage's optimizer updates (buffers and "
                              "frozen parameters are not carried)")
    merged["module"] = module
    src = finish(merged, 1, flats, head, groups, steps[0] if steps else None, options, where)
    return _staged(src, layers, _cut(held, layers), pp, int(merged["dp_world_size"]))


def _staged(src: Source, layers: int, cut: tuple[int, ...], pp: int, dp: int) -> Source:
    """``src`` with each parameter owned by its layer's stage and the mesh
    that the pipeline was saved under."""
    if src.spec is None:
        raise CheckpointError("a DeepSpeed pipeline checkpoint without a model spec")
    params = dict(src.spec.params)
    rec = json.loads(str(params[PARAM]))
    rec["pipeline"] = True
    tensors = tuple(dataclasses.replace(t, rule=dataclasses.replace(
        t.rule, stage=ds_name(t.name)[0])) for t in src.spec.tensors)
    spec = with_param(dataclasses.replace(src.spec, layers=layers, tensors=tensors), PARAM,
                      json.dumps(rec, sort_keys=True))
    text = f"pp_layers={':'.join(map(str, cut))}," if cut else ""
    return dataclasses.replace(src, spec=spec, native=f"pp={pp},{text}dp={dp},zero=1")


def is_pipe_job(state: JobState) -> bool:
    """Whether the job is written as a pipeline: pp > 1, or it was read from one."""
    rec = json.loads(str(dict(state.model_spec().params).get(PARAM, "{}")))
    return state.config.pp > 1 or bool(rec.get("pipeline"))


def write_pipe(coord: Coordinator, state: JobState, path: Path,
               progress: bool | None = None, notes: list[str] | None = None) -> Path:
    """``path/latest`` and ``path/global_step<N>/`` as ``PipelineEngine``
    saves the job at its pp and data-parallel degree; the tag directory."""
    c = state.config
    if c.vpp != 1:
        raise CheckpointError(f"job {state.job!r} is at {state.describe()}: DeepSpeed's "
                              "pipeline has no virtual stages; reconfigure it to vpp=1 first")
    model = state.model_spec()
    stage = {t.name: stage_of(t.rule, model.layers, c.pp, c.pp_layers) for t in model.tensors}
    rename = {t.name: ds_name(t.name)[1] for t in model.tensors if not t.is_optim}
    p = prepare(coord, state, progress, notes, pipe=True)
    if p.stage != 1 and notes is not None:
        notes.append(f"the job recorded ZeRO-{p.stage}; a pipeline checkpoint is ZeRO-1")
    by_stage = [[(g, [dataclasses.replace(t, name=rename[t.name]) for t in ps
                      if stage[t.name] == s]) for g, ps in p.groups] for s in range(c.pp)]
    for s, groups in enumerate(by_stage):
        if not all(ps for _, ps in groups):
            raise CheckpointError(f"pipeline stage {s} of job {state.job!r} at "
                                  f"{state.describe()} holds no parameter of an optimizer "
                                  "group; DeepSpeed's ZeRO-1 needs every group on every stage")
    values = {k: {rename[n]: t for n, t in v.items()} for k, v in p.values.items()}
    head = {**p.head, "zero_stage": 1}
    cfg = {**p.cfg, "zero_optimization": {**(p.cfg.get("zero_optimization") or {}), "stage": 1}}
    tag = f"global_step{state.step}"
    out = path / tag
    out.mkdir(parents=True, exist_ok=True)
    layer_sd: list[OrderedDict[str, torch.Tensor]] = [OrderedDict() for _ in range(model.layers)]
    for name, ds in rename.items():
        idx, _, key = ds.partition(".")
        layer_sd[int(idx)][key] = p.values["weight"][name]
    for i, sd in enumerate(layer_sd):
        torch.save(sd, out / layer_name(i))
    for s, groups in enumerate(by_stage):
        ms = common(state, p.rec, cfg, p.dp, groups, None)  # type: ignore[arg-type]
        ms.update(mp_world_size=c.pp, checkpoint_parallel_dimensions={"pp_degree": c.pp,
                                                                      "tp_degree": 1})
        torch.save(ms, out / model_name(None, s))
        for r, rk in enumerate(optim12(values, groups, p.dp, p.step)):
            osd = {**head, **rk, "ds_version": p.version}
            torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": p.version},
                       out / optim_name(r, state.dtype == "bf16", s))
    (path / LATEST).write_text(tag)
    return out


def read(path: Path, options: ReadOptions) -> Source:
    """The ``deepspeed`` row of :data:`ptcfs.client.formats.FORMATS`: a
    pipeline checkpoint, or a data-parallel one (:mod:`ptcfs.client.formats.zero`)."""
    d = tag_dir(path)
    return read_pipe(d, options) if is_pipe(d) else zero.read(path, options)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    """A pipeline's layout for a job at pp > 1 or read from a pipeline, else ZeRO's."""
    if is_pipe_job(state):
        write_pipe(coord, state, path, progress, notes)
    else:
        zero.write(coord, state, path, progress, notes)
