"""Megatron-Core's optimizer groups and schedule in ``torch_dist`` checkpoints.

What a ``torch_dist`` checkpoint keeps of the optimizer besides its tensors
(checked against megatron-core 0.16.1, written and loaded by its own
optimizers in the tests):

- ``common.pt['optimizer']['optimizer']['param_groups']``: each group's
  settings without its ``params`` (the non-distributed optimizers and the
  distributed optimizer's model-space formats; with expert parallelism
  (``ep > 1``) megatron-core chains two optimizers, dense and expert, saved
  as ``common.pt['optimizer'][0]`` and ``[1]``); the bucket-space format
  keeps them in the object ``optimizer.distributed.dp_group_idx_0.optimizer``
  instead. A loading optimizer matches them to its own groups by
  ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``
  (:data:`GROUP_KEYS`), and refuses a checkpoint without them.
- ``common.pt['opt_param_scheduler']``: Megatron-LM's learning-rate and
  weight-decay schedule, which its ``load_checkpoint`` needs to load the
  optimizer.

Megatron-Core's default groups (:func:`megatron_groups`): no weight decay
(``wd_mult`` 0) for biases and 1-D tensors, expert parameters apart where
``ep > 1``, every ``lr_mult`` 1. An import records each group's settings with the tensors it
covers (:mod:`ptcfs.model.optgroups`) and the schedule as it was; an export
writes the groups of the job's model with the settings the job recorded
(from any format) and Megatron's identifiers, the job's step as the
optimizer's ``common_step`` and as each group's ``step`` (where the
DistributedOptimizer takes it from), and the recorded schedule.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp

from ptcfs.client.formats.dcp_box import reader
from ptcfs.model.hfmodels import with_param
from ptcfs.model.optgroups import settings_for
from ptcfs.types import ModelSpec

__all__ = ["CONTENT", "GROUP_KEYS", "SCHEDULER", "megatron_groups", "read_groups",
           "record_scheduler", "common_optimizer"]

#: what a Megatron-Core optimizer matches saved groups to its own by
GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
#: the spec ``params`` key of a recorded ``opt_param_scheduler`` (JSON)
SCHEDULER = "mcore_opt_param_scheduler"
#: an export's ``content_metadata``, how megatron-core reads it: the Adam
#: state per parameter in model space (what a DistributedOptimizer loads on
#: any mesh, and the non-distributed optimizers read too), one key per
#: tensor whatever the optimizers' chain
CONTENT = {"distrib_optim_sharding_type": "fully_reshardable",
           "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_BUCKET_GROUPS = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_0"
                            r"\.optimizer/shard_0_1$")

Key = tuple[float, float, bool, bool]


def megatron_groups(model: ModelSpec, ep: int) -> list[tuple[Key, list[str]]]:
    """Megatron-Core's default optimizer groups of ``model``'s parameters at
    expert parallelism ``ep``, in the order their first parameters come:
    each group's identifiers (:data:`GROUP_KEYS`) and its tensors. Experts
    are groups (and an optimizer) of their own only where ``ep > 1``."""
    out: dict[Key, list[str]] = {}
    for t in model.tensors:
        if t.is_optim:
            continue
        no_wd = t.name.endswith(".bias") or len(t.shape) == 1
        key = (0.0 if no_wd else 1.0, 1.0, t.rule.expert is not None and ep > 1, False)
        out.setdefault(key, []).append(t.name)
    return list(out.items())


def _chain(opt: Any) -> list[Any]:
    """The optimizers of a saved ``optimizer`` entry: megatron-core saves a
    chain of several (dense and expert) as ``{0: ..., 1: ...}``."""
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        return [opt[k] for k in sorted(opt)]
    return [opt]


def _saved_groups(it: Path, common: dict[str, Any], md: dict[str, Any]) -> Any:
    groups = []
    for opt in _chain(common.get("optimizer")):
        inner = opt.get("optimizer") if isinstance(opt, dict) else None
        if isinstance(inner, dict) and isinstance(inner.get("param_groups"), list):
            groups += inner["param_groups"]
    if groups:
        return groups
    # the bucket space keeps each optimizer's groups in an object (a chain's prefixed)
    sd: dict[str, Any] = {k: None for k in sorted(md) if _BUCKET_GROUPS.match(k)}
    if not sd:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader(it), no_dist=True)
    for obj in sd.values():
        obj = obj[0] if isinstance(obj, list) and obj else obj
        if isinstance(obj, dict) and isinstance(obj.get("param_groups"), list):
            groups += obj["param_groups"]
    return groups or None


def read_groups(it: Path, common: dict[str, Any], md: dict[str, Any], model: ModelSpec,
                ep: int, notes: list[str]) -> list[tuple[dict[str, Any], list[str]]]:
    """The optimizer groups of a checkpoint saved at expert parallelism
    ``ep``, each with the tensors of ``model`` it covers (empty, with a note,
    where they are not Megatron's default groups)."""
    saved = _saved_groups(it, common, md)
    if not isinstance(saved, list) or not saved:
        return []
    by_key: dict[Key, dict[str, Any]] = {}
    for g in saved:
        if isinstance(g, dict) and all(k in g for k in GROUP_KEYS):
            by_key[(float(g["wd_mult"]), float(g["lr_mult"]), bool(g["is_expert_parallel"]),
                    bool(g["is_decoupled_lr"]))] = g
    out = []
    for key, names in megatron_groups(model, ep):
        if key not in by_key:
            notes.append(f"the optimizer's groups ({len(saved)}) are not Megatron-Core's "
                         f"default ones (none for {dict(zip(GROUP_KEYS, key))}); their "
                         "settings are not kept")
            return []
        out.append(({k: v for k, v in by_key[key].items() if k != "params"}, names))
    return out


def record_scheduler(model: ModelSpec, common: dict[str, Any]) -> ModelSpec:
    """``model`` with the checkpoint's ``opt_param_scheduler`` recorded, where
    it has one of plain values."""
    sched = common.get("opt_param_scheduler")
    if not isinstance(sched, dict):
        return model
    try:
        return with_param(model, SCHEDULER, json.dumps(sched, sort_keys=True))
    except (TypeError, ValueError):
        return model


def common_optimizer(model: ModelSpec, step: int, ep: int, notes: list[str] | None
                     ) -> dict[str, Any]:
    """What ``common.pt`` holds of the optimizer for ``model`` at ``step``
    and expert parallelism ``ep``: ``optimizer`` (its groups, the step; a
    chain of a dense and an expert optimizer where ``ep > 1``, as
    megatron-core builds it) and the recorded ``opt_param_scheduler``
    (module docstring)."""
    groups = megatron_groups(model, ep)
    settings, said = settings_for(model, [names for _, names in groups])
    if notes is not None:
        notes.extend(said)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]).state_dict()
    base = {k: v for k, v in adam["param_groups"][0].items() if k != "params"}
    chain: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for (key, _), mine in zip(groups, settings, strict=True):
        g = {**base, "default_config": True, "max_lr": base["lr"], "min_lr": None,
             **(mine or {}), **dict(zip(GROUP_KEYS, key)), "step": step}
        chain[key[2]].append(g)
    saved = [{"optimizer": {"param_groups": gs,
                            "state": {"common_step": torch.tensor(float(step))}},
              "param_state_sharding_type": CONTENT["distrib_optim_sharding_type"]}
             for gs in (chain[False], chain[True]) if gs]
    out: dict[str, Any] = {"optimizer": saved[0] if len(saved) == 1 else dict(enumerate(saved))}
    sched = dict(model.params).get(SCHEDULER)
    if sched is not None:
        out["opt_param_scheduler"] = json.loads(str(sched))
    return out
