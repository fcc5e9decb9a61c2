"""Argument groups that several ``ptcctl`` subcommands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ptcfs import settings
from ptcfs.errors import BadInput, InvalidConfig, InvalidRequest
from ptcfs.jobstate import check_job_name
from ptcfs.model.presets import OPTIMIZERS, parse_model, with_optimizer
from ptcfs.model.specfile import load_spec_file
from ptcfs.sharding import parse_config
from ptcfs.types import ModelSpec, ParallelConfig

__all__ = ["MESH_METAVAR", "add_model_args", "model_from_args", "model_text", "config_from",
           "whole", "size", "job_name", "door"]

#: How the mesh degrees are written (any subset, each at most once).
MESH_METAVAR = "pp=N,dp=N,fsdp=N,cp=N,tp=N,ep=N,zero=0|1,cp_shard=0|1"
MODEL_HELP = "model preset, e.g. gpt:layers=24,hidden=1536,heads=16,vocab=50257[,ffn=F][,seq=S]"


def add_model_args(p: argparse.ArgumentParser, from_hf: bool = False) -> None:
    """``--model`` or ``--model-spec`` (or, with ``from_hf``, ``--from-hf``),
    ``--dtype`` and ``--optimizer``."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", metavar="PRESET", help=MODEL_HELP)
    g.add_argument("--model-spec", metavar="FILE",
                   help="a model spec file (TOML or JSON; `ptcctl spec` writes one to start from)")
    if from_hf:
        g.add_argument("--from-hf", metavar="DIR",
                       help="a save_pretrained directory: the spec transformers' model and "
                       "tensor-parallel plan give its config.json (dtypes from its files)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                   help="parameter dtype of a preset (default fp16)")
    p.add_argument("--optimizer", default="none", choices=OPTIMIZERS,
                   help="optimizer state to include (default none)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model the shared arguments describe."""
    if args.model_spec is not None:  # given, even if empty: its error names it
        model = load_spec_file(args.model_spec)
        if args.optimizer != "none":
            if any(t.is_optim for t in model.tensors):
                raise InvalidConfig(f"{args.model_spec} lists optimizer state already; "
                                    "leave out --optimizer")
            model = with_optimizer(model, args.optimizer)
        return model
    return parse_model(args.model, dtype=args.dtype, optimizer=args.optimizer)


def model_text(args: argparse.Namespace) -> str:
    """How the model was given, for a job's record: the preset, or the spec file's name."""
    return str(args.model) if args.model is not None else f"spec:{Path(args.model_spec).name}"


def whole(minimum: int = 0) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum`` (argparse
    then refuses anything else in one line, exit 2)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} is below {minimum}")
        return n

    parse.__name__ = f"whole number >= {minimum}"
    return parse


def size(text: str) -> int:
    """An argparse type: a size in bytes, or with a suffix (8M, 64MiB)."""
    try:
        n = settings.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or 8M, 64MiB)") \
            from None
    if n < 1:
        raise argparse.ArgumentTypeError("a size must be at least 1 byte")
    return n


def job_name(text: str) -> str:
    """An argparse type: a name a job can have (``ptcctl job delete`` takes
    any name, to remove what an older ptcfs let in)."""
    try:
        return check_job_name(text)
    except InvalidConfig as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from(degrees: str, hosts: str) -> ParallelConfig:
    """A configuration from degrees (:data:`MESH_METAVAR`) and ``name:gpus,...``."""
    return parse_config(degrees, hosts)


@contextmanager
def door() -> Iterator[None]:
    """Checks of argument values that need the cluster first (a slice needs
    the tensor's shape): an :class:`InvalidRequest` raised inside is the
    command line's fault, so it becomes :class:`BadInput` (exit 2)."""
    try:
        yield
    except BadInput:
        raise
    except InvalidRequest as e:
        raise BadInput(str(e)) from e
