"""Hugging Face model directories, as ``save_pretrained`` writes them.

Read (``ptcctl import JOB DIR --format hf``): ``DIR/config.json`` gives the
model: any causal LM of the installed transformers that has a tensor-parallel
plan, through transformers itself (:mod:`~ptcfs.client.formats.hf_spec`), and
GPT-2 (:func:`ptcfs.model.hfmodels.gpt2`); ``DIR/model.safetensors`` or the shards of
``model.safetensors.index.json`` its tensors, read one at a time from their
byte ranges, each in its own dtype. ``--model-spec FILE`` takes the place of
the config for any other layout; its tensor names are the files' and its
dtypes are taken from the files. A directory the HF ``Trainer`` wrote adds
optimizer state (:mod:`~ptcfs.client.formats.hf_optim`) and
``trainer_state.json``'s ``global_step``. GPT-2 checkpoints saved from
``GPT2Model`` (no ``transformer.`` prefix, the attention mask buffers
``attn.bias``/``attn.masked_bias`` of old versions) are read as HF reads them.

Write (``ptcctl export JOB DIR --format hf``): the job's parameters as whole
tensors in safetensors shards of at most 5 GB (``save_pretrained``'s
default, with its index when there is more than one), the ``config.json``
and ``generation_config.json`` recorded at import (a ``llama``/``moe``
preset job with ``names=hf`` gets a config.json written from its sizes),
``trainer_state.json`` (the imported one, or a new one) with the job's step,
an imported ``scheduler.pt`` at that step (for a job with optimizer state
that has none, one at the job's step and rates), and the optimizer state
and fp32 masters as :mod:`~ptcfs.client.formats.hf_optim` says: a
``Trainer`` checkpoint, reconfigured, resumes in ``Trainer`` with its
optimizer and schedule, and so does a job from any other format. The RNG
states (``rng_state*.pth``) are per process and not kept.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import ReadOptions
from ptcfs.client.formats.common import Source, torch_load
from ptcfs.client.formats.hf_optim import (
    entry,
    read_masters,
    read_optimizer,
    scheduler_state,
    write_optimizer,
)
from ptcfs.client.formats.hf_spec import spec_from_hf
from ptcfs.client.formats.safetensors_io import (
    DEFAULT_SHARD_BYTES,
    SafeTensor,
    read_dir,
    write_dir,
)
from ptcfs.client.torch.state import progress_bar
from ptcfs.errors import CheckpointError, InvalidConfig
from ptcfs.jobstate import JobState
from ptcfs.model.hfmodels import (
    ARCHITECTURES,
    BINARY_FILES,
    CONFIG_FILES,
    architecture,
    config_for_preset,
    dumps,
    hf_files,
    spec_from_config,
    with_dtypes,
    with_hf_files,
)
from ptcfs.model.specfile import load_spec_file
from ptcfs.types import ModelSpec

__all__ = ["read_hf", "write_hf", "TRAINER_STATE", "TRAINER_NOTE"]

TRAINER_STATE = "trainer_state.json"
#: what an export says when it writes a new ``trainer_state.json``
TRAINER_NOTE = (f"{TRAINER_STATE} is new: the job records no Trainer arguments, and a resumed "
                "Trainer takes them from this file; set train_batch_size (your per-device "
                "batch size) in it and, where yours differ from the Trainer's defaults (500), "
                "logging_steps, eval_steps and save_steps")
_GPT2_BUFFER = re.compile(r"(?:^|\.)h\.\d+\.attn\.(?:masked_)?bias$")
_CONV1D = re.compile(r"\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON: {e}") from e


def _gpt2_names(found: dict[str, SafeTensor], model: ModelSpec,
                notes: list[str]) -> dict[str, SafeTensor]:
    """GPT-2 tensors as ``GPT2LMHeadModel`` names them: ``transformer.`` added
    where a ``GPT2Model`` saved them, mask buffers left out."""
    names = {t.name for t in model.tensors}
    out = {}
    dropped = 0
    for name, t in found.items():
        if _GPT2_BUFFER.search(name):
            dropped += 1
            continue
        if name not in names and f"transformer.{name}" in names:
            name = f"transformer.{name}"
        out[name] = replace(t, name=name)
    if dropped:
        notes.append(f"left out {dropped} attention mask buffers (attn.bias, attn.masked_bias): "
                     "GPT-2 recomputes them")
    return out


def _check_conv1d(found: dict[str, SafeTensor], model: ModelSpec) -> None:
    for spec in model.tensors:
        t = found.get(spec.name)
        if t is None or not _CONV1D.search(spec.name) or t.shape == spec.shape:
            continue
        if t.shape == spec.shape[::-1]:
            raise CheckpointError(
                f"{t.path}: {spec.name} is {list(t.shape)}, a Linear's [out, in]; GPT-2's "
                f"Conv1D weights are [in, out] = {list(spec.shape)} (q, k, v side by side "
                "along dimension 1): transpose it back before importing")


def _known(path: Path, config: dict[str, Any], found: dict[str, SafeTensor],
           notes: list[str]) -> tuple[ModelSpec, dict[str, SafeTensor]]:
    """The model config.json describes (through transformers where it gives
    the architecture a tensor-parallel plan, else ptcfs's own GPT-2 layout),
    and its tensors by its names."""
    arch = architecture(config)
    where = path / "config.json"
    first = next(iter(found.values()))
    emb = found.get("model.embed_tokens.weight") or found.get("transformer.wte.weight") or \
        found.get("wte.weight") or first
    try:
        try:
            model = spec_from_hf(config)
        except InvalidConfig:
            if arch not in ARCHITECTURES:
                raise
            model = spec_from_config(config, emb.dtype)  # GPT-2, or no transformers
    except InvalidConfig as e:
        raise CheckpointError(f"{where}: {str(e).removeprefix('config.json: ')}") from None
    if model.name == "gpt2":
        found = _gpt2_names(found, model, notes)
        _check_conv1d(found, model)
    names = {t.name for t in model.tensors}
    if "lm_head.weight" in found and "lm_head.weight" not in names:
        found = {n: t for n, t in found.items() if n != "lm_head.weight"}
        notes.append("left out lm_head.weight: tie_word_embeddings ties it to the embedding")
    return model, found


def read_hf(path: Path, model_spec: Path | None = None, optimizer: bool = True) -> Source:
    """A :class:`Source` from a model directory (see the module docstring)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; --format hf reads the directory "
                              "save_pretrained writes")
    files = {f: base64.b64encode((path / f).read_bytes()).decode() if f in BINARY_FILES
             else (path / f).read_text() for f in CONFIG_FILES if (path / f).is_file()}
    found = read_dir(path)
    if not found:
        raise CheckpointError(f"{path}: its safetensors files hold no tensor")
    notes: list[str] = []
    if model_spec is not None:
        model = load_spec_file(model_spec)
        model = replace(model, tensors=tuple(t for t in model.tensors if not t.is_optim),
                        pp_only=tuple(t for t in model.pp_only if not t.is_optim))
        text = f"spec:{model_spec.name}"
    elif "config.json" not in files:
        raise CheckpointError(f"{path}: no config.json; give the model with --model-spec FILE")
    else:
        config = _json(path / "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{path / 'config.json'}: not a JSON object")
        model, found = _known(path, config, found, notes)
        text = f"hf:{model.name}"
    model = with_hf_files(with_dtypes(model, {n: t.dtype for n, t in found.items()}), files)
    tensors = {n: entry(t) for n, t in found.items()}
    step = 0
    if (path / TRAINER_STATE).is_file():
        trainer = _json(path / TRAINER_STATE)
        step = int(trainer.get("global_step") or 0) if isinstance(trainer, dict) else 0
    groups: list[tuple[dict[str, Any], list[str]]] = []
    if optimizer:
        step, groups = read_optimizer(path, model, tensors, notes, step)
        read_masters(path, model, tensors)
    params = [t for t in model.tensors if not t.is_optim]
    return Source(tensors, step, model=text, spec=model, dtype=params[0].dtype, notes=notes,
                  groups=groups)


def write_hf(coord: Coordinator, state: JobState, path: Path, progress: bool | None = None,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES,
             notes: list[str] | None = None) -> list[Path]:
    """The job's committed version as a model directory (see the module
    docstring); returns the safetensors files (and index) written; ``notes``
    gets what could not be kept as it was."""
    model = state.model_spec()
    files = hf_files(model)
    if "config.json" not in files:
        config = config_for_preset(model)
        if config is None:
            raise CheckpointError(
                f"job {state.job!r} ({state.model}) has no config.json: only jobs imported "
                "with --format hf and llama/moe presets with names=hf export to hf")
        files["config.json"] = dumps(config)
    if path.is_dir() and any(path.glob("model*.safetensors*")):
        raise CheckpointError(f"{path} holds a model already; export into a new directory")
    params = [t for t in model.tensors if not t.is_optim]
    total = sum(t.nbytes for t in model.tensors)
    with progress_bar(total, f"export {state.job}", progress) as tick:
        def fetch(name: str) -> Any:
            a = coord.fetch_tensor(state, name)
            tick(a.nbytes)
            return a

        written = write_dir(path, [(t.name, t.dtype, t.shape) for t in params], fetch,
                            max_shard_bytes)
        for name, text in files.items():
            if name in BINARY_FILES:
                (path / name).write_bytes(base64.b64decode(text))
            else:
                (path / name).write_text(text)
        groups = write_optimizer(path, state, model, fetch, max_shard_bytes,
                                 files["config.json"], notes)
    if groups and "scheduler.pt" not in files:
        torch.save(scheduler_state(groups, state.step), path / "scheduler.pt")
    if groups and TRAINER_STATE not in files and notes is not None:
        notes.append(TRAINER_NOTE)
    _at_step(path, state.step, TRAINER_STATE in files, "scheduler.pt" in files)
    return written


def _new_trainer_state() -> dict[str, Any]:
    """The fields of a ``trainer_state.json`` (the Trainer's ``TrainerState``,
    transformers 4.57) for a job that came from no Trainer: nothing logged,
    the Trainer's default logging, evaluation and saving intervals (a
    resumed Trainer takes them from here, not from its arguments), no batch
    size (it must be set: :data:`TRAINER_NOTE`), and the state of its
    ``TrainerControl``, which it updates when it saves."""
    control = {"should_epoch_stop": False, "should_evaluate": False, "should_log": False,
               "should_save": False, "should_training_stop": False}
    return {"best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
            "epoch": 0.0, "eval_steps": 500, "global_step": 0, "is_hyper_param_search": False,
            "is_local_process_zero": True, "is_world_process_zero": True, "log_history": [],
            "logging_steps": 500, "max_steps": 0, "num_input_tokens_seen": 0,
            "num_train_epochs": 0, "save_steps": 500,
            "stateful_callbacks": {"TrainerControl": {"args": control, "attributes": {}}},
            "total_flos": 0.0, "train_batch_size": None, "trial_name": None,
            "trial_params": None}


def _at_step(path: Path, step: int, trainer: bool, scheduler: bool) -> None:
    """``trainer_state.json`` (the imported one, else a new one) and an
    imported ``scheduler.pt`` at ``step``: where the job's step moved on
    since the import, the schedule's position moves with it."""
    state = json.loads((path / TRAINER_STATE).read_text()) if trainer else {}
    if not isinstance(state, dict) or not state:
        state = _new_trainer_state()
    if state.get("global_step") != step:
        state["global_step"] = step
        (path / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    if scheduler:
        sd = torch_load(path / "scheduler.pt")
        if isinstance(sd, dict) and sd.get("last_epoch", step) != step:
            sd["last_epoch"] = step
            if "_step_count" in sd:
                sd["_step_count"] = step + 1
            torch.save(sd, path / "scheduler.pt")


def read(path: Path, options: ReadOptions) -> Source:
    """The ``hf`` row of :data:`ptcfs.client.formats.FORMATS`."""
    return read_hf(path, options.model_spec, optimizer=options.optimizer)


def write(coord: Coordinator, state: JobState, path: Path, progress: bool | None,
          notes: list[str] | None) -> None:
    write_hf(coord, state, path, progress, notes=notes)
