"""DeepSpeed universal checkpoints, as DeepSpeed's ``ds_to_universal`` writes
them and an engine with ``"checkpoint": {"load_universal": true}`` loads them.

Layout read and written (``DIR`` holds ``latest_universal``, a file naming
the folder; the folder itself is read too)::

    DIR/latest_universal                           "global_step<N>_universal"
    DIR/global_step<N>_universal/mp_rank_00_model_states.pt     ZeRO-1/2
    DIR/global_step<N>_universal/zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO-3
    DIR/global_step<N>_universal/zero/<param>/fp32.pt           the fp32 master
    DIR/global_step<N>_universal/zero/<param>/exp_avg.pt        Adam's moments
    DIR/global_step<N>_universal/zero/<param>/exp_avg_sq.pt
    DIR/global_step<N>_universal/zero/<param>/step.pt           Adam's step
    DIR/global_step<N>_universal/zero/optimizer_state.pt        loss scaler, groups

Each parameter's file holds the whole tensor, not a rank's part:
``{"param": tensor, "cat_dim": 0}`` (``ds_to_universal`` of ZeRO-1/2) or
the flat tensor alone (of ZeRO-3); ``step.pt`` is absent under ZeRO-3, whose
``optimizer_state.pt`` holds the step instead. The model states are those
of the ZeRO checkpoint converted (:mod:`ptcfs.client.formats.zero`): the
weights, ``param_shapes`` (names, shapes and optimizer groups), the stage.

An import reads as the ``deepspeed`` format does (the same spec, record
and mesh: the data-parallel degree the checkpoint was saved at; a universal
checkpoint loads at any). An export writes what ``ds_to_universal`` writes
for the job's stage, every state file in the dict form, which DeepSpeed's
ZeRO-1, -2 and -3 all load. Not read: tensor-parallel universal checkpoints
(sub-parameter or vocabulary patterns), parameters without Adam state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Source, torch_load
from ptcfs.client.formats.zero import allowed, finish, model_states, refuse_layouts
from ptcfs.client.formats.zero_write import prepare, write_model_states
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState

__all__ = ["LATEST_UNIVERSAL", "read", "write"]

#: the file in a checkpoint directory that names the universal folder
LATEST_UNIVERSAL = "latest_universal"
#: the state files of a parameter, by the kind ptcfs calls them
_KINDS = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _folder(path: Path) -> Path:
    if (path / LATEST_UNIVERSAL).is_file():
        tag = (path / LATEST_UNIVERSAL).read_text().strip()
        if not tag or not (path / tag).is_dir():
            raise CheckpointError(f"{path / LATEST_UNIVERSAL}: names folder {tag!r}, which is "
                                  f"not a directory of {path}")
        return path / tag
    if (path / "zero").is_dir():
        return path
    raise CheckpointError(f"{path}: not a DeepSpeed universal checkpoint (no "
                          f"'{LATEST_UNIVERSAL}' file, no zero/ folder)")


def _state(f: Path, shape: tuple[int, ...], trust: bool) -> torch.Tensor:
    """The whole tensor a parameter's state file holds, in ``shape``."""
    if not f.is_file():
        raise CheckpointError(f"{f}: missing; a universal checkpoint holds every parameter's "
                              "fp32 master and Adam moments")
    obj = torch_load(f, trust, allowed())
    t = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{f}: holds no tensor (neither a 'param' entry nor a tensor)")
    if t.numel() != torch.Size(shape).numel():
        raise CheckpointError(f"{f}: {t.numel()} elements; the parameter has shape {shape}")
    return t.reshape(-1)


def _step(d: Path, osd: dict[str, Any], names: list[str], trust: bool) -> float | None:
    inner = (osd.get("optimizer_state_dict") or {}).get("state") or {}
    steps = [s["step"] for s in inner.values() if isinstance(s, dict) and "step" in s]
    if not steps and names and (d / names[0] / "step.pt").is_file():
        steps = [torch_load(d / names[0] / "step.pt", trust, allowed())]
    return float(steps[0]) if steps else None


def read(path: Path, options: ReadOptions) -> Source:
    """The ``deepspeed-universal`` row of :data:`ptcfs.client.formats.FORMATS`."""
    d = _folder(path)
    refuse_layouts(d)
    ms, stage = model_states(d, options.trust)
    zero = d / "zero"
    osd = torch_load(zero / "optimizer_state.pt", options.trust, allowed())
    if not isinstance(osd, dict) or "param_groups" not in osd:
        raise CheckpointError(f"{zero / 'optimizer_state.pt'}: no 'param_groups' entry; not a "
                              "DeepSpeed universal checkpoint")
    shapes = {n: tuple(s) for g in ms["param_shapes"] for n, s in g.items()}
    flats: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KINDS}
    for name, shape in shapes.items():
        for kind, file in _KINDS.items():
            if kind == "master" or options.optimizer:
                flats[kind][name] = _state(zero / name / f"{file}.pt", shape, options.trust)
    step = _step(zero, osd, list(shapes), options.trust)
    return finish(ms, stage, flats, osd, osd["param_groups"], step, options, str(d))


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    """``path/latest_universal`` and ``path/global_step<N>_universal/``."""
    p = prepare(coord, state, progress, notes)
    tag = f"global_step{state.step}_universal"
    out = path / tag
    zero = out / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    write_model_states(state, p, out)
    for _, params in p.groups:
        for t in params:
            (zero / t.name).mkdir(exist_ok=True)
            for kind, file in _KINDS.items():
                torch.save({"param": p.values[kind][t.name], "cat_dim": 0},
                           zero / t.name / f"{file}.pt")
            torch.save(p.step.clone(), zero / t.name / "step.pt")
    groups = [{**settings, "params": [g]} for g, (settings, _) in enumerate(p.groups)]
    osd: dict[str, Any] = {**p.head, "ds_version": p.version, "param_groups": groups}
    if p.stage == 3:
        osd["optimizer_state_dict"] = {"state": {g: {"step": p.step.clone()}
                                                 for g in range(len(groups))},
                                       "param_groups": groups}
    torch.save(osd, zero / "optimizer_state.pt")
    (path / LATEST_UNIVERSAL).write_text(tag)
