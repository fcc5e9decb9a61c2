"""torchtitan checkpoints, as its ``CheckpointManager`` saves them.

Layout: a DCP directory (``step-<N>/`` of torchtitan's checkpoint folder)
with the keys of :mod:`ptcfs.dcp.titan`: the model's at the top level, the
optimizer flattened per parameter name (``optimizer.state.<param>.exp_avg``,
``optimizer.param_groups.<param>.lr``), and the trainer's
``train_state.*``, ``lr_scheduler.*`` and ``dataloader.*``.

Import reads the tensors as the ``torch-dcp`` format does
(:func:`~ptcfs.client.formats.dcp.read_dcp`, chunk by chunk); the model is
one of :data:`MODELS` recognised from its names: torchtitan's llama3
(:func:`~ptcfs.model.recognize.llama_titan`), qwen3 (dense or with experts,
:func:`~ptcfs.client.formats.titan_models.qwen3_titan`) or deepseek_v3
(:func:`~ptcfs.client.formats.titan_models.deepseek_titan`), or
``--model-spec``. Experts stacked in one tensor (and their moments) become
one tensor per expert (:mod:`~ptcfs.client.formats.titan_experts`).
The fused query/key/value moments are split into the moments of ``wq``,
``wk`` and ``wv`` (their rows go per key/value group, so this needs the
heads: ``--heads`` for llama3; qwen3's shapes give them).
Every non-tensor entry and each parameter's Adam ``step`` are kept as the
bytes DCP stored (in the job's record, :class:`~ptcfs.dcp.layout.Saved`,
carried by later versions) and given back on export as they were; the
job's step is ``train_state.step``.

Export writes that layout from the job's current configuration with DCP's
own writer (:class:`~ptcfs.client.formats.dcp_layout.LayoutPlanner`: one
chunk per sub-tensor, read from the hosts when written), the fused moments
whole, built from their parts when written, the experts stacked again (each
expert's chunks at its offset); moments only of the parameters torchtitan
kept an Adam step of (a job keeps moments of its buffers too). A job of
Hugging Face LLaMA, Qwen3, Qwen3-MoE or DeepSeek-V3 names is renamed to
torchtitan's; a job that does not keep torchtitan's entries gets a
``train_state`` and ``lr_scheduler`` at its step, AdamW groups of its
recorded settings, and no ``dataloader`` (noted).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Entry, Source, dtype_of
from ptcfs.client.formats.dcp import read_dcp, read_metadata
from ptcfs.client.formats.dcp_layout import LayoutPlanner
from ptcfs.client.formats.titan_experts import split
from ptcfs.client.formats.titan_models import (
    NAMES,
    deepseek_titan,
    norm_heads,
    qwen3_titan,
    titan_only,
)
from ptcfs.client.torch.state import TORCH_DTYPES, progress_bar
from ptcfs.dcp.layout import ADAM_DEFAULTS, Saved, groups, saved
from ptcfs.dcp.titan import (
    Composite,
    Run,
    composite_chunks,
    expert_of,
    fused_moment,
    fused_of,
    fused_runs,
    is_titan,
    moment_of,
    parts_of,
    stacked_key,
)
from ptcfs.errors import CheckpointError
from ptcfs.fuse.dcpwrite import MAX_KEPT_BYTES
from ptcfs.jobstate import JobState
from ptcfs.model.hfmodels import with_dtypes
from ptcfs.model.recognize import hf_to_titan, llama_titan, titan_to_hf
from ptcfs.types import TensorSpec

__all__ = ["MODELS", "read", "write"]

#: the torchtitan models read with no spec file: each one's recogniser, in order
MODELS = (llama_titan, qwen3_titan, deepseek_titan)
#: each model's names both ways: (torchtitan → Hugging Face, Hugging Face → torchtitan)
_NAMES = ((titan_to_hf, hf_to_titan), *NAMES.values())
_KINDS = ("exp_avg", "exp_avg_sq")


def read(path: Path, options: ReadOptions) -> Source:
    """The ``torchtitan`` row of :data:`ptcfs.client.formats.FORMATS`."""
    md = read_metadata(path, "not a torchtitan checkpoint (give its step-<N> folder)")
    items = md.state_dict_metadata
    if not is_titan(list(items)):
        raise CheckpointError(f"{path}: not a torchtitan checkpoint (no train_state, "
                              "lr_scheduler or dataloader entries, no optimizer groups by "
                              "parameter name); a DCP directory of torch's recipe imports with "
                              "--format torch-dcp")
    src = read_dcp(path)
    steps = [k for k, m in items.items() if hasattr(m, "size") and k.endswith(".step")
             and k.startswith(("optimizer.state.", "state."))]
    _unprefixed(src)
    split(src, path, {(f"optim/{m[0]}/{m[1]}" if (m := moment_of(k)) else k): k for k in items})
    shapes = {n: e.shape for n, e in src.tensors.items() if not n.startswith("optim/")}
    _split_fused(src, options.heads or norm_heads(shapes), path)
    for name in [n for n in src.chunks if fused_of(n.rpartition("/")[2]) is not None]:
        src.chunks.pop(name)  # saved whole by torchtitan's hook: no mesh to see in them
    if any(n.startswith("optim/") for n in src.tensors):
        for name in [n for n in src.chunks if not n.startswith("optim/")
                     and f"optim/exp_avg/{n}" not in src.tensors]:
            src.chunks.pop(name)  # buffers (the MoE's load-balancing bias): FSDP keeps them whole
    raw = _raw(path, md, [k for k, m in items.items() if not hasattr(m, "size")] + steps)
    train = _train_step(raw)
    if train is not None:
        src.step = train
    src.kept = Saved({k: n for k in items if (n := _job_key(k, src)) is not None}, raw,
                     {k: ("fp32", ()) for k in steps}).encode()
    params = {n: e for n, e in src.tensors.items() if not n.startswith("optim/")}
    first = next(iter(params.values()), None)
    known = None
    if first is not None:
        dtype = dtype_of(first.dtype, first.where)
        known = next((k for recognise in MODELS
                      if (k := recognise(shapes, dtype, options.heads)) is not None), None)
    if known is not None:
        src.model = known[0]
        src.spec = with_dtypes(known[1], {n: dtype_of(e.dtype, e.where) for n, e in params.items()})
    elif options.model_spec is None and options.model is None:
        experts = ", stacked experts one per expert as <name>.<j>" if any(
            expert_of(n) for n in params) else ""
        raise CheckpointError(
            f"{path}: its tensors ({', '.join(sorted(params)[:3])}, ...) are not torchtitan's "
            "llama3, qwen3 or deepseek_v3 (without multi-token prediction); describe the "
            "model in a spec file (`ptcctl spec --model PRESET` writes one to start from; "
            f"tensor names as in the checkpoint{experts}) and import with --model-spec FILE")
    return src


def _unprefixed(src: Source) -> None:
    """Moments saved without the ``optimizer.`` prefix (``state.<param>.exp_avg``)
    read as the model's tensors: name them as the job does; steps go."""
    for name in list(src.tensors):
        if name.startswith("state."):
            e = src.tensors.pop(name)
            m = moment_of(name)
            if m is not None:
                src.tensors[f"optim/{m[0]}/{m[1]}"] = e
                if name in src.chunks:
                    src.chunks[f"optim/{m[0]}/{m[1]}"] = src.chunks.pop(name)
            src.chunks.pop(name, None)


def _split_fused(src: Source, heads: int | None, path: Path) -> None:
    """Each fused ``wqkv`` moment becomes the moments of its ``wq``, ``wk``, ``wv``."""
    for name in [n for n in src.tensors if n.startswith("optim/")]:
        _, kind, param = name.split("/", 2)
        parts = parts_of(param)
        if parts is None:
            continue
        if heads is None:
            raise CheckpointError(
                f"{path}: the optimizer keeps the fused query/key/value moments of {param}, "
                "whose rows go per key/value group: give --heads N (the model's attention "
                "heads) to split them")
        shapes = [src.tensors[p].shape if p in src.tensors else None for p in parts]
        if None in shapes:
            raise CheckpointError(f"{path}: {param} has moments but the model has no "
                                  f"{', '.join(p for p, s in zip(parts, shapes) if s is None)}")
        q, k, _ = (s[0] for s in shapes if s is not None)
        hd = q // heads if q % heads == 0 else 0
        if not hd or k % hd or src.tensors[name].shape[0] != q + 2 * k:
            raise CheckpointError(f"{path}: heads={heads} does not fit {param} (query rows "
                                  f"{q}, key/value rows {k} each)")
        runs = fused_runs(list(zip(parts, (q, k, k))), heads, k // hd)
        fused = src.tensors.pop(name)
        for i, (part, n) in enumerate(zip(parts, (q, k, k))):
            src.tensors[f"optim/{kind}/{part}"] = Entry(
                (n, *fused.shape[1:]), fused.dtype,
                _part(fused.get, [r for r in runs if r.name == part]),
                f"{fused.where} [part {i}]")
        src.chunks.pop(name, None)
        src.writers.pop(name, None)


def _part(get: Callable[[], torch.Tensor], runs: list[Run]) -> Callable[[], torch.Tensor]:
    def part() -> torch.Tensor:
        fused = get()
        return torch.cat([fused[r.at:r.at + r.n] for r in sorted(runs, key=lambda r: r.lo)])

    return part


def _job_key(key: str, src: Source) -> str | None:
    """The job tensor a torchtitan key holds one to one (None: none, or a fused moment)."""
    m = moment_of(key)
    name = f"optim/{m[0]}/{m[1]}" if m is not None else key
    return name if name in src.tensors else None


def _raw(path: Path, md: Any, keys: list[str]) -> dict[str, bytes]:
    """The bytes DCP stored for each of ``keys`` (each a ``torch.save`` archive)."""
    want, out = set(keys), {}
    for index, info in (md.storage_data or {}).items():
        if index.fqn not in want:
            continue
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path} [{index.fqn}]: stored through transforms "
                                  f"({', '.join(info.transform_descriptors)}) ptcfs cannot keep")
        try:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
        except OSError as e:
            raise CheckpointError(f"{path}/{info.relative_path}: {e.strerror}") from e
        if len(blob) != info.length:
            raise CheckpointError(f"{path}/{info.relative_path}: holds {len(blob)} of the "
                                  f"{info.length} bytes of {index.fqn}; the file is truncated")
        out[index.fqn] = blob
    if len(Saved(blobs=out).packed()) > MAX_KEPT_BYTES:
        raise CheckpointError(f"{path}: its trainer entries take more than "
                              f"{MAX_KEPT_BYTES >> 20} MiB compressed; ptcfs keeps at most that")
    return out


def _train_step(raw: dict[str, bytes]) -> int | None:
    blob = raw.get("train_state.step")
    if blob is None:
        return None
    try:
        value = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception:  # noqa: BLE001 - an entry we only keep; the step comes from Adam
        return None
    return int(value) if isinstance(value, int | torch.Tensor) else None


class _TitanPlanner(LayoutPlanner):
    """The job's chunks, plus the kept entries as the bytes stored, the
    fused moments whole and the stacked experts as their experts' chunks
    (:func:`~ptcfs.dcp.titan.composite_chunks`, as the mount's view serves them)."""

    def __init__(self, coord: Coordinator, state: JobState,
                 keys: dict[tuple[str, ...], TensorSpec], tick: Any, raw: dict[str, bytes],
                 fused: list[Composite], experts: list[Composite]) -> None:
        super().__init__(coord, state, keys, tick)
        self._raw, self._fused = raw, {f.key: f for f in fused}
        self._stacked = {e.key for e in experts}
        for e in experts:
            props = TensorProperties(dtype=TORCH_DTYPES[e.dtype])
            for c in composite_chunks(state, e):
                chunk = ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                self._items.append(WriteItem(
                    MetadataIndex(e.key, torch.Size(c.offsets)), WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk, props, torch.Size(e.shape))))
                self._chunks[(e.key, c.offsets)] = c
            head, _, rest = e.key.partition(".")  # a moment under "optimizer", as saved
            self._paths[e.key] = (head, rest) if head == "optimizer" else (e.key,)
        for fqn in raw:
            self._items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
        for f in fused:
            size = torch.Size(f.shape)
            chunk = ChunkStorageMetadata(torch.Size((0,) * len(size)), size)
            props = TensorProperties(dtype=TORCH_DTYPES[f.dtype])
            self._items.append(WriteItem(MetadataIndex(f.key, chunk.offsets),
                                         WriteItemType.SHARD,
                                         tensor_data=TensorWriteData(chunk, props, size)))
        self._paths.update({fqn: tuple(fqn.split(".", 1)) for fqn in [*raw, *self._fused]})

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        if fqn in self._raw:
            return io.BytesIO(self._raw[fqn])
        f = self._fused.get(fqn)
        if f is None:
            data = super().resolve_data(write_item)
            return data.unsqueeze(0) if fqn in self._stacked else data
        parts = {r.name: torch.from_numpy(self._coord.fetch_tensor(self._state, r.name))
                 for r in f.runs}
        return torch.cat([parts[r.name][r.lo:r.lo + r.n] for r in f.runs])


def _names(state: JobState) -> dict[str, str]:
    """Each job parameter's torchtitan name."""
    names = [s.name for s in state.model_spec().tensors if not s.is_optim]
    missing: list[str] = []
    for to_hf, to_titan in _NAMES:
        if names and all(to_hf(n) is not None or titan_only(n) for n in names):
            return {n: n for n in names}
        out = {n: to_titan(n) for n in names}
        missing = [n for n, t in out.items() if t is None]
        if names and not missing:
            return {n: t for n, t in out.items() if t is not None}
    raise CheckpointError(
        f"job {state.job!r}: its tensors ({', '.join(missing[:3] or names[:3])}, ...) are "
        "not a LLaMA, Qwen3, Qwen3-MoE or DeepSeek-V3 of torchtitan's or Hugging Face's names; "
        "export it with --format torch-dcp")


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    """The ``torchtitan`` row: the job's version in torchtitan's layout."""
    model = state.model_spec()
    specs = {s.name: s for s in model.tensors}
    names = _names(state)
    kept = saved(state)
    raw = dict(kept.blobs) if kept is not None else {}
    steps = set(kept.tensors) if kept is not None else set()
    fused_params = {fused_of(t) for t in names.values()} - {None}
    # the parameters torchtitan's optimizer keeps state of (those of a kept Adam step); the
    # job keeps moments of its buffers too (the MoE's load-balancing bias)
    stepped = {k.split("state.", 1)[1].removesuffix(".step") for k in steps} or None
    keys: dict[tuple[str, ...], TensorSpec] = {}
    fused: list[Composite] = []
    for job_name, titan in names.items():
        if expert_of(titan) is None:
            keys[(titan,)] = specs[job_name]
    by_titan = {t: n for n, t in names.items()}
    for fp in sorted(f for f in fused_params if f is not None):
        if len([t for t in parts_of(fp) or () if t in by_titan]) != 3:
            raise CheckpointError(f"job {state.job!r}: {fp} lacks some of its query, key and "
                                  "value parts")
        if stepped is not None and fp not in stepped:
            continue
        for kind in _KINDS:
            comp = fused_moment(f"optimizer.state.{fp}.{kind}", model, state.job, by_titan)
            if comp is not None:
                fused.append(comp)
    for job_name, titan in names.items():
        if fused_of(titan) is not None or expert_of(titan) is not None or (
                stepped is not None and titan not in stepped):
            continue
        for kind in _KINDS:
            s = specs.get(f"optim/{kind}/{job_name}")
            if s is not None:
                keys[("optimizer", f"state.{titan}.{kind}")] = s
    small = _small(state, names, fused_params, raw, steps, notes)
    step_tensors = {k: torch.load(io.BytesIO(raw.pop(k)), weights_only=True) for k in steps}
    for k, t in step_tensors.items():  # as saved: under "optimizer" or at the top level
        head, _, rest = k.partition(".")
        if head == "optimizer":
            small.setdefault("optimizer", {})[rest] = t
        else:
            small[k] = t
    experts = _stacked(state, names, stepped)
    total = sum(s.nbytes for s in keys.values()) + sum(
        specs[r.name].nbytes * r.n // specs[r.name].shape[0]
        for f in [*fused, *experts] for r in f.runs)
    path.mkdir(parents=True, exist_ok=True)
    with progress_bar(total, f"export {state.job}", progress) as tick:
        dcp.save(small, storage_writer=dcp.FileSystemWriter(str(path)),
                 planner=_TitanPlanner(coord, state, keys, tick, raw, fused, experts),
                 no_dist=True)


def _stacked(state: JobState, names: dict[str, str], stepped: set[str] | None
             ) -> list[Composite]:
    """The stacked keys of a job whose tensors have torchtitan names ``names``
    (job name → torchtitan's): each stacked parameter at the top level, its
    moments as ``optimizer.state.<param>.<kind>`` (of the parameters in
    ``stepped`` only, when given)."""
    model, by_titan = state.model_spec(), {t: n for n, t in names.items()}
    out = []
    for param in sorted({e[0] for t in names.values() if (e := expert_of(t)) is not None}):
        comp = stacked_key(param, model, state.job, by_titan)
        if comp is None:
            raise CheckpointError(f"job {state.job!r}: {param} has no expert 0; torchtitan "
                                  "stacks experts 0 to N-1 in one tensor")
        moments = [f"optimizer.state.{param}.{kind}" for kind in _KINDS
                   if stepped is None or param in stepped]
        out += [comp, *(c for k in moments
                        if (c := stacked_key(k, model, state.job, by_titan)) is not None)]
    return out


def _small(state: JobState, names: dict[str, str], fused: set[str | None],
           raw: dict[str, bytes], steps: set[str], notes: list[str] | None) -> dict[str, Any]:
    """The entries written as objects: for a job that keeps torchtitan's, only
    the train step when the job moved on from it; else all of them."""
    if raw:
        if _train_step(raw) not in (None, state.step):
            raw.pop("train_state.step")
            return {"train_state": {"step": state.step}}
        return {}
    if notes is not None:
        notes.append("no dataloader state (the job did not come from torchtitan): load with "
                     "checkpoint.exclude_from_loading = ['dataloader']")
    out: dict[str, Any] = {"train_state": {"step": state.step, "ntokens_seen": 0},
                           "lr_scheduler": {"last_epoch": state.step}}
    if state.optimizer not in ("adam", "adamw"):
        return out
    model = state.model_spec()
    settings = {n: {"initial_lr": g["lr"], **g}  # torchtitan's LR scheduler adds it
                for g in groups(ADAM_DEFAULTS[state.optimizer], model, list(names))
                for n in g["params"]}
    opt: dict[str, Any] = {}
    by_titan = {t: n for n, t in names.items()}
    for t, n in names.items():  # a stacked tensor's settings: its experts'
        if (e := expert_of(t)) is not None:
            by_titan.setdefault(e[0], n)
    params = [t for t in names.values() if fused_of(t) is None and expert_of(t) is None] + \
        sorted(f for f in fused if f is not None) + sorted(
        {e[0] for t in names.values() if (e := expert_of(t)) is not None})
    for titan in params:
        job = by_titan.get(titan) or by_titan[(parts_of(titan) or ("",))[0]]
        for k, v in settings[job].items():
            if k != "params":
                opt[f"param_groups.{titan}.{k}"] = v
        opt[f"state.{titan}.step"] = torch.tensor(float(state.step))
    out["optimizer"] = opt
    return out
