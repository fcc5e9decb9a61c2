"""DeepSpeed ZeRO-1, -2 and -3 checkpoints, as ``engine.save_checkpoint`` writes them.

Layout read and written (``DIR`` holds ``latest``, a file naming the tag;
the tag directory itself is read too)::

    DIR/latest                                       "global_step<N>"
    DIR/global_step<N>/mp_rank_00_model_states.pt    ZeRO-1/2: the module's weights
    DIR/global_step<N>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO-3, one a rank
    DIR/global_step<N>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt

The model states hold ``module`` (the weights in the training dtype; empty
tensors under ZeRO-3), ``param_shapes`` (each optimizer group's parameters,
in the order of the flat buffers), ``dp_world_size``, ``global_steps`` and
``ds_config``. Each rank's optimizer states hold its partition of the fp32
master weights and of Adam's ``exp_avg``/``exp_avg_sq``, as
:mod:`ptcfs.client.formats.zero_layout` describes. Tensor names are the
module's (``named_parameters``), each replicated under tensor parallelism
unless ``--model-spec`` says how it splits.

An import keeps the stage, the loss scaler, ``clip_grad`` and the config in
the job (spec parameter ``deepspeed``) and the optimizer groups
(:mod:`ptcfs.model.optgroups`); its mesh is ``dp=N,zero=1`` (ZeRO-1/2) or
``fsdp=N`` (ZeRO-3). An export writes the job's data-parallel degree
(``dp * fsdp``; tp, pp and cp must be 1) in the stage the job recorded
(else 3 when ``fsdp > 1``, else 2), for the engine to ``load_checkpoint``
at that world size. Pipeline-parallel checkpoints (``layer_*`` files) and
jobs are :mod:`ptcfs.client.formats.zero_pipe`'s, whose ``read`` and
``write`` (the ``deepspeed`` format's) hand the others here. Not read: tensor-parallel checkpoints
(``mp_rank_01`` without ``layer_*``), frozen parameters, buffers,
parameters shared between modules. Universal checkpoints are the ``deepspeed-universal``
format (:mod:`ptcfs.client.formats.zero_universal`); an export carries each
rank's ``param_slice_mappings``, from which DeepSpeed's ``ds_to_universal``
makes one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Entry, Source, dtype_of, held, plain_settings, torch_load
from ptcfs.client.formats.zero_layout import LATEST, PARAM, join3, join_flat, model_name, optim_name
from ptcfs.client.formats.zero_write import write_zero
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.hfmodels import with_param
from ptcfs.model.specfile import load_spec_file
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

__all__ = ["read_zero", "read", "write", "allowed", "refuse_layouts", "model_states", "finish",
           "optim", "flats_of", "tag_dir"]


class _LossScaler:
    """DeepSpeed's static loss scaler as unpickled here (its ``__dict__``)."""


class _DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler as unpickled here (its ``__dict__``)."""


class _Opaque(tuple):  # noqa: SLOT001 - a stand-in, never built by hand
    """A value DeepSpeed pickled that ptcfs does not use (``fragment_address``)."""

    def __new__(cls, *args: Any) -> _Opaque:
        return tuple.__new__(cls, args)


def _stage(value: Any) -> int:
    return int(value)


def allowed() -> tuple[Any, ...]:
    """Stand-ins for the classes DeepSpeed pickles into its files, so that
    they load without ``--trust-pickle`` and without DeepSpeed installed."""
    return ((_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
            (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
            (_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
            (_Opaque, "deepspeed.utils.tensor_fragment.fragment_address"))


def tag_dir(path: Path) -> Path:
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        if not tag or not (path / tag).is_dir():
            raise CheckpointError(f"{path / LATEST}: names tag {tag!r}, which is not a "
                                  f"directory of {path}")
        return path / tag
    if path.is_dir() and any(path.glob("*model_states.pt")):
        return path
    raise CheckpointError(f"{path}: not a DeepSpeed checkpoint (no 'latest' file, no "
                          "*model_states.pt)")


def refuse_layouts(d: Path) -> None:
    """Refuse a tensor- or pipeline-parallel checkpoint folder ``d``."""
    if any(d.glob("layer_*")):
        raise CheckpointError(f"{d}: a pipeline-parallel DeepSpeed checkpoint (layer_* files); "
                              "only data-parallel ZeRO checkpoints are read")
    if any(re.search(r"mp_rank_(?!00_)\d+", f.name) for f in d.glob("*mp_rank_*")):
        raise CheckpointError(f"{d}: a tensor-parallel DeepSpeed checkpoint (mp_rank_01 and "
                              "up); only data-parallel ZeRO checkpoints are read")


def _dict(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointError(f"{where}: no '{key}' entry; not a DeepSpeed ZeRO file")
    return obj[key]


def model_states(d: Path, trust: bool, mp: int = 0) -> tuple[dict[str, Any], int]:
    """The (rank 0) model states in ``d`` (of pipeline stage ``mp``) and the
    ZeRO stage they say."""
    if mp:
        f = d / model_name(None, mp)
    elif (d / model_name(None)).is_file():
        f = d / model_name(None)
    elif (d / model_name(0)).is_file():
        f = d / model_name(0)
    else:
        raise CheckpointError(f"{d}: neither {model_name(None)} nor {model_name(0)}")
    ms = torch_load(f, trust, allowed())
    for key in ("module", "param_shapes", "dp_world_size"):
        _dict(ms, key, str(f))
    cfg = ms.get("ds_config") or {}
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0)) if isinstance(cfg, dict) \
        else 0
    stage = stage or (3 if f.name == model_name(0) else 0)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{f}: ZeRO stage {stage}; only ZeRO-1, -2 and -3 checkpoints "
                              "are read")
    if ms.get("frozen_param_shapes") or ms.get("buffer_names") or ms.get("shared_params"):
        raise CheckpointError(f"{f}: holds frozen parameters, buffers or shared parameters, "
                              "which the deepspeed format does not carry yet")
    return ms, stage


def optim(d: Path, dp: int, trust: bool, mp: int = 0) -> tuple[list[dict[str, Any]], bool]:
    """Every rank's ``optimizer_state_dict`` (of pipeline stage ``mp``) and
    whether the files are bf16_."""
    bf16 = (d / optim_name(0, True, mp)).is_file()
    out = []
    for r in range(dp):
        f = d / optim_name(r, bf16, mp)
        if not f.is_file():
            raise CheckpointError(f"{f}: missing; the checkpoint was saved by {dp} "
                                  "data-parallel ranks and needs each one's optimizer states")
        out.append(_dict(torch_load(f, trust, allowed()), "optimizer_state_dict", str(f)))
    return out, bf16


def _scaler(osd: dict[str, Any]) -> dict[str, Any] | None:
    s = osd.get("loss_scaler")
    if not isinstance(s, _LossScaler | _DynamicLossScaler):
        return None
    return {"class": type(s).__name__.lstrip("_"), "state": dict(vars(s))}


def _moments(states: list[dict[str, Any]], key: str, where: str) -> list[Any]:
    """Each rank's ``state`` entries of the flat groups."""
    out = []
    for r, st in enumerate(states):
        inner = _dict(st, key, where)
        s = _dict(inner, "state", where)
        if not s:
            raise CheckpointError(f"{where}: rank {r} holds no Adam state")
        out.append([s[k] for k in sorted(s)])
    return out


def flats_of(ms: dict[str, Any], optims: list[dict[str, Any]], stage: int, where: str
           ) -> dict[str, dict[str, torch.Tensor]]:
    """kind (master, exp_avg, exp_avg_sq) → parameter name → flat fp32 tensor."""
    groups = [list(g.items()) for g in ms["param_shapes"]]
    out: dict[str, dict[str, torch.Tensor]] = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    if stage == 3:
        numels = [torch.Size(s).numel() for g in groups for _, s in g]
        names = [n for g in groups for n, _ in g]
        state = _moments(optims, "optimizer_state_dict", where)
        per_kind = {"master": [torch.cat(list(_dict(o, "fp32_flat_groups", where)))
                               for o in optims]}
        for kind in ("exp_avg", "exp_avg_sq"):
            per_kind[kind] = [torch.cat([s[kind].reshape(-1) for s in st]) for st in state]
        for kind, ranks in per_kind.items():
            out[kind] = dict(zip(names, join3(ranks, numels, where), strict=True))
        return out
    state = _moments(optims, "base_optimizer_state", where)
    for g, params in enumerate(groups):
        numels = [torch.Size(s).numel() for _, s in params]
        aligned = [o.get("param_alignment_paddings", [[0] * len(params)] * len(groups))[g]
                   for o in optims]
        pads = [int(_dict(o, "group_paddings", where)[g]) for o in optims]
        masters = [_dict(o, "single_partition_of_fp32_groups", where)[g] for o in optims]
        flat = {"master": join_flat(masters, [0] * len(optims), sum(numels) + sum(aligned[0]),
                                    where)}
        for kind in ("exp_avg", "exp_avg_sq"):
            flat[kind] = join_flat([st[g][kind] for st in state], pads,
                                   sum(numels) + sum(aligned[0]), where)
        for kind, f in flat.items():
            offset = 0
            for (name, _), n, pad in zip(params, numels, aligned[0], strict=True):
                out[kind][name] = f[offset:offset + n]
                offset += n + int(pad)
    return out


def _spec(ms: dict[str, Any], dtypes: dict[str, str], options: ReadOptions,
          record: dict[str, Any]) -> ModelSpec:
    if options.model_spec is not None:
        base = load_spec_file(str(options.model_spec))
    else:
        base = ModelSpec("deepspeed", 1, tuple(
            TensorSpec(n, tuple(s), dtypes[n], ShardRule())
            for g in ms["param_shapes"] for n, s in g.items()))
    return with_param(base, PARAM, json.dumps(record, sort_keys=True))



def read_zero(path: Path, options: ReadOptions) -> Source:
    """A :class:`Source` from a DeepSpeed ZeRO checkpoint (see the module docstring)."""
    d = tag_dir(path)
    refuse_layouts(d)
    ms, stage = model_states(d, options.trust)
    where = str(d)
    dp = int(ms["dp_world_size"])
    optims, _ = optim(d, dp, options.trust)
    flats = flats_of(ms, optims, stage, where)
    first = optims[0]
    inner = first.get("base_optimizer_state", first.get("optimizer_state_dict", {}))
    steps = [float(s["step"]) for s in (inner.get("state") or {}).values() if "step" in s]
    return finish(ms, stage, flats, first, inner.get("param_groups", []),
                  steps[0] if steps else None, options, where)


def finish(ms: dict[str, Any], stage: int, flats: dict[str, dict[str, torch.Tensor]],
           head: dict[str, Any], groups: list[dict[str, Any]], adam_step: float | None,
           options: ReadOptions, where: str) -> Source:
    """The :class:`Source` of a checkpoint whose model states are ``ms``,
    its parameters' flat fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` in
    ``flats``; ``head``: the optimizer state's loss scaler and ``clip_grad``,
    ``groups`` its param groups (the ZeRO and the universal reader)."""
    module = ms["module"]
    shapes = {n: tuple(s) for g in ms["param_shapes"] for n, s in g.items()}
    missing = sorted(set(shapes) - set(module))
    if missing:
        raise CheckpointError(f"{where}: module lacks parameters {', '.join(missing[:3])}")
    dtypes = {n: dtype_of(module[n].dtype, where) for n in shapes}
    out: dict[str, Entry] = {}
    for name, shape in shapes.items():
        master = flats["master"][name].reshape(shape)
        w = module[name] if stage < 3 else master.to(module[name].dtype)
        if tuple(w.shape) != shape:
            raise CheckpointError(f"{where}: module weight {name} has shape {tuple(w.shape)}, "
                                  f"param_shapes says {shape}")
        out[name] = held(w, where)
        if options.optimizer:
            if w.dtype != torch.float32:
                out[f"optim/master/{name}"] = held(master, where)
            for kind in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{kind}/{name}"] = held(flats[kind][name].reshape(shape), where)
    settings = [plain_settings(g) for g in groups]
    names = [list(g) for g in ms["param_shapes"]]
    record = {"stage": stage, "scaler": _scaler(head), "ds_config": ms.get("ds_config"),
              "clip_grad": head.get("clip_grad"), "ds_version": ms.get("ds_version"),
              "skipped_steps": ms.get("skipped_steps", 0),
              "global_samples": ms.get("global_samples"), "adam_step": adam_step}
    try:
        spec = _spec(ms, dtypes, options, record)
    except TypeError:
        record["ds_config"] = None
        spec = _spec(ms, dtypes, options, record)
    dp = int(ms["dp_world_size"])
    native = f"dp={dp},zero=1" if stage < 3 else f"fsdp={dp}"
    return Source(out, int(ms.get("global_steps", 0)), spec=spec, native=native,
                  groups=list(zip(settings, names, strict=False)))


def read(path: Path, options: ReadOptions) -> Source:
    """A data-parallel ZeRO checkpoint (the ``deepspeed`` row of
    :data:`ptcfs.client.formats.FORMATS` is :mod:`ptcfs.client.formats.zero_pipe`,
    which hands such checkpoints here)."""
    return read_zero(path, options)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    write_zero(coord, state, path, progress, notes)
