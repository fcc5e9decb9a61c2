"""torchtitan's checkpoint keys: what each one holds of a job.

torchtitan's ``CheckpointManager`` saves with ``dcp.save`` a state dict whose
model entries are at the top level (``tok_embeddings.weight``,
``layers.0.attention.qkv_linear.wq.weight``, ...), whose optimizer is its
``OptimizersContainer`` flattened per parameter name
(``optimizer.state.<param>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` and
``optimizer.param_groups.<param>.<setting>``; the same keys without the
``optimizer.`` prefix are accepted), and ``train_state.*``,
``lr_scheduler.*`` and ``dataloader.*`` entries of its trainer.

The optimizer is keyed by *parameter* names while the model entries are
the module's state dict: torchtitan's fused query/key/value projection
(``attention.qkv_linear.wqkv.weight``, rows per key/value group: each
group's query heads, then its key head, then its value head) is saved as
``wq``/``wk``/``wv`` by a state-dict hook, but its Adam moments stay fused.
A job keeps the three parts and their moments; :data:`FUSED` names the
fused parameter of the three.

torchtitan's mixture-of-experts layer (its common ``MoE``, every MoE
model's) keeps each projection of its routed experts in one tensor, the
experts stacked on dimension 0 (``moe.routed_experts.inner_experts.w1_EFD``
of shape ``[experts, hidden, dim]``, ``w2_EDF``, ``w3_EFD``), and so do
their moments. A job keeps one tensor per expert, ``<stacked>.<j>``
(:func:`expert_name`), each with its expert's rule, as it keeps the
experts of Megatron-Core and Hugging Face models.

A fused moment is a :class:`Composite`: runs of rows of the job's ``wq``,
``wk`` and ``wv`` moments, in the order of
:func:`~ptcfs.model.modelkit.qkv_rows_per_group`. So is a stacked key
(:func:`stacked_key`: the parameter ``<stacked>`` or its moment
``optimizer.state.<stacked>.<kind>``): one run per expert, at its index of
dimension 0. :func:`composite_of` names both; that one mapping serves
every direction: the import splits by it, the export and the mount's view
(``/ptc/<job>/dcp/``, :func:`composite_chunks`) gather by it, and a
``dcp.save`` through the mount splits by it (:func:`split_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ptcfs.dcp.layout import Chunk, chunks
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.modelkit import qkv_rows_per_group
from ptcfs.types import Box, ModelSpec, TensorSpec

__all__ = ["ENTRIES", "FUSED", "GROUPED", "PARTS", "is_titan", "moment_of", "parts_of",
           "fused_of", "expert_name", "expert_of", "is_stacked", "Run", "Composite",
           "qkv_heads", "fused_runs", "fused_moment", "stacked_key", "composite_of",
           "composite_keys", "composite_chunks", "split_chunks"]

#: top-level entries of torchtitan's trainer kept as they are (bytes)
ENTRIES = ("train_state", "lr_scheduler", "dataloader")
#: the fused query/key/value parameter's suffix and its parts' suffixes
FUSED = "qkv_linear.wqkv.weight"
PARTS = ("qkv_linear.wq.weight", "qkv_linear.wk.weight", "qkv_linear.wv.weight")
_KINDS = ("exp_avg", "exp_avg_sq")
#: the module of torchtitan's grouped experts, whose tensors stack the experts
GROUPED = ".moe.routed_experts.inner_experts."


def is_titan(keys: list[str]) -> bool:
    """Keys of a torchtitan checkpoint: trainer entries, or optimizer groups
    keyed by parameter name (torch's recipe numbers them)."""
    for k in keys:
        head, _, rest = k.partition(".")
        if head in ENTRIES and rest:
            return True
        if k.startswith(("optimizer.param_groups.", "param_groups.")):
            after = k.split("param_groups.", 1)[1]
            if not after.split(".", 1)[0].isdigit():
                return True
    return False


def moment_of(key: str) -> tuple[str, str] | None:
    """``(kind, parameter)`` of an optimizer moment key
    (``optimizer.state.<param>.exp_avg``), else None."""
    for prefix in ("optimizer.state.", "state."):
        if key.startswith(prefix):
            param, _, kind = key[len(prefix):].rpartition(".")
            return (kind, param) if kind in _KINDS and param else None
    return None


def parts_of(param: str) -> tuple[str, str, str] | None:
    """The ``wq``/``wk``/``wv`` names of a fused ``wqkv`` parameter, else None."""
    if not param.endswith(FUSED):
        return None
    base = param[: -len(FUSED)]
    q, k, v = (base + p for p in PARTS)
    return q, k, v


def fused_of(name: str) -> str | None:
    """The fused parameter a ``qkv_linear.wq|wk|wv.weight`` tensor is part of."""
    for p in PARTS:
        if name.endswith(p):
            return name[: -len(p)] + FUSED
    return None


def is_stacked(param: str) -> bool:
    """A tensor of torchtitan's grouped experts (experts stacked on dimension 0)."""
    return GROUPED in param and not param.rpartition(".")[2].isdigit()


def expert_name(stacked: str, j: int) -> str:
    """The job's name of expert ``j`` of a stacked tensor (or of its moment,
    ``optim/<kind>/<stacked>``)."""
    return f"{stacked}.{j}"


def expert_of(name: str) -> tuple[str, int] | None:
    """``(stacked tensor, expert)`` of a job's expert tensor name, else None."""
    base, _, j = name.rpartition(".")
    return (base, int(j)) if j.isdigit() and is_stacked(base) else None


@dataclass(frozen=True)
class Run:
    """Rows ``at .. at + n`` of a composite tensor are rows ``lo .. lo + n``
    of the job tensor ``name``; with ``index``, the composite tensor has one
    dimension more and they are ``[index, at .. at + n]`` (a tensor of experts
    stacked on dimension 0, each expert a job tensor)."""

    at: int
    name: str
    lo: int
    n: int
    index: int | None = None


@dataclass(frozen=True)
class Composite:
    """A DCP key whose tensor (``shape``, ``dtype``) is made of rows of
    several job tensors (``runs``, covering its rows once)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    runs: tuple[Run, ...]


#: the last model's tensors by name: the view and a save ask for every key of a
#: version, and a large MoE has a hundred thousand tensors
_LAST: list[tuple[tuple[TensorSpec, ...], dict[str, TensorSpec]]] = []


def _by_name(model: ModelSpec) -> dict[str, TensorSpec]:
    last = _LAST[0] if _LAST else None
    if last is not None and last[0] is model.tensors:
        return last[1]
    specs = {s.name: s for s in model.tensors}
    _LAST[:] = [(model.tensors, specs)]
    return specs


def qkv_heads(model: ModelSpec, job: str) -> tuple[int, int]:
    """``(heads, kv_heads)`` of a job's attention, from its preset's sizes or,
    for a spec from transformers, the sizes that divide its tensors."""
    p, divides = dict(model.params), dict(model.tp_divides)
    heads = int(p.get("heads") or divides.get("num_attention_heads") or 0)
    if not heads:
        raise CheckpointError(f"job {job!r} records no attention heads, and torchtitan keeps "
                              "the moments of its query/key/value projection fused by head "
                              "group: import it with --heads N")
    return heads, int(p.get("kv_heads") or divides.get("num_key_value_heads") or heads)


def fused_runs(parts: Sequence[tuple[str, int]], heads: int, kv_heads: int
               ) -> tuple[Run, ...]:
    """The runs of a fused ``wqkv`` tensor over its parts ``(name, rows)``
    (query, key, value): per key/value group, its query heads' rows, then its
    key head's, then its value head's."""
    hd = parts[0][1] // heads
    rows = qkv_rows_per_group(heads, kv_heads, hd)
    starts = np.cumsum([0] + [n for _, n in parts])
    out: list[Run] = []
    for at, r in enumerate(rows.tolist()):
        i = int(np.searchsorted(starts, r, side="right")) - 1
        name, lo = parts[i][0], r - int(starts[i])
        last = out[-1] if out else None
        if last is not None and last.name == name and last.lo + last.n == lo:
            out[-1] = replace(last, n=last.n + 1)
        else:
            out.append(Run(at, name, lo, 1))
    return tuple(out)


def fused_moment(key: str, model: ModelSpec, job: str,
                 to_job: Mapping[str, str] | None = None) -> Composite | None:
    """The :class:`Composite` of a fused ``wqkv`` moment key
    (``optimizer.state.<..>.qkv_linear.wqkv.weight.exp_avg``) over the job's
    moments of its parts (``to_job``: torchtitan's parameter names → the
    job's, when they differ); None for any other key or a job without them."""
    m = moment_of(key)
    parts = parts_of(m[1]) if m is not None else None
    if m is None or parts is None:
        return None
    specs = _by_name(model)
    names = [f"optim/{m[0]}/{(to_job or {}).get(p, p)}" for p in parts]
    if any(n not in specs for n in names):
        return None
    ps = [specs[n] for n in names]
    heads, kv = qkv_heads(model, job)
    rows = sum(s.shape[0] for s in ps)
    return Composite(key, (rows, *ps[0].shape[1:]), ps[0].dtype,
                     fused_runs([(s.name, s.shape[0]) for s in ps], heads, kv))


def stacked_key(key: str, model: ModelSpec, job: str,
                to_job: Mapping[str, str] | None = None) -> Composite | None:
    """The :class:`Composite` of a key of stacked experts (the parameter
    ``<stacked>`` or its moment ``optimizer.state.<stacked>.<kind>``) over the
    job's tensor of each expert (``to_job``: torchtitan's names → the job's,
    when they differ), expert ``j`` at index ``j`` of dimension 0; None for
    any other key or a job without them."""
    m = moment_of(key)
    param = m[1] if m is not None else key
    if not is_stacked(param):
        return None

    def name(j: int) -> str:
        n = (to_job or {}).get(expert_name(param, j), expert_name(param, j))
        return f"optim/{m[0]}/{n}" if m is not None else n

    specs = _by_name(model)
    experts: list[TensorSpec] = []
    while (s := specs.get(name(len(experts)))) is not None:
        experts.append(s)
    if not experts or not experts[0].shape:
        return None
    if model.experts and len(experts) != model.experts:
        raise CheckpointError(f"job {job!r}: {param} has experts 0 to {len(experts) - 1} of "
                              f"its {model.experts}; torchtitan stacks them all in one tensor")
    if len({(s.shape, s.dtype) for s in experts}) != 1:
        raise CheckpointError(f"job {job!r}: the experts of {param} differ in shape or dtype; "
                              "torchtitan stacks them in one tensor")
    first = experts[0]
    return Composite(key, (len(experts), *first.shape), first.dtype,
                     tuple(Run(0, s.name, 0, s.shape[0], j) for j, s in enumerate(experts)))


def composite_of(key: str, model: ModelSpec, job: str) -> Composite | None:
    """The :class:`Composite` a torchtitan key is of the job's tensors (None:
    it is one job tensor, or none): a fused moment or a key of stacked
    experts; the one place the view and a save through the mount ask."""
    return fused_moment(key, model, job) or stacked_key(key, model, job)


def composite_keys(keys: Iterable[str], names: Iterable[str] = ()) -> list[str]:
    """The keys of a torchtitan save that are composites: the moments of its
    fused and stacked parameters, found from its Adam ``step`` keys (one per
    parameter, under the prefix the save used), and the stacked parameters,
    found from the job's tensor ``names`` (``<stacked>.<j>``)."""
    out = []
    for k in keys:
        for prefix in ("optimizer.state.", "state."):
            param = k[len(prefix):-len(".step")]
            if k.startswith(prefix) and k.endswith(".step") and (
                    parts_of(param) is not None or is_stacked(param)):
                out += [f"{prefix}{param}.{kind}" for kind in _KINDS]
    stacked = {e[0] for n in names if not n.startswith("optim/")
               and (e := expert_of(n)) is not None}
    return out + sorted(stacked)


def composite_chunks(state: JobState, comp: Composite, max_bytes: int | None = None
                     ) -> list[Chunk]:
    """The chunks of ``comp`` under the job's configuration: each chunk of a
    part (:func:`~ptcfs.dcp.layout.chunks`) cut at the runs' rows, at its
    rows in the composite tensor; each one bytes of one stored sub-tensor."""
    specs = {s.name: s for s in state.model_spec().tensors}
    of_part: dict[str, list[Chunk]] = {}
    out = []
    for run in comp.runs:
        if run.name not in of_part:
            of_part[run.name] = chunks(state, {(comp.key,): specs[run.name]}, max_bytes)
        for c in of_part[run.name]:
            a = max(c.offsets[0], run.lo)
            b = min(c.offsets[0] + c.sizes[0], run.lo + run.n)
            if a >= b:
                continue
            l0 = c.local[0][0] + a - c.offsets[0]
            lead = () if run.index is None else (run.index,)
            out.append(replace(c, offsets=(*lead, run.at + a - run.lo, *c.offsets[1:]),
                               sizes=(*(1,) * len(lead), b - a, *c.sizes[1:]),
                               local=((l0, l0 + b - a), *c.local[1:]), whole=comp.shape))
    return out


def split_chunks(comp: Composite, chunks_of: Iterable[tuple[Box, np.ndarray]]
                 ) -> dict[str, list[tuple[Box, np.ndarray]]]:
    """Saved chunks of ``comp`` (its boxes and values) as chunks of the job
    tensors it is made of (views, nothing copied)."""
    out: dict[str, list[tuple[Box, np.ndarray]]] = {r.name: [] for r in comp.runs}
    for box, arr in chunks_of:
        for run in comp.runs:
            part_box, part = box, arr
            if run.index is not None:  # that expert's slab, if the chunk meets it
                (e0, e1), part_box = box[0], box[1:]
                if not e0 <= run.index < e1:
                    continue
                part = arr[run.index - e0]
            (c0, c1), rest = part_box[0], part_box[1:]
            a, b = max(c0, run.at), min(c1, run.at + run.n)
            if a < b:
                lo = run.lo + a - run.at
                out[run.name].append((((lo, lo + b - a), *rest), part[a - c0:b - c0]))
    return out
