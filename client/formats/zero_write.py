"""Writing a job as a DeepSpeed ZeRO checkpoint (the ``write`` of
:mod:`ptcfs.client.formats.zero`, whose docstring gives the layout): the
files ``engine.save_checkpoint`` writes at the job's data-parallel degree,
for ``engine.load_checkpoint`` at that world size and for DeepSpeed's
``zero_to_fp32``."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats.common import from_numpy
from ptcfs.client.formats.torchsave import adam_groups
from ptcfs.client.formats.zero_layout import (
    LATEST,
    PARAM,
    fragments,
    lean,
    model_name,
    optim_name,
    paddings,
    split3,
    split_flat,
    sub_groups,
)
from ptcfs.client.torch.state import progress_bar
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.optgroups import recorded, settings_for
from ptcfs.types import TensorSpec

__all__ = ["write_zero", "DS_VERSION", "Prepared", "prepare", "write_model_states", "optim12",
           "common"]

#: the DeepSpeed version whose layout this writes (when the job records none)
DS_VERSION = "0.19.8"
_SUB_GROUP = 1_000_000_000  # stage 3's default sub_group_size


def _scaler(rec: dict[str, Any] | None) -> Any:
    """DeepSpeed's loss scaler object as the job recorded it (a static scale of
    1 where it recorded none), or None where DeepSpeed is not installed."""
    try:
        from deepspeed.runtime.fp16 import loss_scaler
    except ImportError:
        return None
    rec = rec or {"class": "LossScaler", "state": {"cur_scale": 1.0, "dynamic": False}}
    cls = getattr(loss_scaler, str(rec["class"]), loss_scaler.LossScaler)
    obj = cls.__new__(cls)
    obj.__dict__.update(rec["state"])
    return obj


def _address() -> Any:
    """DeepSpeed's ``fragment_address`` class, or None where DeepSpeed is not
    installed (a ``param_slice_mappings`` entry must unpickle as it)."""
    try:
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return None
    return fragment_address


def _groups(state: JobState, params: list[TensorSpec],
            notes: list[str] | None) -> list[tuple[dict[str, Any], list[TensorSpec]]]:
    """The optimizer groups: those the job recorded, when they cover its
    parameters once each, else one group of all, in the spec's order."""
    model = state.model_spec()
    by = {p.name: p for p in params}
    rec = recorded(model)
    names = [n for g in rec for n in g.names]
    if rec and sorted(names) == sorted(by):
        settings, said = settings_for(model, [list(g.names) for g in rec])
        if notes is not None:
            notes.extend(said)
        base = adam_groups(model, [], None)[0]
        return [({**base, **(s or {})}, [by[n] for n in g.names])
                for s, g in zip(settings, rec, strict=True)]
    (g,) = adam_groups(model, [p.name for p in params], notes)
    return [(g, params)]


def _config(rec: dict[str, Any], stage: int, dtype: str) -> dict[str, Any]:
    cfg = dict(rec.get("ds_config") or {})
    cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": stage}
    if not rec.get("ds_config"):
        cfg.update({"bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}})
    return cfg


def _fetch(coord: Coordinator, state: JobState, params: list[TensorSpec],
           progress: bool | None, notes: list[str] | None) -> dict[str, dict[str, torch.Tensor]]:
    """kind (weight, master, exp_avg, exp_avg_sq) → name → logical tensor."""
    have = {s.name: s for s in state.model_spec().tensors}
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in
                                               ("weight", "master", "exp_avg", "exp_avg_sq")}
    zeros = False
    total = sum(s.nbytes for s in have.values())
    with progress_bar(total, f"export {state.job}", progress) as tick:
        for p in params:
            w = from_numpy(coord.fetch_tensor(state, p.name), p.dtype)
            out["weight"][p.name] = w
            tick(p.nbytes)
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                key = f"optim/{kind}/{p.name}"
                if key in have:
                    out[kind][p.name] = from_numpy(coord.fetch_tensor(state, key), "fp32")
                    tick(have[key].nbytes)
                elif kind == "master":
                    out[kind][p.name] = w.to(torch.float32)
                else:
                    zeros = True
                    out[kind][p.name] = torch.zeros(p.shape, dtype=torch.float32)
    if zeros and notes is not None:
        notes.append("the job keeps no Adam moments: the checkpoint's are zeros")
    return out


def common(state: JobState, rec: dict[str, Any], cfg: dict[str, Any], dp: int,
            groups: list[tuple[dict[str, Any], list[TensorSpec]]],
            module: dict[str, torch.Tensor]) -> dict[str, Any]:
    out = {
        "module": module, "buffer_names": [], "optimizer": None,
        "param_shapes": [OrderedDict((p.name, torch.Size(p.shape)) for p in ps)
                         for _, ps in groups],
        "frozen_param_shapes": OrderedDict(), "shared_params": {},
        "frozen_param_fragments": OrderedDict(), "lr_scheduler": None, "data_sampler": None,
        "random_ltd": None, "skipped_steps": int(rec.get("skipped_steps") or 0),
        "global_steps": state.step, "dp_world_size": dp, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": cfg, "ds_version": rec.get("ds_version") or DS_VERSION,
    }
    if rec.get("global_samples") is not None:
        out["global_samples"] = rec["global_samples"]
    return out


def _head(rec: dict[str, Any], stage: int, scaler: Any) -> dict[str, Any]:
    head: dict[str, Any] = {"zero_stage": stage, "dynamic_loss_scale":
                            bool(((rec.get("scaler") or {}).get("state") or {}).get("dynamic")),
                            "overflow": False}
    if scaler is not None:
        head["loss_scaler"] = scaler
    if stage < 3 and rec.get("clip_grad") is not None:
        head["clip_grad"] = rec["clip_grad"]
    return head


def _flat(values: dict[str, torch.Tensor], ps: list[TensorSpec]) -> list[torch.Tensor]:
    return [values[p.name].reshape(-1) for p in ps]


def optim12(v: dict[str, dict[str, torch.Tensor]], groups: list[tuple[dict[str, Any],
             list[TensorSpec]]], dp: int, step: torch.Tensor) -> list[dict[str, Any]]:
    """Each rank's ZeRO-1/2 ``optimizer_state_dict`` (without the head);
    ``param_slice_mappings`` where DeepSpeed is installed to name its class."""
    ranks: list[dict[str, Any]] = [{"base_optimizer_state": {"state": {}, "param_groups": []},
                                    "single_partition_of_fp32_groups": [], "group_paddings": [],
                                    "param_alignment_paddings": [], "partition_count": [],
                                    "param_slice_mappings": []}
                                   for _ in range(dp)]
    address = _address()
    for g, (settings, ps) in enumerate(groups):
        flat = {k: torch.cat(_flat(v[k], ps)) for k in ("master", "exp_avg", "exp_avg_sq")}
        n = flat["master"].numel()
        parts = {k: split_flat(t, dp) for k, t in flat.items()}
        pads = paddings(n, dp)
        pieces = fragments([int(torch.Size(p.shape).numel()) for p in ps], dp)
        for r, rk in enumerate(ranks):
            if address is not None:
                rk["param_slice_mappings"].append(OrderedDict(
                    (ps[i].name, address(numel=numel, start=start))
                    for i, start, numel in pieces[r]))
            rk["base_optimizer_state"]["state"][g] = {
                "step": step.clone(), "exp_avg": parts["exp_avg"][r],
                "exp_avg_sq": parts["exp_avg_sq"][r]}
            rk["base_optimizer_state"]["param_groups"].append({**settings, "params": [g]})
            rk["single_partition_of_fp32_groups"].append(lean(parts["master"], n)[r].clone())
            rk["group_paddings"].append(pads[r])
            rk["param_alignment_paddings"].append([0] * len(ps))
            rk["partition_count"].append(dp)
    if address is None:
        for rk in ranks:
            del rk["param_slice_mappings"]
    return ranks


def _optim3(v: dict[str, dict[str, torch.Tensor]], groups: list[tuple[dict[str, Any],
            list[TensorSpec]]], dp: int, step: torch.Tensor, size: int) -> list[dict[str, Any]]:
    """Each rank's ZeRO-3 ``optimizer_state_dict`` (without the head)."""
    ranks: list[dict[str, Any]] = [{"partition_count": dp, "fp32_flat_groups": [],
                                    "optimizer_state_dict": {"state": {}, "param_groups": []}}
                                   for _ in range(dp)]
    sub = 0
    for settings, ps in groups:
        ids = []
        for members in sub_groups([int(torch.Size(p.shape).numel()) for p in ps], dp, size):
            chosen = [ps[i] for i in members]
            split = {k: split3(_flat(v[k], chosen), dp) for k in ("master", "exp_avg",
                                                                 "exp_avg_sq")}
            for r, rk in enumerate(ranks):
                rk["fp32_flat_groups"].append(split["master"][r])
                rk["optimizer_state_dict"]["state"][sub] = {
                    "step": step.clone(), "exp_avg": split["exp_avg"][r],
                    "exp_avg_sq": split["exp_avg_sq"][r]}
            ids.append(sub)
            sub += 1
        for rk in ranks:
            rk["optimizer_state_dict"]["param_groups"].append({**settings, "params": ids})
    return ranks


@dataclass(frozen=True)
class Prepared:
    """What a job's export to DeepSpeed needs, fetched and decided once (the
    ZeRO and the universal writer)."""

    #: the DeepSpeed settings the job recorded (spec parameter ``deepspeed``)
    rec: dict[str, Any]
    stage: int
    #: the data-parallel degree written (``dp * fsdp``)
    dp: int
    groups: list[tuple[dict[str, Any], list[TensorSpec]]]
    #: kind (weight, master, exp_avg, exp_avg_sq) → name → logical tensor
    values: dict[str, dict[str, torch.Tensor]]
    cfg: dict[str, Any]
    #: the optimizer state's head: loss scaler, ``clip_grad``, stage
    head: dict[str, Any]
    #: Adam's step
    step: torch.Tensor
    version: str


def prepare(coord: Coordinator, state: JobState, progress: bool | None,
            notes: list[str] | None, scaler3: bool = False, pipe: bool = False) -> Prepared:
    """Check that the job is data-parallel only (``pipe``: or pipeline-
    parallel too; and, ``scaler3``, that a ZeRO-3 job's loss scaler can be
    written) and fetch its tensors."""
    c = state.config
    if (c.tp, 1 if pipe else c.pp, c.cp) != (1, 1, 1):
        raise CheckpointError(f"a DeepSpeed ZeRO checkpoint is data-parallel only; job "
                              f"{state.job!r} is at {state.describe()}: reconfigure it to "
                              "tp=1,pp=1 (dp or fsdp any) first")
    model = state.model_spec()
    rec: dict[str, Any] = json.loads(str(dict(model.params).get(PARAM, "{}")))
    stage = int(rec.get("stage") or (3 if c.fsdp > 1 else 2))
    scaler = _scaler(rec.get("scaler"))
    if scaler3 and scaler is None and stage == 3:
        raise CheckpointError("writing a ZeRO-3 checkpoint needs DeepSpeed's loss scaler "
                              "class: pip install deepspeed")
    params = [t for t in model.tensors if not t.is_optim]
    groups = _groups(state, params, notes)
    values = _fetch(coord, state, params, progress, notes)
    cfg = _config(rec, stage, state.dtype)
    head = _head(rec, stage, scaler)
    return Prepared(rec, stage, c.dp * c.fsdp, groups, values, cfg, head,
                    torch.tensor(float(rec.get("adam_step") or state.step)),
                    str(rec.get("ds_version") or DS_VERSION))


def write_model_states(state: JobState, p: Prepared, out: Path) -> None:
    """The model-states files into ``out``: one for ZeRO-1/2 (the weights),
    one a rank for ZeRO-3 (empty tensors)."""
    if p.stage < 3:
        torch.save(common(state, p.rec, p.cfg, p.dp, p.groups, p.values["weight"]),
                   out / model_name(None))
        return
    empty = {n: torch.empty(0, dtype=w.dtype) for n, w in p.values["weight"].items()}
    for r in range(p.dp):
        torch.save(common(state, p.rec, p.cfg, p.dp, p.groups, empty), out / model_name(r))


def write_zero(coord: Coordinator, state: JobState, path: Path,
               progress: bool | None = None, notes: list[str] | None = None) -> Path:
    """``path/latest`` and ``path/global_step<N>/`` at the job's data-parallel
    degree; returns the tag directory."""
    p = prepare(coord, state, progress, notes, scaler3=True)
    size = int((p.cfg.get("zero_optimization") or {}).get("sub_group_size", _SUB_GROUP))
    ranks = (_optim3(p.values, p.groups, p.dp, p.step, size) if p.stage == 3
             else optim12(p.values, p.groups, p.dp, p.step))
    tag = f"global_step{state.step}"
    out = path / tag
    out.mkdir(parents=True, exist_ok=True)
    write_model_states(state, p, out)
    for r, rk in enumerate(ranks):
        osd = {**p.head, **rk, "ds_version": p.version}
        torch.save({"optimizer_state_dict": osd, "ds_config": p.cfg, "ds_version": p.version},
                   out / optim_name(r, state.dtype == "bf16"))
    (path / LATEST).write_text(tag)
    return out
