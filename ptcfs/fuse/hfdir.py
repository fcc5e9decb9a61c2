"""``/<job>/hf/``: a version as the directory ``save_pretrained`` writes.

For a job with Hugging Face names (imported with ``--format hf``, or a
``llama``/``moe`` preset with ``names=hf``): its ``config.json`` (the one
recorded at import, or one written from the preset's sizes), the other
model files it recorded (``generation_config.json``), and its parameters
as safetensors shards with their index, one tensor a shard, so that each
shard is a header followed by that tensor's bytes, read from the store as
ranges (:class:`~ptcfs.vfile.VFile`) or gathered from its sub-tensors where
they are not one run of it (:class:`~ptcfs.fuse.tree.ArrayFile`).
``from_pretrained`` on the folder loads the version's weights; the
optimizer state and the Trainer's files are not part of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidConfig
from ptcfs.fuse.formats import safetensors_header
from ptcfs.model.hfmodels import BINARY_FILES, config_for_preset, dumps, hf_files
from ptcfs.types import ModelSpec, TensorSpec
from ptcfs.vfile import VFile

F = TypeVar("F")

__all__ = ["HF", "HF_SAVE", "model_files", "hf_dir"]

#: The area of a job's folder that holds it.
HF = "hf"
#: The area of a job's folder that takes ``save_pretrained`` (:mod:`ptcfs.fuse.hfwrite`).
HF_SAVE = "hf-save"
#: Recorded files that belong to a training run, not to a model directory.
_NOT_MODEL = frozenset({"trainer_state.json"}) | BINARY_FILES
#: The shard file's metadata, as ``save_pretrained`` writes it.
_META = {"format": "pt"}


def model_files(model: ModelSpec) -> dict[str, str] | None:
    """The text files of the model directory (``config.json`` first), or
    None when the job has no Hugging Face names."""
    files = {k: v for k, v in hf_files(model).items() if k not in _NOT_MODEL}
    if "config.json" not in files:
        try:
            config = config_for_preset(model)
        except InvalidConfig:  # a preset that does not record every size
            config = None
        if config is None:
            return None
        files["config.json"] = dumps(config)
    return files


def hf_dir(model: ModelSpec, whole: Callable[[TensorSpec, bytes], F]
           ) -> dict[str, F | VFile] | None:
    """The folder's files by name; ``whole(spec, header)`` is the tensor's
    bytes after ``header``. None when the job has no Hugging Face names."""
    texts = model_files(model)
    if texts is None:
        return None
    params = [t for t in model.tensors if not t.is_optim]
    out: dict[str, F | VFile] = {k: VFile.of_bytes(v.encode()) for k, v in texts.items()}
    n = len(params)
    names = ["model.safetensors"] if n == 1 else [
        f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    total = 0
    for name, t in zip(names, params, strict=True):
        nbytes = numpy_dtype(t.dtype).itemsize * math.prod(t.shape)
        total += nbytes
        out[name] = whole(t, safetensors_header([(t.name, t.dtype, t.shape, nbytes)], _META))
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, t in zip(names, params, strict=True)}}
        out["model.safetensors.index.json"] = VFile.of_bytes(dumps(index).encode())
    return out

