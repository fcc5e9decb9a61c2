"""Optimizer state and fp32 masters of a Hugging Face model directory.

Where they are (read and written):

- ``DIR/optimizer.pt``: what the HF ``Trainer`` saves, ``torch.save`` of
  ``optimizer.state_dict()`` for ``AdamW`` (``SGD`` for an ``sgd`` job) over
  the model's parameters in two groups as ``Trainer.create_optimizer``
  makes them: the weight-decay group (not a bias, not a norm), then the
  rest, each in ``named_parameters()`` order; state ``i`` holds fp32
  ``exp_avg`` and ``exp_avg_sq`` (or ``momentum_buffer``) and ``step``. A
  state dict of a single group (``AdamW(model.parameters())``) is read too.
  The groups' hyper-parameters (learning rate, betas, weight decay...) are
  those the job recorded from the checkpoint it came from, whatever its
  format (:mod:`ptcfs.model.optgroups`: each of the Trainer's groups takes the
  settings of the recorded group that covers its parameters); a job that
  recorded none gets torch's defaults with the Trainer's ``weight_decay``
  of 0.0.
  (The Trainer loads ``optimizer.pt`` on resume only next to a
  ``scheduler.pt``: an export writes the imported one back, at the job's
  step, so a Trainer checkpoint resumes with its optimizer and schedule; a
  job that came from elsewhere gets one made by :func:`scheduler_state`.)
- ``DIR/master/``: the fp32 master weights of an fp16/bf16 job, as a model
  directory of its own (the same ``config.json`` with ``"dtype":
  "float32"``, safetensors of the same names) that ``from_pretrained`` loads
  as the fp32 model; parameters that are fp32 already appear there as they
  are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ptcfs.client.formats.common import Entry, from_numpy, held, plain_settings, torch_load
from ptcfs.client.formats.safetensors_io import SafeTensor, read_dir, read_tensor, write_dir
from ptcfs.client.torch.state import TORCH_DTYPES
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.hfmodels import decays, hf_files
from ptcfs.model.modelkit import HALF_DTYPES
from ptcfs.model.optgroups import settings_for
from ptcfs.types import ModelSpec, TensorSpec

__all__ = ["OPTIMIZER_FILE", "MASTER_DIR", "entry", "read_optimizer", "read_masters",
           "write_optimizer", "trainer_order", "scheduler_state"]

OPTIMIZER_FILE = "optimizer.pt"
MASTER_DIR = "master"
_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
           "sgd": ("momentum_buffer",)}


def entry(t: SafeTensor) -> Entry:
    """A tensor of a safetensors file, read when asked."""
    return Entry(t.shape, TORCH_DTYPES[t.dtype], lambda: from_numpy(read_tensor(t), t.dtype),
                 str(t.path))



def trainer_order(model: ModelSpec) -> list[list[TensorSpec]]:
    """The parameters in the Trainer's two groups: weight decay, then the rest."""
    params = [t for t in model.tensors if not t.is_optim]
    return [[t for t in params if decays(t)], [t for t in params if not decays(t)]]


def read_optimizer(root: Path, model: ModelSpec, out: dict[str, Entry], notes: list[str],
                   step: int) -> tuple[int, list[tuple[dict[str, Any], list[str]]]]:
    """Add the Adam moments of ``root/optimizer.pt`` to ``out`` as
    ``optim/<kind>/<name>``; returns the step (``step`` unless 0) and the
    groups: each one's settings and the tensors it covers
    (:mod:`ptcfs.model.optgroups`)."""
    f = root / OPTIMIZER_FILE
    if not f.is_file():
        return step, []
    sd = torch_load(f)
    where = str(f)
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or \
            not isinstance(sd.get("param_groups"), list):
        raise CheckpointError(f"{where}: not an optimizer state dict (state, param_groups)")
    groups = [list(g.get("params", [])) for g in sd["param_groups"]]
    order = trainer_order(model)
    if len(groups) == 1:
        order = [order[0] + order[1]]
    if [len(g) for g in groups] != [len(g) for g in order]:
        raise CheckpointError(
            f"{where}: parameter groups hold {[len(g) for g in groups]} parameters; the model's "
            f"Trainer groups (weight decay, the rest) hold {[len(g) for g in order]}; "
            "use --optimizer none to import the model only")
    for ids, specs in zip(groups, order, strict=True):
        for i, spec in zip(ids, specs, strict=True):
            st = sd["state"].get(i)
            if st is None:
                continue
            for kind in ("exp_avg", "exp_avg_sq"):
                t = st.get(kind)
                if not isinstance(t, torch.Tensor):
                    raise CheckpointError(f"{where}: state {i} ({spec.name}) has no {kind}; only "
                                          "Adam state can be imported (--optimizer none)")
                out[f"optim/{kind}/{spec.name}"] = held(t, where)
            if not step and "step" in st:
                step = int(float(st["step"]))
    missing = sum(1 for g in groups for i in g if i not in sd["state"])
    if missing:
        notes.append(f"{where}: {missing} parameters have no optimizer state yet; their "
                     "moments start at zero")
    return step, [(plain_settings(g), [t.name for t in specs])
                  for g, specs in zip(sd["param_groups"], order, strict=True)]


def read_masters(root: Path, model: ModelSpec, out: dict[str, Entry]) -> None:
    """Add the fp32 masters of ``root/master/`` to ``out`` as ``optim/master/<name>``."""
    d = root / MASTER_DIR
    if not d.is_dir():
        return
    found = read_dir(d)
    for spec in model.tensors:
        t = found.get(spec.name)
        if spec.is_optim or spec.dtype not in HALF_DTYPES or t is None:
            continue
        if t.dtype != "fp32":
            raise CheckpointError(f"{t.path}: master weight {spec.name} is {t.dtype}, not fp32")
        out[f"optim/master/{spec.name}"] = entry(t)


def _master_config(config: str) -> str:
    d = json.loads(config)
    keys = [k for k in ("dtype", "torch_dtype") if k in d] or ["torch_dtype"]
    d.update(dict.fromkeys(keys, "float32"))
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def _groups(kind: str, members: list[list[str]], settings: list[dict[str, Any] | None]
            ) -> list[dict[str, Any]]:
    """The param groups over ``members`` (numbered in order) with
    ``settings`` each, where there are some (:func:`ptcfs.model.optgroups.settings_for`),
    else torch's defaults with the Trainer's ``weight_decay`` of 0.0."""
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    g = cls([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    out, at = [], 0
    for names, mine in zip(members, settings, strict=True):
        base = {**g, "weight_decay": 0.0} if mine is None else {**g, **mine}
        out.append({**base, "params": list(range(at, at + len(names)))})
        at += len(names)
    return out


def write_optimizer(root: Path, state: JobState, model: ModelSpec,
                    fetch: Callable[[str], np.ndarray], max_shard_bytes: int,
                    config: str | None = None, notes: list[str] | None = None
                    ) -> list[dict[str, Any]]:
    """``root/master/`` when the job keeps masters and ``root/optimizer.pt``
    when it keeps Adam or SGD state (see the module docstring); returns
    the optimizer's param groups (none without optimizer state). ``notes``
    gets what the export could not keep as it was."""
    names = {t.name for t in model.tensors}
    params = [t for t in model.tensors if not t.is_optim]
    if any(f"optim/master/{t.name}" in names for t in params):
        def master(name: str) -> np.ndarray:
            m = f"optim/master/{name}"
            return fetch(m if m in names else name)

        items = [(t.name, "fp32" if t.dtype in HALF_DTYPES else t.dtype, t.shape) for t in params]
        write_dir(root / MASTER_DIR, items, master, max_shard_bytes)
        text = config if config is not None else hf_files(model).get("config.json")
        if text is not None:
            (root / MASTER_DIR / "config.json").write_text(_master_config(text))
    kinds = _STATES.get(state.optimizer)
    if kinds is None:
        return []
    order = trainer_order(model)
    step = torch.tensor(float(state.step))
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for i, t in enumerate(order[0] + order[1]):
        st = {k: from_numpy(fetch(f"optim/{k}/{t.name}"), "fp32") for k in kinds}
        saved[i] = st if state.optimizer == "sgd" else {"step": step.clone(), **st}
    members = [[t.name for t in g] for g in order]
    settings, said = settings_for(model, members)
    if notes is not None:
        notes.extend(said)
    groups = _groups(state.optimizer, members, settings)
    torch.save({"state": saved, "param_groups": groups}, root / OPTIMIZER_FILE)
    return groups


def scheduler_state(groups: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """A ``scheduler.pt`` for a job that has none: the state of a ``LambdaLR``
    (the class of the Trainer's schedules) over ``groups`` at ``step``, each
    group's base rate its ``initial_lr`` (the rate a schedule started from)
    or else its ``lr``. The Trainer loads it into the schedule its arguments
    build, which goes on from ``step`` at those rates."""
    lrs = [float(g.get("initial_lr", g["lr"])) for g in groups]
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}
                           for lr in lrs])
    sd: dict[str, Any] = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0).state_dict()
    # lr_lambdas as the Trainer's schedules (functools.partial) save theirs
    sd.update(base_lrs=lrs, last_epoch=step, _step_count=step + 1,
              _last_lr=[float(g["lr"]) for g in groups], lr_lambdas=[{} for _ in groups])
    return sd
