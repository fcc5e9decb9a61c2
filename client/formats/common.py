"""What every checkpoint format shares: a source of logical tensors, the
model it describes, and writing it as a new job (or reading a job back).

A format reader (``ckpt_megatron``, ``ckpt_dcp``, ``ckpt_torch``) turns a
checkpoint into a :class:`Source`: job tensor name → shape, dtype and a
function that produces the logical (whole, unpadded) tensor when asked, so
that only one tensor needs to be in memory at a time. Optimizer state uses
the job's names (``optim/exp_avg/<name>``, ``optim/exp_avg_sq/<name>``,
``optim/master/<name>``).

:func:`import_source` then checks the source against the model, fills
what the model needs and the checkpoint lacks (zero Adam moments, fp32
master copies, the output layer tied to the embedding) and writes version
1 of the job on the hosts that hold each sub-tensor, committing it on all
hosts at once (or on none).
"""

from __future__ import annotations

import argparse
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.state import DTYPE_NAMES, TORCH_DTYPES, progress_bar, to_numpy
from ptcfs.errors import CheckpointError, InvalidConfig, PeerError, PtcError
from ptcfs.jobstate import JobState
from ptcfs.model.specfile import encode_spec
from ptcfs.plan.reshard import cut, merge
from ptcfs.sharding import slice_for, validate
from ptcfs.types import Host, ModelSpec, ParallelConfig, TensorSpec

__all__ = [
    "Entry",
    "held",
    "Source",
    "import_source",
    "infer_model",
    "torch_load",
    "dtype_of",
    "default_hosts",
    "check_source",
    "new_state",
    "read_sub",
    "read_mp_sub",
    "from_numpy",
    "plain_settings",
    "torch_groups",
    "tp_merged",
]



@dataclass
class Entry:
    """One logical tensor of a checkpoint; ``where`` names its file(s)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]
    where: str


@dataclass
class Source:
    """A checkpoint as logical tensors by job name.

    ``model``: the preset text when the checkpoint records enough to say
    it (Megatron's arguments); ``step``: its training step; ``native``: the
    configuration it was saved under, when it has one; ``chunks`` and
    ``ranks``: a DCP checkpoint's, from which the mesh is inferred. ``spec``: the whole
    model (parameters, no optimizer state) when the checkpoint describes it
    (a Hugging Face ``config.json``, a spec a DCP export recorded), with
    ``dtype`` the job's dtype and ``model`` the text that names it for display.
    """

    tensors: dict[str, Entry]
    step: int = 0
    model: str | None = None
    spec: ModelSpec | None = None
    native: str | None = None  # the mesh it was saved under, as --config text
    notes: list[str] = field(default_factory=list)
    dtype: str | None = None
    #: a sharded checkpoint's chunks (job name → their (offsets, sizes)), how
    #: many ranks wrote it, and which ranks wrote each tensor's chunks: the
    #: mesh it was saved under is inferred from them
    chunks: dict[str, frozenset[tuple[tuple[int, ...], tuple[int, ...]]]] = \
        field(default_factory=dict)
    ranks: int = 0
    writers: dict[str, frozenset[int]] = field(default_factory=dict)
    #: the configuration it was exported at (``--config`` text), when it records it
    mesh: str | None = None
    #: the optimizer's groups: each one's settings and the job tensors it
    #: covers (:mod:`ptcfs.model.optgroups`), recorded in the job's spec
    groups: list[tuple[dict[str, Any], list[str]]] = field(default_factory=list)
    #: entries the job keeps to give back on export, as a save through the
    #: mount keeps them (:class:`ptcfs.dcp.layout.Saved`, encoded): torchtitan's
    #: trainer state, its keys
    kept: str = ""


def held(t: torch.Tensor, where: str) -> Entry:
    """An :class:`Entry` of a tensor already in memory (or memory-mapped)."""
    return Entry(tuple(t.shape), t.dtype, lambda: t, where)


def plain_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings without its ``params``, one-element tensors
    (a learning rate kept as a tensor) as numbers."""
    return {str(k): v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
            for k, v in group.items() if k != "params"}


def torch_groups(optim: dict[str, Any], order: list[str]) -> list[tuple[dict[str, Any], list[str]]]:
    """The groups of a ``torch.optim`` state dict whose ``params`` are the
    positions of ``order``'s tensors (or their names): settings and names."""
    ids = [p for g in optim.get("param_groups", []) for p in g.get("params", [])]
    pos = {p: i for i, p in enumerate(ids)}
    out = []
    for g in optim.get("param_groups", []):
        if not isinstance(g, dict):
            continue
        names = [p if isinstance(p, str) else order[pos[p]] for p in g.get("params", [])
                 if isinstance(p, str) or pos.get(p, len(order)) < len(order)]
        out.append((plain_settings(g), names))
    return out


def dtype_of(t: torch.dtype, where: str) -> str:
    """The ptcfs name of a torch dtype."""
    try:
        return DTYPE_NAMES[t]
    except KeyError:
        raise CheckpointError(f"{where}: dtype {t} has no ptcfs equivalent") from None


def torch_load(path: Path, trust: bool = False, allowed: tuple[Any, ...] = ()) -> Any:
    """``torch.load`` of a checkpoint file, memory-mapped when it can be.
    Without ``trust`` only tensors, containers, numbers,
    ``argparse.Namespace`` and ``allowed`` (globals, or ``(stand-in,
    "module.Name")`` pairs as ``torch.serialization.safe_globals`` takes
    them) are unpickled."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    mmap = zipfile.is_zipfile(path)  # only the zip format maps; old files load whole
    try:
        if trust:
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
        with torch.serialization.safe_globals([argparse.Namespace, *allowed]):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling raises anything; name the file
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        hint = ("; if you trust the file, add --trust-pickle"
                if "weights_only" in text and not trust else "")
        raise CheckpointError(f"{path}: cannot read it with torch.load: {first}{hint}") from e


_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


def infer_model(src: Source, heads: int | None) -> str:
    """A GPT preset text from the checkpoint's tensor shapes (``heads`` is
    not in the shapes: it must be given)."""
    t = src.tensors

    def shape(name: str) -> tuple[int, ...]:
        if name not in t:
            raise CheckpointError(f"the checkpoint has no {name}; it is not a GPT of the "
                                  "Megatron layout (its tensors: " + ", ".join(sorted(t)[:4])
                                  + ", ...): describe its model in a spec file (`ptcctl spec "
                                  "--model PRESET` or `ptcctl spec --from-hf DIR` writes one to "
                                  "start from, names as in the checkpoint) and import with "
                                  "--model-spec FILE")
        return t[name].shape

    vocab, hidden = shape("embedding.word_embeddings.weight")
    seq, _ = shape("embedding.position_embeddings.weight")
    layers = 1 + max((int(m.group(1)) for n in t if (m := _LAYER.match(n))), default=-1)
    if layers < 1:
        raise CheckpointError("the checkpoint has no encoder.layers.<i>.* tensors")
    _, ffn = shape("encoder.layers.0.mlp.dense_4h_to_h.weight")
    up, _ = shape("encoder.layers.0.mlp.dense_h_to_4h.weight")
    swiglu = int(up == 2 * ffn)
    if heads is None:
        raise CheckpointError("the checkpoint does not record the number of attention heads: "
                              "give --heads N (or --model gpt:...)")
    return (f"gpt:layers={layers},hidden={hidden},heads={heads},vocab={vocab},ffn={ffn},"
            f"seq={seq},swiglu={swiglu}")


def default_hosts(hosts: list[tuple[str, int]], world: int) -> tuple[Host, ...]:
    """The first hosts of the cluster file, in order, until ``world`` ranks fit."""
    out: list[Host] = []
    room = 0
    for name, gpus in hosts:
        if room >= world:
            break
        out.append(Host(name, gpus))
        room += gpus
    if room < world:
        raise InvalidConfig(f"{world} ranks do not fit on the cluster's {room} GPUs")
    return tuple(out)


def _values(spec: TensorSpec, src: Source, made: dict[str, np.ndarray]) -> np.ndarray:
    """The logical value of ``spec`` from the source, or derived."""
    from ptcfs.dtypes import numpy_dtype

    e = src.tensors.get(spec.name)
    if e is not None:
        return to_numpy(e.get().to(TORCH_DTYPES[spec.dtype]))
    if spec.same_as is not None:
        if spec.same_as in made:
            return made[spec.same_as]
        return _values(TensorSpec(spec.same_as, spec.shape, spec.dtype, spec.rule), src, made)
    if spec.name.startswith(("optim/exp_avg/", "optim/exp_avg_sq/")):
        return np.zeros(spec.shape, dtype=numpy_dtype(spec.dtype))
    if spec.name.startswith("optim/master/"):
        base = src.tensors[spec.name[len("optim/master/"):]]
        return to_numpy(base.get().to(torch.float32))
    raise CheckpointError(f"the checkpoint has no {spec.name}")


def check_source(src: Source, state: JobState) -> None:
    """Every checkpoint tensor belongs to the model, with its shape."""
    model = state.model_spec()
    specs = {s.name: s for s in model.tensors + model.pp_only}
    for name, e in src.tensors.items():
        spec = specs.get(name)
        if spec is None:
            raise CheckpointError(f"{e.where}: tensor {name} is not part of {state.model}")
        if tuple(e.shape) != spec.shape:
            raise CheckpointError(f"{e.where}: tensor {name} has shape {tuple(e.shape)}; "
                                  f"{state.model} needs {spec.shape}")
    for spec in model.tensors:
        if spec.name not in src.tensors and not spec.name.startswith("optim/"):
            raise CheckpointError(f"the checkpoint lacks tensor {spec.name} of {state.model}")


def import_source(coord: Coordinator, src: Source, state: JobState,
                  progress: bool | None = None) -> JobState:
    """Write ``src`` as version 1 of a new job described by ``state`` (owned
    by the caller unless it names an owner)."""
    from ptcfs.client.control.access import created_by

    state = created_by(state, coord.cluster.key_name)
    model = state.model_spec()
    validate(model, state.config)
    check_source(src, state)
    cluster = coord.cluster
    unknown = [h.name for h in state.config.hosts if h.name not in cluster.hosts]
    if unknown:
        raise InvalidConfig(f"hosts not in the cluster file: {', '.join(unknown)}")
    existing, down = cluster.call_all("versions", job=state.job)
    if down:
        raise PeerError(f"hosts not answering: {', '.join(down)}; cannot import")
    if any(existing.values()):
        raise InvalidConfig(f"job {state.job!r} exists already; pick another name")
    hosts = list(cluster.hosts)
    meta = state.to_meta()
    specs = model.tensors_for(state.config.pp)
    total = sum(s.nbytes for s in specs) * state.replicas
    cluster.call_hosts(hosts, "begin_at", job=state.job, version=state.version, meta=meta)
    try:
        made: dict[str, np.ndarray] = {}
        tied = {s.same_as for s in specs if s.same_as}
        with progress_bar(total, f"import {state.job}", progress) as tick:
            for spec in specs:
                logical = _values(spec, src, made)
                if spec.name in tied:
                    made[spec.name] = logical
                for sl, on in state.placement(spec, model).items():
                    sub = cut(spec, sl, logical)
                    for h in on:
                        cluster.client(h).put(state.job, state.version, spec.name, sl.key(),
                                              sub, spec.dtype)
                        tick(sub.nbytes)
    except BaseException:
        cluster.call_hosts(hosts, "abort", job=state.job, version=state.version, quiet=True)
        raise
    cluster.call_hosts(hosts, "commit", job=state.job, version=state.version, meta=meta)
    return state


def new_state(job: str, model: str, dtype: str, optimizer: str, cfg: ParallelConfig, step: int,
              coord: Coordinator, spec: ModelSpec | None = None) -> JobState:
    """Version 1 of a job on ``coord``'s cluster; ``spec``: the whole model
    (else ``model`` is a preset text that gives it)."""
    return JobState(job, 1, model, dtype, optimizer, cfg, step, coord.cluster.replicas,
                    tuple(coord.cluster.hosts), encode_spec(spec) if spec else "")


def read_sub(coord: Coordinator, state: JobState, spec: TensorSpec, sl: Any) -> np.ndarray:
    """One stored sub-tensor of the job (padding rows included), from the
    first live host that holds it."""
    from ptcfs.dtypes import numpy_dtype

    where = state.placement(spec)
    out = np.empty(sl.local_shape(spec.shape), dtype=numpy_dtype(spec.dtype))
    errors = []
    for h in where.get(sl, {}):
        try:
            coord.cluster.client(h).peer.read_into(state.job, state.version, spec.name,
                                                   sl.key(), 0, out.nbytes,
                                                   out.reshape(-1).view(np.uint8))
            return out
        except PtcError as e:
            errors.append(f"{h}: {e}")
    raise PeerError(f"cannot read {spec.name} [{sl.key()}] of job {state.job!r}: "
                    + ("; ".join(errors) or "no host holds it"))


def read_mp_sub(coord: Coordinator, state: JobState, spec: TensorSpec, sl: Any) -> np.ndarray:
    """A model-parallel (tp, pp) rank's sub-tensor ``sl``: stored as it is, or
    cut from the logical tensor when data parallelism shards it (fsdp, zero=1)."""
    if sl in state.placement(spec):
        return read_sub(coord, state, spec, sl)
    return cut(spec, sl, coord.fetch_tensor(state, spec.name))


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor of ptcfs ``dtype`` from its numpy array (bf16 from uint16)."""
    t = torch.from_numpy(np.ascontiguousarray(a).reshape(np.shape(a)))  # 0-d stays 0-d
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def tp_merged(spec: TensorSpec, parts: dict[int, Callable[[], torch.Tensor]], tp: int,
              where: str) -> Callable[[], torch.Tensor]:
    """The logical tensor ``spec`` from its ``tp`` tensor-parallel shards,
    ``parts[r]()`` giving rank r's (in their own dtype), when called."""
    def get() -> torch.Tensor:
        if sorted(parts) != list(range(tp)):
            missing = sorted(set(range(tp)) - set(parts))
            raise CheckpointError(f"{where}: tp ranks {missing} have no shard of it")
        shards = {r: parts[r]() for r in range(tp)}
        name = dtype_of(shards[0].dtype, where)
        s = TensorSpec(spec.name, spec.shape, name, spec.rule, spec.same_as)
        cfg = ParallelConfig(tp, 1, 1, (Host("any", tp),))
        arrays = [(slice_for(s, cfg, r), to_numpy(shards[r])) for r in range(tp)]
        for r, (sl, a) in enumerate(arrays):
            if tuple(a.shape) != sl.local_shape(s.shape):
                raise CheckpointError(f"{where}: tp shard {r} has shape {tuple(a.shape)}, "
                                      f"expected {sl.local_shape(s.shape)}")
        return from_numpy(merge(s, arrays), name)

    return get
