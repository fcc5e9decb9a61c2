"""Megatron-LM checkpoints (the legacy GPT model, ``checkpoint_version`` 3).

Layout::

    DIR/latest_checkpointed_iteration.txt      the iteration, or "release"
    DIR/iter_0000100/mp_rank_00/model_optim_rng.pt        pp = 1
    DIR/iter_0000100/mp_rank_01_002/model_optim_rng.pt    tp rank 1, pp stage 2

Each file holds ``{"args", "checkpoint_version", "iteration", "model", ...}``
with ``model = {"language_model": {"embedding": {"word_embeddings":
{"weight"}, "position_embeddings": {"weight"}}, "encoder": {"layers.<i>.…",
"final_layernorm.…"}}, "word_embeddings_for_head": {"weight"}}`` (the head
on the last stage when pp > 1; ``transformer`` is accepted for
``encoder``). Layer numbers are local to the stage: a stage's layers are
counted from 0, and its first layer's global index is the number of layers
of the stages before it. An interleaved pipeline (``--num-layers-per-
virtual-pipeline-stage``) has ``model0``, ``model1``, ... instead of
``model``: the stage's chunks in order, chunk ``v`` of stage ``p`` being
the pipeline's chunk ``v * pp + p``, its layers counted from 0 and following
those of the chunks before it; the import's mesh is then ``pp=P,vpp=V``
(with ``pp_layers`` where the chunks are uneven). Tensor-parallel shards are the job's sub-tensors
as they are (the vocabulary padded to ``128 × tp`` rows; ``query_key_value``
rows head by head), so they are put together with the job's own rules.

The model preset comes from ``args`` (``num_layers``, ``hidden_size``,
``num_attention_heads``, ``ffn_hidden_size``, ``max_position_embeddings``,
``vocab_size`` when set, else the padded vocabulary).

Optimizer state is the file's ``optimizer`` entry as Megatron-LM's
(non-distributed) optimizers save it: ``FP32Optimizer`` saves the Adam
state dict itself (``{"state", "param_groups"}``), the mixed-precision
``Float16OptimizerWithFloat16Params`` saves ``{"optimizer": <Adam state
dict>, "grad_scaler", "fp32_from_fp16_params": [[fp32 master per
parameter] per group]}``. Adam numbers the rank's parameters group by
group; Megatron builds its groups from ``named_parameters()``, which is the
order of the file's model dict: the weight-decay group holds the 2-D
tensors, the no-weight-decay group the 1-D ones (biases, layer norms),
empty groups left out; one group of all tensors is read too. Each state's
shape is checked against its parameter's, so a different grouping is
refused, not misread. ``exp_avg``/``exp_avg_sq`` become the job's Adam
moments and the fp32 masters its ``optim/master/*``. The distributed
optimizer keeps its state in ``distrib_optim.pt`` as flattened buffers,
read by :mod:`~ptcfs.client.formats.megatron_distopt` when the file is there.

``export`` writes the model of every (tp, pp) rank of the job's current
configuration in this layout, with ``iteration`` = step, and, for a job
with Adam state, the optimizer entry in the same layout (fp32 parameters:
the Adam state dict; fp16/bf16: with the fp32 masters); a job with
``zero=1`` (the distributed optimizer's sharding) gets ``distrib_optim.pt``
instead, and the optimizer entry keeps only the parameter groups, as
Megatron-Core's ``DistributedOptimizer.state_dict`` does. With virtual
stages the optimizer's groups take the chunks' parameters in chunk order,
and ``distrib_optim.pt`` has each chunk's buffers after the last chunk's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import (
    Entry,
    Source,
    dtype_of,
    from_numpy,
    plain_settings,
    read_mp_sub,
    torch_load,
    tp_merged,
)
from ptcfs.client.formats.megatron_distopt import (
    DISTRIB_OPTIM,
    distributed_entry,
    read_distrib_optim,
    write_distrib_optim,
)
from ptcfs.client.torch.state import progress_bar
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.optgroups import settings_for
from ptcfs.model.presets import parse_model
from ptcfs.sharding import chunk_of, rank_of, rank_tensors, stage_chunks, stage_layers
from ptcfs.types import Host, ModelSpec, ParallelConfig, TensorSpec

__all__ = ["read_megatron", "write_megatron", "TRACKER", "FILE_NAME", "rank_dir"]

TRACKER = "latest_checkpointed_iteration.txt"
FILE_NAME = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_CHUNK = re.compile(r"^model(0|[1-9]\d*)$")


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _iteration_dir(path: Path) -> Path:
    if _RANK_DIR.match(next((p.name for p in path.glob("mp_rank_*")), "")):
        return path  # DIR is an iteration directory itself
    tracker = path / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{path}: no {TRACKER}; not a Megatron-LM checkpoint directory")
    text = tracker.read_text().strip()
    if text == "release":
        return path / "release"
    try:
        return path / f"iter_{int(text):07d}"
    except ValueError:
        raise CheckpointError(f"{tracker}: {text!r} is not an iteration number") from None


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _model_chunks(obj: Any, where: str) -> list[dict[str, Any]]:
    """A rank file's model state dicts: ``model``, or one per virtual stage
    (``model0``, ``model1``, ...) in an interleaved pipeline."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: not a Megatron-LM checkpoint file")
    if isinstance(obj.get("model"), dict):
        return [obj["model"]]
    numbers = sorted(int(k[5:]) for k in obj if isinstance(k, str) and _CHUNK.match(k))
    if not numbers or numbers != list(range(len(numbers))) or \
            not all(isinstance(obj[f"model{i}"], dict) for i in numbers):
        raise CheckpointError(f"{where}: no 'model' state dict (nor model0, model1, ... of an "
                              "interleaved pipeline); not a Megatron-LM checkpoint file")
    return [obj[f"model{i}"] for i in numbers]


def _layer_numbers(flat: dict[str, Any]) -> set[int]:
    """The (local) layer numbers of one model chunk's flattened state."""
    return {int(m.group(1)) for k in flat if k.startswith("language_model.")
            and (m := _LAYER.match(k.split(".", 2)[-1]))}


def _global_names(flat: dict[str, Any], offset: int, where: str) -> dict[str, torch.Tensor]:
    """Megatron's names in one rank file → the job's, with global layers."""
    out: dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        if not isinstance(t, torch.Tensor):
            continue
        if key.startswith("language_model.embedding."):
            name = key[len("language_model."):]
        elif key.startswith(("language_model.encoder.", "language_model.transformer.")):
            rest = key.split(".", 2)[2]
            m = _LAYER.match(rest)
            name = (f"encoder.layers.{offset + int(m.group(1))}.{m.group(2)}" if m
                    else f"encoder.{rest}")
        elif key == "word_embeddings_for_head.weight":
            name = key
        else:
            raise CheckpointError(f"{where}: model tensor {key} is not one of the Megatron "
                                  "GPT layout ptcfs knows (embedding, encoder, "
                                  "word_embeddings_for_head)")
        out[name] = t
    return out


def read_megatron(path: Path, heads: int | None = None, trust: bool = False,
                  optimizer: bool = True) -> Source:
    """A :class:`Source` from a Megatron-LM checkpoint directory (without its
    optimizer state when ``optimizer`` is false)."""
    it = _iteration_dir(path)
    found: dict[tuple[int, int], Path] = {}
    for d in sorted(it.glob("mp_rank_*")):
        m = _RANK_DIR.match(d.name)
        if m:
            found[(int(m.group(1)), int(m.group(2) or 0))] = d / FILE_NAME
    if not found:
        raise CheckpointError(f"{it}: no mp_rank_* directories")
    files = {k: torch_load(f, trust) for k, f in found.items()}
    first = files.get((0, 0))
    if not isinstance(first, dict):
        raise CheckpointError(f"{it}/{rank_dir(0, 0, 1)}: missing, or not a Megatron-LM "
                              "checkpoint file")
    args = first.get("args")
    tp = max(1 + max(t for t, _ in found), int(_arg(args, "tensor_model_parallel_size") or 1))
    pp = max(1 + max(p for _, p in found), int(_arg(args, "pipeline_model_parallel_size") or 1))
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in found:
                raise CheckpointError(f"{it}: {rank_dir(t, p, pp)} is missing "
                                      f"(the others say tp={tp}, pp={pp})")
    step = int(first.get("iteration", 0))
    flat = {k: [_flatten(m) for m in _model_chunks(obj, str(found[k]))]
            for k, obj in files.items()}
    vpp = len(flat[(0, 0)])
    for k, c in flat.items():
        if len(c) != vpp:
            raise CheckpointError(f"{found[k]}: {len(c)} model chunks; {found[(0, 0)]} has {vpp}")
    # chunk v of stage p is the pipeline's chunk v * pp + p: its layers (counted in
    # tp rank 0's files) follow those of the chunks before it
    counts = [len(_layer_numbers(flat[(0, c % pp)][c // pp])) for c in range(pp * vpp)]
    starts = [sum(counts[:c]) for c in range(pp * vpp)]
    shards: dict[str, dict[int, torch.Tensor]] = {}
    optim_notes: set[str] = set()
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for (t, p), per_chunk in sorted(flat.items()):
        where = str(found[(t, p)])
        by_chunk = [_global_names(f, starts[v * pp + p], where) for v, f in enumerate(per_chunk)]
        named = {n: x for c in by_chunk for n, x in c.items()}
        if optimizer:
            named.update(_optimizer(files[(t, p)], by_chunk, found[(t, p)], optim_notes, trust,
                                    groups if t == 0 else None))
        for name, tensor in named.items():
            shards.setdefault(name, {})[t] = tensor
    offset = sum(counts)
    even = counts == [len(r) for r in stage_layers(offset, pp * vpp)]
    native = ParallelConfig(tp, pp, 1, (Host("any", tp * pp),), vpp=vpp,
                            pp_layers=() if even else tuple(counts)).degrees_text()
    model = _model_text(args, shards, tp, offset, heads, str(found[(0, 0)]))
    dtype = shards["embedding.word_embeddings.weight"][0].dtype
    ms = parse_model(model, dtype=dtype_of(dtype, str(found[(0, 0)])))
    spec_of = {s.name: s for s in ms.tensors + ms.pp_only}
    tensors: dict[str, Entry] = {}
    for name, parts in shards.items():
        base = name.split("/", 2)[2] if name.startswith("optim/") else name
        spec = spec_of.get(base)
        where = f"{it} [{name}]"
        if spec is None:
            raise CheckpointError(f"{where}: tensor {base} is not part of {model}")
        spec = TensorSpec(name, spec.shape, spec.dtype, spec.rule, spec.same_as)
        tensors[name] = Entry(spec.shape, parts[0].dtype,
                              tp_merged(spec, {t: _held(x) for t, x in parts.items()}, tp, where),
                              where)
    src = Source(tensors, step, model=model, native=native, groups=groups)
    src.notes.extend(sorted(optim_notes))
    return src


def _weight_decay_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Megatron-LM's optimizer groups of a rank's parameters, in module order:
    the 2-D tensors (weight decay), then the 1-D ones; empty groups left out."""
    names = [n for n in tensors if not n.startswith("optim/")]
    wd = [n for n in names if tensors[n].dim() >= 2]
    no_wd = [n for n in names if tensors[n].dim() < 2]
    return [g for g in (wd, no_wd) if g]


def _optimizer(obj: dict[str, Any], by_chunk: list[dict[str, torch.Tensor]], path: Path,
               notes: set[str], trust: bool = False,
               recorded: list[tuple[dict[str, Any], list[str]]] | None = None
               ) -> dict[str, torch.Tensor]:
    """One rank file's Adam state by the job's names (see the module
    docstring); ``by_chunk``: its model tensors, per model chunk. ``recorded``
    gets the settings of each optimizer group and its tensors, added to
    those of the group of the same number from the ranks before."""
    where = str(path)
    named = {n: x for c in by_chunk for n, x in c.items()}
    opt = obj.get("optimizer")
    if opt is None:
        notes.add("the checkpoint holds no optimizer state (saved with --no-save-optim?)")
        return {}
    masters = None
    if isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict):  # mixed precision
        masters = opt.get("fp32_from_fp16_params")
        opt = opt["optimizer"]
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list):
        raise CheckpointError(f"{where}: 'optimizer' is not a Megatron-LM optimizer state "
                              "(no param_groups); import with --optimizer none to skip it")
    _record_groups(opt["param_groups"], _weight_decay_groups(named), recorded)
    if (path.parent / DISTRIB_OPTIM).exists():
        return read_distrib_optim(path.parent / DISTRIB_OPTIM, by_chunk, obj.get("args"), trust)
    if "state" not in opt:
        notes.add(f"the optimizer entry holds no state and there is no {DISTRIB_OPTIM}: Adam "
                  "moments start at zero")
        return {}
    groups = [list(g.get("params", [])) for g in opt["param_groups"] if isinstance(g, dict)]
    names = list(named)
    split = _weight_decay_groups(named)
    sizes = [len(g) for g in groups]
    if sizes == [len(g) for g in split]:
        order = split
    elif sizes == [len(names)]:
        order = [names]
    else:
        raise CheckpointError(
            f"{where}: the optimizer's parameter groups hold {sizes} parameters; Megatron-LM's "
            f"weight-decay split of this rank's tensors gives {[len(g) for g in split]}. "
            "Import with --optimizer none to skip the optimizer state")
    if masters is not None and [len(g) for g in masters] != sizes:
        raise CheckpointError(f"{where}: fp32_from_fp16_params holds {[len(g) for g in masters]}"
                              f" tensors per group, the optimizer {sizes}")
    state = opt["state"]
    out: dict[str, torch.Tensor] = {}
    for g, (ids, group_names) in enumerate(zip(groups, order)):
        for j, (index, name) in enumerate(zip(ids, group_names)):
            shape = tuple(named[name].shape)
            found = {"master": masters[g][j]} if masters is not None else {}
            st = state.get(index)
            if isinstance(st, dict):
                found.update((k, st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st)
            for kind, value in found.items():
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    raise CheckpointError(
                        f"{where}: {kind} of optimizer parameter {index} has shape {got}; read "
                        f"as {name} it should be {shape} (are the parameter groups in "
                        "Megatron-LM's order?)")
                out[f"optim/{kind}/{name}"] = value
    return out


def _held(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _record_groups(param_groups: list[Any], split: list[list[str]],
                   groups: list[tuple[dict[str, Any], list[str]]] | None) -> None:
    """Add one rank's groups (Megatron's weight-decay split ``split``, when
    its groups are those) to ``groups``, group by group."""
    if groups is None or len(param_groups) != len(split) or \
            not all(isinstance(g, dict) for g in param_groups):
        return
    for g, (group, names) in enumerate(zip(param_groups, split, strict=True)):
        if g == len(groups):
            groups.append((plain_settings(group), []))
        groups[g][1].extend(names)


def _arg(args: Any, name: str) -> Any:
    return getattr(args, name, None) if isinstance(args, argparse.Namespace) else (
        args.get(name) if isinstance(args, dict) else None)


def _model_text(args: Any, shards: dict[str, dict[int, torch.Tensor]], tp: int, layers: int,
                heads: int | None, where: str) -> str:
    def shard(name: str) -> torch.Tensor:
        if name not in shards:
            raise CheckpointError(f"{where}: no {name}; not a Megatron-LM GPT checkpoint")
        return shards[name][0]

    padded, hidden = shard("embedding.word_embeddings.weight").shape
    seq = shard("embedding.position_embeddings.weight").shape[0]
    ffn = shard("encoder.layers.0.mlp.dense_4h_to_h.weight").shape[1] * tp
    up = shard("encoder.layers.0.mlp.dense_h_to_4h.weight").shape[0] * tp
    heads = heads or _arg(args, "num_attention_heads")
    if not heads:
        raise CheckpointError(f"{where}: args do not give num_attention_heads: give --heads N")
    vocab = _arg(args, "vocab_size") or _arg(args, "padded_vocab_size") or padded * tp
    swiglu = int(up == 2 * ffn)
    return (f"gpt:layers={layers},hidden={hidden},heads={heads},vocab={vocab},ffn={ffn},"
            f"seq={seq},swiglu={swiglu}")


def write_megatron(coord: Coordinator, state: JobState, path: Path,
                   progress: bool | None = None, notes: list[str] | None = None) -> Path:
    """Every (tp, pp) rank's model of the current configuration, as Megatron-LM
    writes it (see the module docstring); ``notes`` gets what could not be
    kept as it was."""
    model = state.model_spec()
    cfg = state.config
    params = dict(model.params)
    if model.name != "gpt" or params.get("names", "megatron") != "megatron":
        raise CheckpointError(f"job {state.job!r} is {state.model}: the megatron format holds "
                              "the legacy GPT's names only (export Megatron-Core names with "
                              "--format mcore)")
    chunks = stage_chunks(model.layers, cfg.pp, cfg.pp_layers, cfg.vpp)
    args = argparse.Namespace(
        num_layers=model.layers, hidden_size=params["hidden"],
        num_attention_heads=params["heads"], ffn_hidden_size=params["ffn"],
        max_position_embeddings=params["seq"], seq_length=params["seq"],
        vocab_size=params["vocab"], make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        swiglu=bool(params["swiglu"]), iteration=state.step, params_dtype=state.dtype,
        use_distributed_optimizer=cfg.zero == 1, data_parallel_size=cfg.dp * cfg.fsdp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None)
    it = path / f"iter_{state.step:07d}"
    # each rank's tensors in model order, parameters first: Megatron's module order;
    # a (tp, pp) rank's whole share, whatever the data-parallel sharding
    mp = dataclasses.replace(cfg, dp=1, fsdp=1, cp=1, ep=1, zero=0)
    ranks = {(t, p): rank_tensors(model, mp, rank_of(mp, t, 0, p))
             for p in range(cfg.pp) for t in range(cfg.tp)}
    total = sum(math.prod(sl.local_shape(s.shape)) * s.itemsize
                for items in ranks.values() for s, sl in items)
    with progress_bar(total, f"export {state.job}", progress) as tick:
        for (t, p), items in ranks.items():
            # one model state dict per chunk of the stage (``model``, or ``model<v>``)
            lms: list[dict[str, Any]] = [{"embedding": {}, "encoder": {}} for _ in chunks[p]]
            outs: list[dict[str, Any]] = [{"language_model": lm} for lm in lms]
            values: dict[str, torch.Tensor] = {}
            by_chunk: list[dict[str, torch.Tensor]] = [{} for _ in chunks[p]]
            for spec, sl in items:
                value = from_numpy(read_mp_sub(coord, state, spec, sl), spec.dtype)
                tick(value.numel() * value.element_size())
                values[spec.name] = value
                v = chunk_of(spec.rule.stage, chunks[p])
                by_chunk[v][spec.name] = value
                if not spec.is_optim:
                    _place(outs[v], lms[v], spec.name, value, chunks[p][v].start)
            d = it / rank_dir(t, p, cfg.pp)
            d.mkdir(parents=True, exist_ok=True)
            saved = {"args": args, "checkpoint_version": 3.0, "iteration": state.step,
                     **({"model": outs[0]} if cfg.vpp == 1 else
                        {f"model{v}": out for v, out in enumerate(outs)})}
            if state.optimizer == "adam":
                entry = _optimizer_entry(values, state, model, notes)
                saved["optimizer"] = distributed_entry(entry) if cfg.zero else entry
                if cfg.zero:
                    write_distrib_optim(d / DISTRIB_OPTIM, by_chunk, cfg.pp)
            torch.save(saved, d / FILE_NAME)
    (path / TRACKER).write_text(f"{state.step}\n")
    return path


def _optimizer_entry(values: dict[str, torch.Tensor], state: JobState, model: ModelSpec,
                     notes: list[str] | None) -> dict[str, Any]:
    """A rank's Adam state as Megatron-LM's optimizers save it (module
    docstring), each group with the settings the job recorded
    (:mod:`ptcfs.model.optgroups`), else Adam's defaults and Megatron's multipliers."""
    groups = _weight_decay_groups(values)
    default = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]).state_dict()
    settings, said = settings_for(model, groups)
    if notes is not None:
        notes.extend(n for n in said if n not in notes)
    adam: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    step = torch.tensor(float(state.step))
    for group, mine in zip(groups, settings, strict=True):
        no_wd = values[group[0]].dim() < 2
        params = {**default["param_groups"][0], "wd_mult": 0.0 if no_wd else 1.0,
                  "lr_mult": 1.0, **({"weight_decay": 0.0} if no_wd else {}), **(mine or {}),
                  "params": list(range(index, index + len(group)))}
        adam["param_groups"].append(params)
        for n in group:
            adam["state"][index] = {"step": step.clone(), "exp_avg": values[f"optim/exp_avg/{n}"],
                                    "exp_avg_sq": values[f"optim/exp_avg_sq/{n}"]}
            index += 1
    if state.dtype == "fp32":
        return adam  # FP32Optimizer
    return {"optimizer": adam,
            "fp32_from_fp16_params": [[values[f"optim/master/{n}"] for n in group]
                                      for group in groups]}


def _place(out: dict[str, Any], lm: dict[str, Any], name: str, value: torch.Tensor,
           start: int) -> None:
    if name.startswith("embedding."):
        _, table, leaf = name.split(".")
        lm["embedding"].setdefault(table, {})[leaf] = value
    elif name.startswith("encoder.layers."):
        _, _, i, rest = name.split(".", 3)
        lm["encoder"][f"layers.{int(i) - start}.{rest}"] = value
    elif name.startswith("encoder."):
        lm["encoder"][name[len("encoder."):]] = value
    else:  # word_embeddings_for_head.weight
        out.setdefault("word_embeddings_for_head", {})["weight"] = value


def read(path: Path, options: ReadOptions) -> Source:
    """The ``megatron`` row of :data:`ptcfs.client.formats.FORMATS`."""
    return read_megatron(path, options.heads, options.trust, optimizer=options.optimizer)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    write_megatron(coord, state, path, progress, notes=notes)
