"""Import and export of whole checkpoints, by format (the logic behind
``ptcctl import`` and ``ptcctl export``).

Formats: the rows of :data:`ptcfs.client.formats.FORMATS`, a module each.
An import creates version 1 of a new job; an export writes the job's
current (or a given) committed version.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ptcfs.client import formats
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import (
    Entry,
    Source,
    default_hosts,
    dtype_of,
    import_source,
    infer_model,
    new_state,
)
from ptcfs.client.formats.mesh_infer import infer_mesh
from ptcfs.errors import CheckpointError, InvalidConfig
from ptcfs.jobstate import JobState
from ptcfs.model.modelkit import fused_qkv, qkv_rows_per_group, with_optimizer
from ptcfs.model.optgroups import record
from ptcfs.model.specfile import encode_spec, load_spec_file
from ptcfs.sharding import parse_config, parse_hosts
from ptcfs.types import Host, ModelSpec

__all__ = ["QKV_ORDERS", "ImportResult", "read_source", "import_checkpoint",
           "export_checkpoint"]

#: How a plain state dict's fused query/key/value rows go (``--qkv-order``).
QKV_ORDERS = ("per-head", "grouped")


@dataclass
class ImportResult:
    state: JobState
    tensors: int
    nbytes: int
    notes: list[str]


def read_source(path: Path, fmt: str, heads: int | None = None, trust: bool = False,
                optimizer: str | None = None, model_spec: Path | None = None,
                model: str | None = None) -> Source:
    """The checkpoint at ``path`` in format ``fmt``, as logical tensors
    (``optimizer="none"``: optimizer state need not be read; ``model_spec``:
    a spec file that describes an ``hf`` directory's model; ``model``: the
    preset, for formats whose names depend on it)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    options = ReadOptions(heads=heads, trust=trust, optimizer=optimizer != "none",
                          model_spec=model_spec, model=model)
    source: Source = formats.module(fmt).read(path, options)
    return source


def _check_qkv_order(src: Source, model: ModelSpec, fmt: str, order: str | None,
                     path: Path) -> None:
    """A model with fused query/key/value weights (:func:`fused_qkv`) cuts
    their rows per head for tensor parallelism. Every format records how
    its rows go but a plain state dict or DCP checkpoint (``torch`` without
    the ``ptcfs`` key, ``torch-dcp`` without the spec, that an export adds),
    where a GPT-2 or HF model renamed to these names looks exactly like a
    right one: the user says (``per-head``: as
    Megatron stores them; ``grouped``: all q rows, then k, then v, which
    the import reorders, moments and masters too)."""
    if order is not None and order not in QKV_ORDERS:
        raise InvalidConfig(f"--qkv-order must be one of {', '.join(QKV_ORDERS)}, not {order!r}")
    fused = {n: v for n, v in fused_qkv(model).items() if n in src.tensors}
    if fmt not in ("torch", "torch-dcp") or src.model is not None or src.spec is not None:
        if order is not None:
            raise InvalidConfig(f"{path} records how its query/key/value rows go; leave out "
                                "--qkv-order")
        return
    if not fused:
        if order is not None:
            src.notes.append("--qkv-order: the model has no fused query/key/value weights")
        return
    if order is None:
        raise InvalidConfig(
            f"{path}: a plain {fmt} checkpoint does not record the row order of its fused "
            f"query/key/value weights ({next(iter(fused))}, ...): give --qkv-order per-head "
            "(Megatron's: the q, k and v rows of each head, or of each query group with GQA) "
            "or --qkv-order grouped (all q rows, then k, then v: GPT-2's c_attn transposed, "
            "HF's q/k/v projections stacked; they are reordered)")
    if order == "per-head":
        return
    def reordered(e: Entry, rows: torch.Tensor) -> Entry:
        return replace(e, get=lambda: e.get()[rows])

    for name, (heads, kv, hd) in fused.items():
        rows = torch.from_numpy(qkv_rows_per_group(heads, kv, hd))
        for key in (name, *(f"optim/{k}/{name}" for k in ("exp_avg", "exp_avg_sq", "master"))):
            if key in src.tensors:
                src.tensors[key] = reordered(src.tensors[key], rows)
    src.notes.append(f"reordered the rows of {len(fused)} fused query/key/value tensors from "
                     "grouped (q, k, v) to per head")


def import_checkpoint(coord: Coordinator, job: str, path: Path, fmt: str, *,
                      model: str | None = None, heads: int | None = None,
                      optimizer: str | None = None, degrees: str | None = None,
                      hosts: str | None = None, trust: bool = False,
                      progress: bool | None = None,
                      model_spec: Path | None = None,
                      access: dict[str, Any] | None = None,
                      qkv_order: str | None = None) -> ImportResult:
    """Create job ``job`` from the checkpoint at ``path``.

    ``model``: the preset text (default: the model the checkpoint describes
    or records, or one recognised from its names, with ``heads`` when it
    does not record them); ``model_spec``: a spec file instead (tensor
    names as in the checkpoint); ``optimizer``: ``adam`` or ``none``
    (default: ``adam`` when the checkpoint has Adam state);
    ``degrees``/``hosts``: the job's configuration (default: the
    checkpoint's mesh where it says or, for DCP, its chunks show it (the
    hosts, when given, having that many GPUs), else its tp and pp, dp=1;
    on the first hosts of the cluster file);
    ``access``: the job's ``owner`` and ``mode`` (default: the caller, 0640);
    ``qkv_order``: how a plain state dict's fused query/key/value rows go
    (:data:`QKV_ORDERS`, see :func:`_check_qkv_order`).
    """
    src = read_source(path, fmt, heads, trust, optimizer, model_spec, model)
    if model is not None and fmt == "hf" and src.spec is not None:
        raise InvalidConfig(f"{path} describes its model; leave out --model")
    if model_spec is not None:
        spec: ModelSpec | None = src.spec or load_spec_file(str(model_spec))
        text = src.model or f"spec:{model_spec.name}"
    else:
        spec = src.spec if model is None else None
        text = model or src.model or (spec.name if spec else infer_model(src, heads))
    first = next((e for n, e in src.tensors.items() if not n.startswith("optim/")), None)
    if first is None:
        raise CheckpointError(f"{path}: the checkpoint holds no model tensors")
    dtype = src.dtype or dtype_of(first.dtype, first.where)
    has_adam = any(n.startswith("optim/exp_avg/") for n in src.tensors)
    adamw = spec is not None and ("optimizer", "adamw") in spec.params
    opt = optimizer or (("adamw" if adamw else "adam") if has_adam else "none")
    if opt == "none":
        src.tensors = {n: e for n, e in src.tensors.items() if not n.startswith("optim/")}
    mesh = degrees or src.native or "tp=1,pp=1"
    full = _with_state(spec, opt) if spec is not None else None
    probe = new_state(job, text, dtype, opt, parse_config("tp=1", (Host("any", 1),)),
                      src.step, coord, full)
    if src.kept:
        probe = probe.with_(dcp=src.kept)
    if src.groups and opt != "none":
        kept, note = record(probe.model_spec(), src.groups)
        probe = probe.with_(spec=encode_spec(kept))
        if note is not None:
            src.notes.append(f"{path}: {note}")
    _check_qkv_order(src, probe.model_spec(), fmt, qkv_order, path)
    inferred, how = None, ""
    if degrees is None and src.native is None and src.mesh is not None:
        inferred, how = src.mesh, "the mesh it was exported at"
    elif degrees is None and src.native is None and src.chunks:
        inferred = infer_mesh(probe.model_spec(), src.chunks, src.ranks, src.writers)
        how = "the mesh it was saved under, from its chunks"
    if inferred is not None:
        world = parse_config(inferred, (Host("any", 1),)).world
        if (sum(h.gpus for h in parse_hosts(hosts)) if hosts else world) == world:
            mesh = inferred
            src.notes.append(f"{how}: {inferred} (give --config for another)")
    world = parse_config(mesh, (Host("any", 1),)).world
    hs = parse_hosts(hosts) if hosts else default_hosts(
        [(h.name, h.gpus) for h in coord.cluster.spec.hosts], world)
    cfg = parse_config(mesh, hs)
    state = probe.with_(config=cfg)
    state = state.with_(**(access or {}))
    import_source(coord, src, state, progress)
    specs = state.model_spec().tensors_for(cfg.pp)
    return ImportResult(state, len(src.tensors), sum(s.nbytes for s in specs), src.notes)


def _with_state(spec: ModelSpec, optimizer: str) -> ModelSpec:
    """``spec`` with the state of ``optimizer`` (and only that)."""
    bare = replace(spec, tensors=tuple(t for t in spec.tensors if not t.is_optim),
                   pp_only=tuple(t for t in spec.pp_only if not t.is_optim),
                   params=tuple(p for p in spec.params if p[0] != "optimizer"))
    return with_optimizer(bare, optimizer)


def export_checkpoint(coord: Coordinator, job: str, path: Path, fmt: str,
                      version: int | None = None, progress: bool | None = None,
                      notes: list[str] | None = None) -> JobState:
    """Write the job's committed state (``version``, default the current one)
    to ``path`` in format ``fmt``; ``notes`` gets what the format could not
    keep as the job has it (optimizer settings its groups cannot tell apart)."""
    state = coord.state(job)
    if version is not None and version != state.version:
        state = _version(coord, job, version)
    formats.module(fmt).write(coord, state, path, progress, notes)
    return state


def _version(coord: Coordinator, job: str, version: int) -> JobState:
    per_host, _ = coord.host_versions(job)
    for versions in per_host.values():
        for v in versions:
            if v["version"] == version and v["state"] == "committed":
                return JobState.from_meta(v["meta"])
    from ptcfs.errors import VersionNotFound

    raise VersionNotFound(f"job {job!r} has no committed version {version}")
