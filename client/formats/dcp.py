"""PyTorch distributed checkpoints (``torch.distributed.checkpoint``).

Layout: a directory with ``.metadata`` and ``__<rank>_<n>.distcp`` files,
as ``dcp.save`` writes it from any number of ranks. The state dict is the
one of torch's own recipe,
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``,
so its keys are ``model.<name>`` and ``optim.state.<name>.exp_avg`` /
``.exp_avg_sq`` / ``.step`` (``optimizer.`` is accepted for ``optim.``; a
checkpoint of a bare model state dict, keys ``<name>``, is too). Tensors
saved sharded (DTensors of FSDP2 and tensor parallelism, from several
ranks) are read from their chunks as the checkpoint's metadata lists them:
each tensor on its own, when it is written, reading only its chunks'
bytes; a tensor whose chunks do not cover it is refused.

The model: the checkpoint's ``ptcfs_spec`` or ``ptcfs_model`` when it has
them (ptcfs's export writes both), else recognised from the names
(:func:`~ptcfs.model.recognize.llama_hf`: Hugging Face LLaMA names need no
``--heads``), else the GPT preset of :func:`~ptcfs.client.formats.common.infer_model`.
The optimizer's settings per group (``optim.param_groups.<i>.*``: learning
rate, betas, weight decay...) are recorded with the parameters each group
names (:mod:`ptcfs.model.optgroups`), for every export to write back.
``ptcfs_param.<name>`` (a bf16 or fp16 parameter whose fp32 master is
``model.<name>``) and ``master.<name>`` (an fp32 master) are read as the
export of :mod:`~ptcfs.client.formats.dcp_layout` writes them.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Entry, Source, dtype_of, plain_settings
from ptcfs.client.formats.dcp_box import reader as dcp_reader
from ptcfs.client.formats.dcp_layout import PARAM_KEY, write_dcp
from ptcfs.dcp.titan import is_titan
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.recognize import llama_hf
from ptcfs.model.specfile import decode_spec

__all__ = ["read_dcp", "write_dcp"]

_KINDS = ("exp_avg", "exp_avg_sq")
_EXTRA = ("step", "ptcfs_model", "ptcfs_spec", "ptcfs_config")
_GROUP_KEY = re.compile(r"^(?:optim|optimizer)\.param_groups\.(\d+)\.(\w+)$")


def _load(path: Path, sd: dict[str, Any], reader: Any = None) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=reader or dcp_reader(path), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP wraps failures in its own types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: DCP cannot load {', '.join(sd)}: {first}") from e


def _job_name(key: str, masters: set[str]) -> str | None:
    """The job tensor name of a DCP key, or None for keys that carry none;
    ``masters``: parameters whose ``model.<name>`` is the fp32 master."""
    for prefix in ("optim.state.", "optimizer.state."):
        if key.startswith(prefix):
            rest, _, kind = key[len(prefix):].rpartition(".")
            return f"optim/{kind}/{rest}" if kind in _KINDS else None
    if key.startswith(("optim.", "optimizer.")):
        return None
    if key.startswith("master."):
        return f"optim/master/{key[len('master.'):]}"
    if key.startswith(PARAM_KEY + "."):
        return key[len(PARAM_KEY) + 1:]
    name = key.removeprefix("model.")
    return f"optim/master/{name}" if name in masters else name


def _covered(key: str, meta: Any, path: Path) -> None:
    """The chunks of a tensor cover it (DCP stores each box once)."""
    whole = 1
    for n in meta.size:
        whole *= n
    have = 0
    for c in meta.chunks:
        n = 1
        for k in c.sizes:
            n *= k
        have += n
    if have != whole:
        raise CheckpointError(f"{path} [{key}]: the chunks hold {have} of the tensor's {whole} "
                              "elements; the checkpoint is incomplete")


def read_metadata(path: Path, missing: str = "not a torch.distributed.checkpoint directory",
                  reader: Any = None) -> Any:
    """DCP's metadata of the checkpoint at ``path`` (through ``reader``, else
    a new one); ``missing`` says what the folder is not when it has no
    ``.metadata``."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: no .metadata file; {missing}")
    try:
        return (reader or dcp_reader(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - DCP raises anything on a bad file
        raise CheckpointError(f"{path}/.metadata: cannot be read: {e}") from e


def read_dcp(path: Path, heads: int | None = None) -> Source:
    """A :class:`Source` from a DCP directory (see the module docstring)."""
    reader = dcp_reader(path)
    md = read_metadata(path, reader=reader)
    items = md.state_dict_metadata
    nested = any(k.startswith("model.") for k in items)
    masters = {k[len(PARAM_KEY) + 1:] for k in items if k.startswith(PARAM_KEY + ".")}
    tensors: dict[str, Entry] = {}
    chunks: dict[str, frozenset[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    names: dict[str, str] = {}  # DCP key → job name
    steps: list[str] = []
    for key, meta in items.items():
        if not hasattr(meta, "size"):
            continue  # bytes: param groups, step, notes
        if key.endswith(".step") and key.startswith(("optim.state.", "optimizer.state.")):
            steps.append(key)
            continue
        if nested and not key.startswith(("model.", "optim", "master.", PARAM_KEY + ".")):
            continue
        name = _job_name(key, masters)
        if name is None:
            continue
        _covered(key, meta, path)
        names[key] = name
        chunks[name] = frozenset((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
        tensors[name] = Entry(tuple(meta.size), meta.properties.dtype,
                              _getter(path, reader, key, tuple(meta.size),
                                      meta.properties.dtype), f"{path} [{key}]")
    small: dict[str, Any] = {k: None for k in items
                             if k in _EXTRA or _GROUP_KEY.match(k) is not None}
    if small:
        _load(path, small, reader)
    extra = {k: small[k] for k in _EXTRA if k in small}
    step = extra.get("step")
    if step is None and steps:
        t = torch.empty(())
        _load(path, {steps[0]: t}, reader)
        step = int(t.item())
    writers = _writers(md)
    src = Source(tensors, int(step or 0), chunks=chunks, ranks=len(set().union(
        *writers.values())), writers={names[k]: frozenset(r) for k, r in writers.items()
                                      if k in names}, groups=_groups(small))
    model, spec = extra.get("ptcfs_model"), extra.get("ptcfs_spec")
    if isinstance(extra.get("ptcfs_config"), str):
        src.mesh = extra["ptcfs_config"]
    if isinstance(spec, str):
        src.spec = decode_spec(spec)
        src.model = model if isinstance(model, str) else src.spec.name
    elif isinstance(model, str):
        src.model = model
    else:
        params = {n: e for n, e in tensors.items() if not n.startswith("optim/")}
        if params:
            first = next(iter(params.values()))
            known = llama_hf({n: e.shape for n, e in params.items()},
                             dtype_of(first.dtype, first.where), heads)
            if known is not None:
                src.model, spec = known
                src.spec = None if heads is not None else spec
    return src


def _groups(small: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    """The optimizer's groups of the loaded ``optim.param_groups.<i>.<key>``
    entries (``get_optimizer_state_dict`` names each group's parameters)."""
    by_index: dict[int, dict[str, Any]] = {}
    for key, value in small.items():
        m = _GROUP_KEY.match(key)
        if m is not None:
            by_index.setdefault(int(m.group(1)), {})[m.group(2)] = value
    out = []
    for _, group in sorted(by_index.items()):
        params = group.get("params")
        if isinstance(params, list) and all(isinstance(p, str) for p in params):
            out.append((plain_settings(group), list(params)))
    return out


def _getter(path: Path, reader: Any, key: str, shape: tuple[int, ...],
            dtype: torch.dtype) -> Any:
    def get() -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        _load(path, {key: t}, reader)
        return t

    return get


def _writers(md: Any) -> dict[str, set[int]]:
    """The ranks that wrote each key's chunks: its data files are
    ``__R_N.distcp``, R the rank."""
    out: dict[str, set[int]] = {}
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        m = re.match(r"__(\d+)_", str(getattr(info, "relative_path", "")))
        if m:
            out.setdefault(str(getattr(index, "fqn", "")), set()).add(int(m.group(1)))
    return out


def read(path: Path, options: ReadOptions) -> Source:
    """The ``torch-dcp`` row of :data:`ptcfs.client.formats.FORMATS`; a
    torchtitan checkpoint is sent to its own format, which keeps its entries."""
    if (path / ".metadata").is_file():
        try:
            keys = list(dcp_reader(path).read_metadata().state_dict_metadata)
        except Exception:  # noqa: BLE001 - read_dcp says what is wrong with it
            keys = []
        if is_titan(keys):
            raise CheckpointError(f"{path}: a torchtitan checkpoint (train_state, lr_scheduler, "
                                  "dataloader, optimizer entries by parameter name): import it "
                                  "with --format torchtitan, which keeps them for its export")
    return read_dcp(path, options.heads)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    write_dcp(coord, state, path, progress)
