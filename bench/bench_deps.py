"""What the benchmarks need beyond ptcfs and torch, installed on demand.

The ``bench`` extra of pyproject.toml lists matplotlib (the scaling plot)
and the packages mosaicml-streaming imports. mosaicml-streaming itself is
installed with ``--no-deps``: its metadata pins ``numpy<2.2`` and wants
torchvision, whose PyPI build would replace torch's CPU build; it runs
with the numpy installed here (see :mod:`streaming_peer` for torchvision).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from collections.abc import Callable

from common import ROOT

__all__ = ["STREAMING", "ensure", "missing"]

STREAMING = "mosaicml-streaming==0.13.0"
#: import name → what it is for (every one is in the bench extra)
MODULES = {"matplotlib": "the scaling plot", "transformers": "streaming's loader",
           "xxhash": "streaming", "zstd": "streaming", "brotli": "streaming",
           "snappy": "streaming", "catalogue": "streaming"}


def missing() -> list[str]:
    """Import names not installed (``streaming`` for mosaicml-streaming)."""
    out = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("streaming") is None:
        out.append("streaming")
    return out


def _extra() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        reqs: list[str] = tomllib.load(f)["project"]["optional-dependencies"]["bench"]
    return reqs


def ensure(install: bool = True, say: Callable[[str], None] = print) -> list[str]:
    """Install what is missing (unless ``install`` is false); what is still missing."""
    need = missing()
    if not need or not install:
        return need
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if any(m != "streaming" for m in need):
        say("installing the bench extra: " + ", ".join(_extra()))
        subprocess.run([*pip, *_extra()], check=False)
    if "streaming" in need:
        say(f"installing {STREAMING} (--no-deps)")
        subprocess.run([*pip, "--no-deps", STREAMING], check=False)
    importlib.invalidate_caches()
    return missing()
