"""Checkpoint formats: one module each, named in one table (:data:`FORMATS`).

A format module defines ``read(path, options) -> Source`` (the checkpoint as
logical tensors, :class:`ReadOptions` saying what to read) and
``write(coord, state, path, progress, notes)`` (a job's committed version in
the format's layout). This table imports no format (nor torch): ``ptcctl``'s
``--format`` choices come from it, and :func:`module` imports the one asked
for. Adding a format is a module and a row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ptcfs.errors import InvalidConfig, TorchMissing

__all__ = ["FORMATS", "Format", "ReadOptions", "module"]


@dataclass(frozen=True)
class Format:
    #: the ``--format`` value
    name: str
    #: the module under ``ptcfs.client.formats`` that reads and writes it
    module: str
    #: one line for the help
    summary: str


@dataclass(frozen=True)
class ReadOptions:
    """What a format's ``read`` is told (each format uses what applies)."""

    #: attention heads, where the checkpoint does not record them
    heads: int | None = None
    #: unpickle what ``weights_only`` refuses (``--trust-pickle``)
    trust: bool = False
    #: read the optimizer's state too
    optimizer: bool = True
    #: a spec file that describes the model (``--model-spec``)
    model_spec: Path | None = None
    #: the preset, for formats whose tensor names depend on it
    model: str | None = None


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("megatron", "megatron", "Megatron-LM's legacy checkpoints (iter_N/mp_rank_*)"),
    Format("mcore", "mcore", "Megatron-Core torch_dist checkpoints"),
    Format("torch-dcp", "dcp", "torch.distributed.checkpoint directories"),
    Format("torchtitan", "titan", "torchtitan's checkpoints (a step-N folder of its "
           "CheckpointManager)"),
    Format("torch", "torchsave", "a torch.save file of a state dict"),
    Format("hf", "hf", "Hugging Face save_pretrained directories"),
    Format("deepspeed", "zero_pipe", "DeepSpeed ZeRO-1/2/3 checkpoints (latest, global_stepN/), "
           "pipelines too (layer_XX files)"),
    Format("deepspeed-universal", "zero_universal", "DeepSpeed universal checkpoints "
           "(latest_universal, a folder of zero/<param>/fp32.pt, exp_avg.pt, ...)"),
)}


def module(name: str) -> ModuleType:
    """The module of format ``name``: its ``read`` and ``write``."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InvalidConfig(f"unknown format {name!r}; use one of {', '.join(FORMATS)}")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissing("import and export need torch: pip install 'ptcfs[torch]'") from None
    return importlib.import_module(f"ptcfs.client.formats.{fmt.module}")
