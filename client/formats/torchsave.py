"""Plain ``torch.save`` checkpoints: one file with the whole model.

Layout read (``FILE``, or a directory holding ``model.pt`` or one ``*.pt``):

- a flat state dict ``{name: tensor}`` (``model.state_dict()``), or
- ``{"model": state_dict, "optimizer": optimizer.state_dict(), "step": N}``
  (``"state_dict"``, ``"optim"`` and ``"iteration"`` are accepted too).
  Optimizer state keyed by integers follows the order of the model's
  parameters, as ``torch.optim.Adam(model.parameters())`` numbers them
  (the state dict must then hold no buffers); keyed by names, as
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
  gives it, it is matched by name.

Names are the job's (Megatron-LM names with global layer indices).
``export`` writes ``DIR/model.pt`` in the second form, integer-keyed, with
``"master"`` (fp32 master weights of fp16/bf16 jobs) and ``"ptcfs"`` (the
model preset) added; the model and the optimizer load back with
``load_state_dict`` into a module of the job's names and ``Adam``. The
optimizer's settings (learning rate, betas...) are those the job recorded
from the checkpoint it came from (:mod:`ptcfs.model.optgroups`), read from the
``param_groups`` of this format too; else torch's defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Entry, Source, from_numpy, held, torch_groups, torch_load
from ptcfs.client.torch.state import progress_bar
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.optgroups import settings_for
from ptcfs.types import ModelSpec

__all__ = ["read_torch", "write_torch", "adam_groups", "FILE_NAME"]

FILE_NAME = "model.pt"


def _file(path: Path) -> Path:
    if path.is_dir():
        if (path / FILE_NAME).is_file():
            return path / FILE_NAME
        found = sorted(path.glob("*.pt")) + sorted(path.glob("*.pth"))
        if len(found) != 1:
            raise CheckpointError(f"{path}: expected {FILE_NAME} or exactly one *.pt file, "
                                  f"found {len(found)}")
        return found[0]
    return path


def _tensors(d: Any, where: str, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(d, dict) or not all(isinstance(v, torch.Tensor) for v in d.values()):
        raise CheckpointError(f"{where}: {what} is not a dict of name → tensor")
    return {str(k): v for k, v in d.items()}



def read_torch(path: Path, trust: bool = False) -> Source:
    """A :class:`Source` from a ``torch.save`` file (see the module docstring)."""
    f = _file(path)
    obj = torch_load(f, trust)
    where = str(f)
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return Source({str(k): held(v, where) for k, v in obj.items()})
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: holds a {type(obj).__name__}, not a state dict")
    key = next((k for k in ("model", "state_dict") if k in obj), None)
    if key is None:
        raise CheckpointError(f"{where}: no 'model' (or 'state_dict') entry; keys are "
                              + ", ".join(map(str, list(obj)[:6])))
    model = _tensors(obj[key], where, f"'{key}'")
    out = {n: held(t, where) for n, t in model.items()}
    step = obj.get("step", obj.get("iteration"))
    optim = obj.get("optimizer", obj.get("optim"))
    groups = []
    if optim is not None:
        step = _optimizer(optim, list(model), out, where, step)
        groups = torch_groups(optim, list(model))
    for n, t in _tensors(obj.get("master", {}), where, "'master'").items():
        out[f"optim/master/{n}"] = held(t, where)
    meta = obj.get("ptcfs")
    model_text = meta.get("model") if isinstance(meta, dict) else None
    return Source(out, int(step or 0), model=model_text, groups=groups)


def _optimizer(optim: Any, order: list[str], out: dict[str, Entry], where: str,
               step: Any) -> Any:
    if not isinstance(optim, dict) or not isinstance(optim.get("state"), dict):
        raise CheckpointError(f"{where}: 'optimizer' is not an optimizer state dict "
                              "(no 'state')")
    ids = [p for g in optim.get("param_groups", []) for p in g.get("params", [])]
    for key, st in optim["state"].items():
        if isinstance(key, str):
            name = key
        else:
            pos = ids.index(key) if key in ids else key
            if not 0 <= pos < len(order):
                raise CheckpointError(f"{where}: optimizer state of parameter {key} has no "
                                      "model tensor in that position")
            name = order[pos]
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind not in st:
                raise CheckpointError(f"{where}: optimizer state of {name} has no {kind}; "
                                      "only Adam state can be imported")
            out[f"optim/{kind}/{name}"] = held(st[kind], where)
        if "step" in st and step is None:
            step = int(float(st["step"]))
    return step


def adam_groups(model: ModelSpec, names: list[str],
                notes: list[str] | None = None) -> list[dict[str, Any]]:
    """One Adam param group over parameters 0..n-1 (``names``), with the
    settings the job recorded (:mod:`ptcfs.model.optgroups`), else torch's defaults."""
    g = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    (mine,), said = settings_for(model, [names])
    if notes is not None:
        notes.extend(said)
    return [{**g, **(mine or {}), "params": list(range(len(names)))}]


def write_torch(coord: Coordinator, state: JobState, path: Path,
                progress: bool | None = None, notes: list[str] | None = None) -> Path:
    """``path/model.pt`` with the job's logical tensors (see the module
    docstring); ``notes`` gets what could not be kept as it was."""
    model = state.model_spec()
    specs = [s for s in model.tensors_for(1) if s.name in {t.name for t in model.tensors}]
    params = [s for s in specs if not s.name.startswith("optim/")]
    values: dict[str, torch.Tensor] = {}
    with progress_bar(sum(s.nbytes for s in specs), f"export {state.job}", progress) as tick:
        for s in specs:
            values[s.name] = from_numpy(coord.fetch_tensor(state, s.name), s.dtype)
            tick(s.nbytes)
    out: dict[str, Any] = {
        "model": {s.name: values[s.name] for s in params},
        "step": state.step,
        "ptcfs": {"model": state.model, "dtype": state.dtype, "optimizer": state.optimizer},
    }
    if state.optimizer == "adam":
        step = torch.tensor(float(state.step))
        out["optimizer"] = {
            "state": {i: {"step": step.clone(), "exp_avg": values[f"optim/exp_avg/{s.name}"],
                          "exp_avg_sq": values[f"optim/exp_avg_sq/{s.name}"]}
                      for i, s in enumerate(params)},
            "param_groups": adam_groups(model, [s.name for s in params], notes),
        }
        out["master"] = {s.name: values[f"optim/master/{s.name}"] for s in params
                         if f"optim/master/{s.name}" in values}
    path.mkdir(parents=True, exist_ok=True)
    target = path / FILE_NAME
    torch.save(out, target)
    return target


def read(path: Path, options: ReadOptions) -> Source:
    """The ``torch`` row of :data:`ptcfs.client.formats.FORMATS`."""
    return read_torch(path, options.trust)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    write_torch(coord, state, path, progress, notes=notes)
