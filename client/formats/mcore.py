"""Megatron-Core ``torch_dist`` checkpoints (``--ckpt-format torch_dist``).

Layout (checked against megatron-core 0.16.1's ``dist_checkpointing.save``)::

    DIR/latest_checkpointed_iteration.txt   the iteration
    DIR/iter_0000100/.metadata              DCP metadata: every sharded key
    DIR/iter_0000100/__<rank>_<n>.distcp    the chunks
    DIR/iter_0000100/common.pt              what is not sharded: args, iteration, ...
    DIR/iter_0000100/metadata.json          {"sharded_backend": "torch_dist", ...}

The keys are Megatron-Core's sharded keys (:mod:`~ptcfs.client.formats.mcore_keys`):
layers stacked on a leading axis, experts on a second, the vocabulary
padded. The model preset (``llama``, ``moe`` or ``gpt`` with
``names=mcore``) comes from the tensors' shapes and ``args`` in
``common.pt`` (``num_attention_heads``, ``vocab_size``,
``moe_router_topk``, ``transformer_impl``); ``--heads`` or ``--model``
when ``args`` cannot be read. Each tensor is read on its own with DCP's
reader, only the chunks of its layer. Adam state is imported from the
``optimizer.state.*`` keys of the non-distributed optimizers and of the
distributed optimizer's model-space formats (``fully_sharded_model_space``,
``fully_reshardable``), and from its bucket-space format
(``dp_reshardable``, ``optimizer.distributed.*`` keys, Megatron-LM's
default: :mod:`~ptcfs.client.formats.mcore_distopt`).

``export`` writes the job's current version in the same layout with
``dcp.save`` from one process, one chunk per layer (and expert), each
tensor read from the cluster when DCP writes it: the model, the Adam state
as ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>`` (the
non-distributed optimizers' format; the masters' bytes are also named
``optimizer.state.param.<key>`` in the metadata, the distributed
optimizer's name for them), every layer's ``_extra_state`` objects
(empty), ``common.pt`` with ``args``, ``iteration``,
``checkpoint_version``, the optimizer's groups and step and the recorded
``opt_param_scheduler`` (:mod:`~ptcfs.client.formats.mcore_optim`),
``content_metadata`` that says the optimizer state is in model space
(``fully_reshardable``: Megatron-LM's ``--use-distributed-optimizer``
loads it on any mesh, and the non-distributed optimizers load it too),
``metadata.json`` and the tracker. The vocabulary is padded to ``128 ×
tp`` of the job's current configuration. It has no ``rng_state``, and
its ``args`` say so (``no_save_rng``): Megatron-LM then starts the random
generators from the job's seed instead of asking for ``--no-load-rng``.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Entry, Source, from_numpy, torch_load
from ptcfs.client.formats.dcp_box import Chunk, StackedTensor, read_box, read_metadata, save_chunks
from ptcfs.client.formats.mcore_distopt import has_bucket_space, read_dp_reshardable
from ptcfs.client.formats.mcore_keys import (
    EXPERT_KEY,
    LAYER_KEY,
    Place,
    candidates,
    extra_state_modules,
    place_of,
)
from ptcfs.client.formats.mcore_optim import (
    CONTENT,
    common_optimizer,
    read_groups,
    record_scheduler,
)
from ptcfs.client.torch.state import DTYPE_NAMES, TORCH_DTYPES, progress_bar
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.model.hfmodels import with_dtypes, with_param
from ptcfs.model.modelkit import VOCAB_PAD
from ptcfs.model.presets import parse_model
from ptcfs.sharding import padded_length
from ptcfs.types import ModelSpec, TensorSpec

__all__ = ["read_mcore", "write_mcore", "record_args", "recorded_args", "TRACKER", "BACKEND"]

TRACKER = "latest_checkpointed_iteration.txt"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
MASTER = "optimizer.state.fp32_param."
#: the spec ``params`` key of the run's recorded ``args`` (JSON)
ARGS = "mcore_args"
#: args that describe the saving run's mesh: an export writes its job's
_MESH_ARGS = frozenset({"world_size", "rank", "local_rank", "data_parallel_size",
                        "num_layers_per_virtual_pipeline_stage",
                        "num_virtual_stages_per_pipeline_rank",
                        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                        "pipeline_model_parallel_split_rank", "iteration"})
#: where a Megatron-LM run is in its data
_POSITION_ARGS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
_QKV = LAYER_KEY + "self_attention.linear_qkv.weight"


def iteration_dir(path: Path) -> Path:
    """The iteration directory of ``path`` (itself, or the tracker's)."""
    if (path / ".metadata").is_file():
        return path
    tracker = path / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{path}: neither a torch_dist iteration directory (.metadata) "
                              f"nor a checkpoint directory ({TRACKER})")
    text = tracker.read_text().strip()
    if not text.isdigit() and text != "release":
        raise CheckpointError(f"{tracker}: {text!r} is not an iteration number")
    it = path / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not (it / ".metadata").is_file():
        raise CheckpointError(f"{it}: no .metadata; not a torch_dist checkpoint")
    return it


def _common(it: Path, trust: bool, notes: list[str]) -> dict[str, Any]:
    meta = it / "metadata.json"
    if meta.is_file():
        backend = json.loads(meta.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{meta}: sharded_backend is {backend!r}; only torch_dist "
                                  "checkpoints are read")
    if not (it / "common.pt").is_file():
        return {}
    try:
        common = torch_load(it / "common.pt", trust)
    except CheckpointError as e:
        notes.append(f"common.pt not read ({e}); the model comes from the tensors")
        return {}
    return common if isinstance(common, dict) else {}


def _arg(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def _model_text(shapes: dict[str, tuple[int, ...]], args: Any, heads: int | None,
                where: str) -> str:
    """The preset of the checkpoint's tensors (module docstring)."""
    for key in ("embedding.word_embeddings.weight", _QKV):
        if key not in shapes:
            raise CheckpointError(f"{where}: no {key}; not a Megatron-Core GPTModel checkpoint")
    rows, hidden = shapes["embedding.word_embeddings.weight"]
    layers, qkv_rows, _ = shapes[_QKV]
    heads = heads or _arg(args, "num_attention_heads")
    if not heads:
        raise CheckpointError(f"{where}: the number of attention heads is not recorded (no "
                              "readable args in common.pt): give --heads N or --model")
    kv = (qkv_rows * heads // hidden - heads) // 2
    vocab = _arg(args, "vocab_size") or rows
    tied = int("output_layer.weight" not in shapes)
    moe = EXPERT_KEY + "linear_fc2.weight" in shapes
    fc2 = shapes[EXPERT_KEY + "linear_fc2.weight" if moe else LAYER_KEY + "mlp.linear_fc2.weight"]
    fc1 = shapes[EXPERT_KEY + "linear_fc1.weight" if moe else LAYER_KEY + "mlp.linear_fc1.weight"]
    ffn, swiglu = fc2[-1], int(fc1[-2] == 2 * fc2[-1])
    if moe:
        norms = "te" if LAYER_KEY + "pre_mlp_layernorm.weight" in shapes else "local"
    else:
        norms = "local" if _arg(args, "transformer_impl") == "local" else "te"
    common = f"layers={layers},hidden={hidden},heads={heads}"
    if "embedding.position_embeddings.weight" in shapes or LAYER_KEY + \
            "self_attention.linear_qkv.bias" in shapes:
        seq = shapes.get("embedding.position_embeddings.weight", (2048,))[0]
        return (f"gpt:{common},vocab={vocab},ffn={ffn},seq={seq},swiglu={swiglu},names=mcore,"
                f"norms={norms},tied={tied}")
    if not swiglu:
        raise CheckpointError(f"{where}: a model without SwiGLU, biases or position embeddings "
                              "is none of ptcfs's presets; give --model")
    text = f"{common},kv_heads={kv},vocab={vocab},ffn={ffn},tied={tied},norms={norms}"
    if not moe:
        return "llama:" + text
    topk = _arg(args, "moe_router_topk") or 2
    return f"moe:{text},experts={fc2[1]},topk={min(int(topk), fc2[1])}"


def _options(model: str) -> tuple[bool, str]:
    params = dict(parse_model(model).params)
    if params.get("names", "mcore") != "mcore":
        raise CheckpointError(f"{model}: the mcore format needs Megatron-Core names "
                              "(names=mcore)")
    return "experts" in params, str(params.get("norms", "te"))


def read_mcore(path: Path, heads: int | None = None, trust: bool = False,
               optimizer: bool = True, model: str | None = None) -> Source:
    """A :class:`Source` from a torch_dist checkpoint (module docstring)."""
    it = iteration_dir(path)
    notes: list[str] = []
    common = _common(it, trust, notes)
    try:
        md = read_metadata(it).state_dict_metadata
    except Exception as e:  # noqa: BLE001 - DCP raises its own types
        raise CheckpointError(f"{it}/.metadata: cannot be read: {e}") from e
    shapes = {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}
    text = model or _model_text(shapes, common.get("args"), heads, str(it))
    moe, norms = _options(text)
    emb = md.get("embedding.word_embeddings.weight")
    if emb is None:
        raise CheckpointError(f"{it}: no embedding.word_embeddings.weight")
    dtype = DTYPE_NAMES.get(emb.properties.dtype, "fp32")
    ms = parse_model(text, dtype=dtype, optimizer="adam" if optimizer else "none")
    tensors: dict[str, Entry] = {}
    for spec in ms.tensors:
        place = next((p for p in candidates(spec.name, moe, norms) if p.key in shapes), None)
        if place is None:
            if not spec.name.startswith("optim/"):
                looked = ", ".join(p.key for p in candidates(spec.name, moe, norms))
                raise CheckpointError(f"{it}: no key for {spec.name} of {text} (looked for "
                                      f"{looked})")
            continue
        meta = md[place.key]
        tensors[spec.name] = Entry(spec.shape, meta.properties.dtype,
                                   _getter(it, place, spec.shape, meta.properties.dtype),
                                   f"{it} [{place.key}{list(place.index) or ''}]")
    # parameters kept in another dtype than the embedding's (norms in fp32) keep it
    kept = {n: DTYPE_NAMES.get(e.dtype, dtype) for n, e in tensors.items()
            if not n.startswith("optim/")}
    other = {n: d for n, d in kept.items() if d != dtype}
    preset = ms
    if other:
        ms = with_dtypes(ms, other)
    args = common.get("args")
    tp = int(_arg(args, "tensor_model_parallel_size") or 1)
    pp = int(_arg(args, "pipeline_model_parallel_size") or 1)
    ep = int(_arg(args, "expert_model_parallel_size") or 1)
    if optimizer and has_bucket_space(md):
        vpp = int(_arg(args, "virtual_pipeline_model_parallel_size") or 1)
        tensors.update(read_dp_reshardable(it, md, ms, tp, pp, ep, vpp, tensors, notes))
    elif optimizer and not any(n.startswith("optim/exp_avg/") for n in tensors):
        notes.append("the checkpoint holds no Adam state (optimizer.state.exp_avg.*)")
    for n in (n for n, d in other.items() if d == "fp32"):
        tensors.pop(f"optim/master/{n}", None)  # an fp32 parameter is its own master
    groups = read_groups(it, common, md, ms, ep, notes) if optimizer else []
    native = f"tp={tp},pp={pp}"
    step = common.get("iteration", 0)
    src = Source(tensors, int(step) if isinstance(step, int) else 0, model=text, native=native,
                 groups=groups)
    recorded = record_scheduler(ms, common) if optimizer else ms
    recorded = record_args(recorded, args, src.step)
    src.spec = recorded if recorded is not preset else None
    src.notes.extend(notes)
    return src


def record_args(model: ModelSpec, args: Any, step: int) -> ModelSpec:
    """``model`` with the run's ``args`` of plain values recorded (JSON) but
    those of its mesh, at ``step`` (unchanged where it had none)."""
    if not isinstance(args, argparse.Namespace):
        return model
    kept = {}
    for k, v in vars(args).items():
        if k in _MESH_ARGS or k.endswith("parallel_size"):
            continue
        try:
            kept[k] = json.loads(json.dumps(v, allow_nan=False))
        except (TypeError, ValueError):
            continue
    return with_param(model, ARGS, json.dumps({"step": step, "args": kept}, sort_keys=True))


def recorded_args(model: ModelSpec, step: int, notes: list[str] | None
                   ) -> dict[str, Any]:
    """The run's recorded ``args`` (empty: none); its data position
    (``consumed_train_samples``...) only at the step it was saved at."""
    text = dict(model.params).get(ARGS)
    if text is None:
        if notes is not None:
            notes.append("the job came from no Megatron run: the export's args hold no "
                         "consumed_train_samples, so Megatron-LM reads its data from the first "
                         "sample (and compares tokenizer_type, max_position_embeddings when "
                         "given --vocab-file)")
        return {}
    got = json.loads(str(text))
    out = dict(got["args"])
    if got["step"] != step:
        dropped = [k for k in _POSITION_ARGS if out.pop(k, None) is not None]
        if dropped and notes is not None:
            notes.append(f"the job moved from step {got['step']} to {step} since its Megatron "
                         f"run saved; {', '.join(dropped)} are left out (Megatron-LM reads its "
                         "data from the first sample)")
    return out


def _getter(it: Path, place: Place, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    def get() -> torch.Tensor:
        k = len(place.index)
        try:
            t = read_box(it, place.key, place.index + (0,) * len(shape), (1,) * k + shape, dtype)
        except Exception as e:  # noqa: BLE001 - DCP wraps failures in its own types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{it}: cannot read {place.key}{list(place.index)}: "
                                  f"{first}") from e
        return t.reshape(shape)

    return get


def _stored_shape(spec: TensorSpec, tp: int) -> tuple[int, ...]:
    """A tensor as Megatron-Core stores it: the vocabulary rows padded."""
    if spec.rule.pad_multiple is None or spec.rule.split_dim is None:
        return spec.shape
    d = spec.rule.split_dim
    shape = list(spec.shape)
    shape[d] = padded_length(shape[d], spec.rule.pad_multiple, tp)
    return tuple(shape)


def _none_object() -> bytes:
    buf = io.BytesIO()
    torch.save([None], buf)
    return buf.getvalue()


def _args(state: JobState, params: dict[str, Any], notes: list[str] | None
          ) -> argparse.Namespace:
    """The export's ``args``: the run's recorded ones, with the model's
    structure and the job's mesh and step. Megatron-LM's ``load_checkpoint``
    asserts that ``add_position_embedding`` is the loading run's: True for
    learned positions, and with rope, where it means nothing, the flag's
    default (True) unless the saving run said ``--no-position-embedding``."""
    cfg = state.config
    heads, kv = params["heads"], params.get("kv_heads", params["heads"])
    gpt = state.model_spec().name == "gpt"
    run = recorded_args(state.model_spec(), state.step, notes)
    ours = dict(
        num_layers=params["layers"], hidden_size=params["hidden"], num_attention_heads=heads,
        num_query_groups=kv, group_query_attention=kv != heads, ffn_hidden_size=params["ffn"],
        vocab_size=params["vocab"], make_vocab_size_divisible_by=VOCAB_PAD,
        padded_vocab_size=padded_length(params["vocab"], VOCAB_PAD, cfg.tp),
        max_position_embeddings=params.get("seq"), seq_length=params.get("seq"),
        position_embedding_type="learned_absolute" if gpt else "rope",
        add_position_embedding=gpt or bool(run.get("add_position_embedding", True)),
        normalization="LayerNorm" if gpt else "RMSNorm",
        add_bias_linear=gpt, swiglu=bool(params.get("swiglu", 1)),
        untie_embeddings_and_output_weights=not params["tied"],
        num_experts=params.get("experts"), moe_router_topk=params.get("topk"),
        transformer_impl="local" if params.get("norms") == "local" else "transformer_engine",
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        expert_model_parallel_size=cfg.ep, context_parallel_size=cfg.cp,
        data_parallel_size=cfg.dp * cfg.fsdp,
        params_dtype=TORCH_DTYPES[state.dtype], bf16=state.dtype == "bf16",
        fp16=state.dtype == "fp16", ckpt_format="torch_dist", use_dist_ckpt=True,
        ckpt_fully_parallel_save=True, no_save_rng=True,
        no_save_optim=state.optimizer not in ("adam", "adamw"), iteration=state.step,
        world_size=cfg.world)
    # what the model does not say (a LLaMA's max_position_embeddings) stays the run's
    return argparse.Namespace(**{**run, **{k: v for k, v in ours.items()
                                           if v is not None or k not in run}})


def write_mcore(coord: Coordinator, state: JobState, path: Path,
                progress: bool | None = None, notes: list[str] | None = None) -> Path:
    """The job's current version as a torch_dist checkpoint (module
    docstring); ``notes`` gets what could not be kept as it was."""
    model = state.model_spec()
    params = dict(model.params)
    if params.get("names") != "mcore":
        raise CheckpointError(f"job {state.job!r} is {state.model}: the mcore format needs "
                              "Megatron-Core names (a preset with names=mcore)")
    moe, norms = bool(model.experts), str(params.get("norms", "te"))
    layers, tp = model.layers, state.config.tp
    specs = {s.name: s for s in model.tensors}
    grouped: dict[str, list[tuple[TensorSpec, Place, str]]] = {}
    for spec in model.tensors:
        if spec.name.startswith("optim/master/"):
            continue
        grouped.setdefault(place_of(spec.name, moe, norms).key, []).append(
            (spec, place_of(spec.name, moe, norms), spec.name))
        if spec.name.startswith("optim/exp_avg/"):  # every parameter's fp32 master
            base = spec.name.split("/", 2)[2]
            source = f"optim/master/{base}" if f"optim/master/{base}" in specs else base
            place = place_of(f"optim/master/{base}", moe, norms)
            grouped.setdefault(place.key, []).append((specs[source], place, source))
    total = sum(s.nbytes for members in grouped.values() for s, _, _ in members)
    it = path / f"iter_{state.step:07d}"
    with progress_bar(total, f"export {state.job}", progress) as tick:
        items: dict[str, Any] = {}
        for key, members in grouped.items():
            spec0, place0, _ = members[0]
            fp32 = key.startswith("optimizer.state.")
            dtype = torch.float32 if fp32 else TORCH_DTYPES[spec0.dtype]
            lead = (layers, model.experts)[:len(place0.index)]
            stored = _stored_shape(spec0, tp)
            chunks = tuple(Chunk(p.index + (0,) * len(stored), (1,) * len(p.index) + stored,
                                 _fetch(coord, state, s, source, (1,) * len(p.index) + stored,
                                        dtype, tick))
                           for s, p, source in members)
            items[key] = StackedTensor(lead + stored, dtype, chunks)
        for mod, per_expert in extra_state_modules(moe, norms):
            for i in range(layers):
                for j in range(model.experts) if per_expert else (None,):
                    at, of = (f"{i}", f"{layers}") if j is None else (
                        f"{i}.{j}", f"{layers}.{model.experts}")
                    items[f"{LAYER_KEY}{mod}._extra_state/shard_{at}_{of}"] = _none_object
        # the fp32 masters under the DistributedOptimizer's name too (its
        # model-space format), the same bytes
        save_chunks(it, items, {"optimizer.state.param." + k[len(MASTER):]: k
                                for k in items if k.startswith(MASTER)})
    common: dict[str, Any] = {"args": _args(state, params, notes), "checkpoint_version": 3.0,
                              "iteration": state.step, "content_metadata": CONTENT}
    if state.optimizer in ("adam", "adamw"):
        common.update(common_optimizer(model, state.step, state.config.ep, notes))
    torch.save(common, it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(BACKEND))
    (path / TRACKER).write_text(f"{state.step}\n")
    return path


def _fetch(coord: Coordinator, state: JobState, spec: TensorSpec, name: str,
           sizes: tuple[int, ...], dtype: torch.dtype, tick: Any) -> Any:
    """The chunk of ``name``: its logical tensor, padded, in a chunk's shape."""
    def get() -> torch.Tensor:
        t = from_numpy(coord.fetch_tensor(state, name), spec.dtype).to(dtype)
        tick(spec.nbytes)
        out = torch.zeros(sizes, dtype=dtype)
        view = out.view(sizes[len(sizes) - t.dim():])
        view[tuple(slice(0, n) for n in t.shape)] = t
        return out

    return get


def read(path: Path, options: ReadOptions) -> Source:
    """The ``mcore`` row of :data:`ptcfs.client.formats.FORMATS`."""
    return read_mcore(path, options.heads, options.trust, optimizer=options.optimizer,
                      model=options.model)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    write_mcore(coord, state, path, progress, notes=notes)
