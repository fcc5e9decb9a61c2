"""PyTorch distributed checkpoints (``torch.distributed.checkpoint``).

Layout: a directory with ``.metadata`` and ``__<rank>_<n>.distcp`` files,
as ``dcp.save`` writes it from any number of ranks. The state dict is the
one of torch's own recipe,
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``,
so its keys are ``model.<name>`` and ``optim.state.<name>.exp_avg`` /
``.exp_avg_sq`` / ``.step`` (``optimizer.`` is accepted for ``optim.``; a
checkpoint of a bare model state dict, keys ``<name>``, is too). Tensors
saved sharded (DTensor, from several ranks) are read whole: DCP puts the
chunks together. Each tensor is read on its own, when it is written.

``export`` writes the same layout from one process, with ``step``,
``master.<name>`` (fp32 master weights of fp16/bf16 jobs) and
``ptcfs_model`` (the model preset) added.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.ckpt_common import CheckpointError, Entry, Source, from_numpy
from ptcfs.client.coordinator import Coordinator
from ptcfs.client.torchstate import progress_bar
from ptcfs.jobstate import JobState

__all__ = ["read_dcp", "write_dcp"]

_KINDS = ("exp_avg", "exp_avg_sq")


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _load(path: Path, sd: dict[str, Any]) -> None:
    dcp = _dcp()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP wraps failures in its own types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: DCP cannot load {', '.join(sd)}: {first}") from e


def _job_name(key: str) -> str | None:
    """The job tensor name of a DCP key, or None for keys that carry none."""
    for prefix in ("optim.state.", "optimizer.state."):
        if key.startswith(prefix):
            rest, _, kind = key[len(prefix):].rpartition(".")
            return f"optim/{kind}/{rest}" if kind in _KINDS else None
    if key.startswith(("optim.", "optimizer.")):
        return None
    if key.startswith("master."):
        return f"optim/master/{key[len('master.'):]}"
    return key.removeprefix("model.")


def read_dcp(path: Path) -> Source:
    """A :class:`Source` from a DCP directory (see the module docstring)."""
    dcp = _dcp()
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: no .metadata file; not a torch.distributed.checkpoint "
                              "directory")
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}/.metadata: cannot be read: {e}") from e
    items = md.state_dict_metadata
    nested = any(k.startswith("model.") for k in items)
    tensors: dict[str, Entry] = {}
    steps: list[str] = []
    for key, meta in items.items():
        if not hasattr(meta, "size"):
            continue  # bytes: param groups, step, notes
        if key.endswith(".step") and key.startswith(("optim.state.", "optimizer.state.")):
            steps.append(key)
            continue
        if nested and not key.startswith(("model.", "optim", "master.")):
            continue
        name = _job_name(key)
        if name is None:
            continue
        tensors[name] = Entry(tuple(meta.size), meta.properties.dtype,
                              _getter(path, key, tuple(meta.size), meta.properties.dtype),
                              f"{path} [{key}]")
    extra: dict[str, Any] = {k: None for k in ("step", "ptcfs_model") if k in items}
    if extra:
        _load(path, extra)
    step = extra.get("step")
    if step is None and steps:
        t = torch.empty(())
        _load(path, {steps[0]: t})
        step = int(t.item())
    model = extra.get("ptcfs_model")
    return Source(tensors, int(step or 0), model=model if isinstance(model, str) else None)


def _getter(path: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    def get() -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        _load(path, {key: t})
        return t

    return get


def write_dcp(coord: Coordinator, state: JobState, path: Path,
              progress: bool | None = None) -> Path:
    """A DCP directory with the job's logical tensors (see the module docstring)."""
    model = state.model_spec()
    values: dict[str, torch.Tensor] = {}
    with progress_bar(sum(s.nbytes for s in model.tensors), f"export {state.job}",
                      progress) as tick:
        for s in model.tensors:
            values[s.name] = from_numpy(coord.fetch_tensor(state, s.name), s.dtype)
            tick(s.nbytes)
    params = [n for n in values if not n.startswith("optim/")]
    sd: dict[str, Any] = {"model": {n: values[n] for n in params}, "step": state.step,
                          "ptcfs_model": state.model}
    if state.optimizer == "adam":
        from ptcfs.client.ckpt_torch import adam_groups

        groups = adam_groups(len(params))
        groups[0]["params"] = list(params)
        sd["optim"] = {
            "state": {n: {"step": torch.tensor(float(state.step)),
                          "exp_avg": values[f"optim/exp_avg/{n}"],
                          "exp_avg_sq": values[f"optim/exp_avg_sq/{n}"]} for n in params},
            "param_groups": groups,
        }
        masters = {n: values[f"optim/master/{n}"] for n in params
                   if f"optim/master/{n}" in values}
        if masters:
            sd["master"] = masters
    path.mkdir(parents=True, exist_ok=True)
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path
