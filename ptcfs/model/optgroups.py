"""The optimizer's hyper-parameters, carried from a checkpoint to its exports.

A checkpoint's optimizer keeps, per parameter group, its settings (learning
rate, betas, eps, weight decay, and whatever its optimizer or scheduler put
there: ``initial_lr``, Megatron's ``wd_mult``...) beside the parameters the
group covers. An import records them in the job's spec (``params`` key
:data:`GROUPS`, JSON ``[{"settings": {...}, "params": [tensor names]}]``);
reconfigurations carry the spec along, and every export writes them back in
its own format's groups:

- where the format names each group's parameters (DCP's ``param_groups``
  of fully qualified names), the recorded groups as they are
  (:func:`named_groups`), and the format's defaults for parameters no group
  covers;
- where the format has its own grouping (the HF Trainer's weight-decay
  group and the rest, Megatron's groups, a plain state dict's one group),
  each of its groups takes the settings of the recorded group that covers
  its parameters (:func:`settings_for`); where they come from recorded
  groups whose settings differ, the group that covers most of them wins and
  the export says so.

A job that recorded nothing (a checkpoint without groups, a job made by
``ptcctl create``) gets each format's defaults. Values must be JSON
(numbers, strings, booleans, lists); tuples come back as tuples where the
optimizer keeps one (``betas``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ptcfs.model.hfmodels import OPTIMIZER_GROUPS, decays, with_param
from ptcfs.types import ModelSpec

__all__ = ["GROUPS", "Group", "named_groups", "record", "recorded", "settings_for"]

#: The spec ``params`` key of the recorded groups.
GROUPS = "optimizer_groups"
#: what a group holds that is no setting: its parameters, and the step an
#: optimizer keeping one per group counts (the job has its own)
_NOT_SETTINGS = frozenset({"params", "step"})


@dataclass(frozen=True)
class Group:
    """One recorded parameter group: its settings and the job's tensors in it."""

    settings: dict[str, Any]
    names: tuple[str, ...]


def _plain(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as an optimizer keeps them: JSON lists back to tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}


def record(model: ModelSpec, groups: Sequence[tuple[Mapping[str, Any], Sequence[str]]]
           ) -> tuple[ModelSpec, str | None]:
    """``model`` with ``groups`` (settings, and the job tensor names each
    covers) recorded, without ``params`` and ``step``; names the model lacks
    are left out.
    Returns the model unchanged and a note when a setting is not a JSON value."""
    known = {t.name for t in model.tensors if not t.is_optim}
    kept = [{"settings": {k: v for k, v in s.items() if k not in _NOT_SETTINGS},
             "params": [n for n in names if n in known]} for s, names in groups]
    try:
        text = json.dumps(kept, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        return model, (f"the optimizer's settings are not plain values ({e}); an export "
                       "writes the format's defaults")
    return with_param(model, GROUPS, text), None


def recorded(model: ModelSpec) -> list[Group]:
    """The groups a job recorded (empty: none). A job recorded by an earlier
    ptcfs under ``hf_optimizer_groups`` (settings only, the Trainer's two
    groups) reads as those groups."""
    params = dict(model.params)
    if GROUPS in params:
        return [Group(_plain(g["settings"]), tuple(g["params"]))
                for g in json.loads(str(params[GROUPS]))]
    if OPTIMIZER_GROUPS not in params:
        return []
    settings = json.loads(str(params[OPTIMIZER_GROUPS]))
    tensors = [t for t in model.tensors if not t.is_optim]
    order = [[t.name for t in tensors if decays(t)], [t.name for t in tensors if not decays(t)]]
    if len(settings) == 1:
        order = [order[0] + order[1]]
    if len(settings) != len(order):
        return []
    return [Group(_plain(s), tuple(n)) for s, n in zip(settings, order, strict=True)]


def settings_for(model: ModelSpec, members: Sequence[Sequence[str]]
                 ) -> tuple[list[dict[str, Any] | None], list[str]]:
    """The settings of each of a format's groups (``members``: the job
    tensor names in each), from the groups the job recorded: None where it
    recorded none for those tensors. Also returns notes on groups whose
    tensors had different settings (the most tensors' settings are taken)."""
    groups = recorded(model)
    of = {n: i for i, g in enumerate(groups) for n in g.names}
    out: list[dict[str, Any] | None] = []
    notes: list[str] = []
    for k, names in enumerate(members):
        counts: dict[int, int] = {}
        for n in names:
            if n in of:
                counts[of[n]] = counts.get(of[n], 0) + 1
        if not counts:
            out.append(None)
            continue
        best = max(counts, key=lambda i: (counts[i], -i))
        out.append(dict(groups[best].settings))
        differ = sorted(i for i in counts if groups[i].settings != groups[best].settings)
        if differ:
            notes.append(f"optimizer group {k} holds tensors of recorded groups "
                         f"{', '.join(map(str, [best, *differ]))} whose settings differ; "
                         f"it takes group {best}'s ({counts[best]} of {len(names)} tensors)")
    return out, notes


def named_groups(model: ModelSpec, names: Sequence[str]
                 ) -> list[tuple[dict[str, Any] | None, list[str]]]:
    """The recorded groups over ``names`` (a format's parameters, named),
    each with its settings, in recorded order; then the names no group
    covers, with None (the format's defaults). Empty groups are left out."""
    wanted = set(names)
    out: list[tuple[dict[str, Any] | None, list[str]]] = []
    covered: set[str] = set()
    for g in recorded(model):
        mine = [n for n in g.names if n in wanted and n not in covered]
        covered.update(mine)
        if mine:
            out.append((dict(g.settings), mine))
    rest = [n for n in names if n not in covered]
    if rest:
        out.append((None, rest))
    return out
