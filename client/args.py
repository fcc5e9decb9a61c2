"""Argument groups that several ``ptcctl`` subcommands share."""

from __future__ import annotations

import argparse

from ptcfs.presets import OPTIMIZERS, parse_model
from ptcfs.sharding import parse_config
from ptcfs.types import ModelSpec, ParallelConfig

__all__ = ["add_model_args", "model_from_args", "config_from"]

MODEL_HELP = "model preset, e.g. gpt:layers=24,hidden=1536,heads=16,vocab=50257[,ffn=F][,seq=S]"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--optimizer``."""
    p.add_argument("--model", required=True, metavar="PRESET", help=MODEL_HELP)
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                   help="parameter dtype (default fp16)")
    p.add_argument("--optimizer", default="none", choices=OPTIMIZERS,
                   help="optimizer state to include (default none)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model the shared arguments describe."""
    return parse_model(args.model, dtype=args.dtype, optimizer=args.optimizer)


def config_from(degrees: str, hosts: str) -> ParallelConfig:
    """A configuration from ``tp=..,pp=..,dp=..`` and ``name:gpus,...``."""
    return parse_config(degrees, hosts)
