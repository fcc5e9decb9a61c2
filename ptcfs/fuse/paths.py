"""Paths under the mount → what they name (the one parser of ``/ptc`` paths).

::

    /<job>/config.json
    /<job>/tensors/<name>.npy[<index>]           names with "/" are folders
    /<job>/ranks/<rank>/<name>.npy[<index>]
    /<job>/ranks/<rank>/state.safetensors
    /<job>/data/...                              the dataset's views
    /<job>/dcp/step-<N>/.metadata, __<r>_0.distcp  each kept step as a DCP checkpoint
    /<job>/hf/config.json, model-*.safetensors   the version as save_pretrained writes it
    /<job>/hf-save/...                           save_pretrained into it: the next version
    /<job>/versions/<v>/...                      the same tree for version v
    /<job>/.data/<d>/...                         the dataset's views at its version d

A job's ``config.json``, ``tensors``, ``ranks``, ``hf`` and ``data`` are links to
the current version's (``versions/<v>/...``, ``.data/<d>``): what a path
names never changes under an open file, and the kernel may cache it.

This module is syntax only: whether the job, tensor or rank exists is the
tree's business (:mod:`ptcfs.fuse.tree`). A path that cannot name anything
raises ``TensorNotFound`` (ENOENT); a malformed ``[...]`` suffix raises
``InvalidRequest`` (EINVAL).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ptcfs.errors import InvalidRequest, TensorNotFound

__all__ = ["Ref", "parse_path", "AREAS", "NPY", "SAFETENSORS", "HIDDEN_MARK"]

AREAS = ("config.json", "tensors", "ranks", "data", "dcp", "hf", "hf-save", "versions",
         ".data")
#: Areas a job has once, not per version
_JOB_ONLY = ("dcp", "hf-save")
NPY = ".npy"
SAFETENSORS = "state.safetensors"
#: Store jobs whose name holds this mark are internal (a job's dataset) and not shown.
HIDDEN_MARK = "@"
_NUMBER = re.compile(r"0|[1-9]\d*")
_INDEXED = re.compile(r"(.+\.npy)\[(.*)\]", re.DOTALL)


@dataclass(frozen=True)
class Ref:
    """What a path names. ``job == ""`` is the mount's root; ``area == ""``
    a job's (or a version's) folder; ``rest`` the components below the
    area (below the rank under ``ranks``); ``index`` the text between the
    brackets of ``<name>.npy[...]``."""

    job: str = ""
    version: int | None = None  # None: the current version; under .data: the dataset's
    area: str = ""
    rank: int | None = None
    rest: tuple[str, ...] = ()
    index: str | None = None

    @property
    def is_version_list(self) -> bool:
        return self.area == "versions"


def _missing(path: str, why: str) -> TensorNotFound:
    return TensorNotFound(f"{path}: {why}")


def parse_path(path: str) -> Ref:
    """Parse an absolute path under the mount (see the module docstring)."""
    if not path.startswith("/"):
        raise InvalidRequest(f"{path!r}: paths under the mount start with /")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _missing(path, "no . or .. components")
    if not parts:
        return Ref()
    job, parts = parts[0], parts[1:]
    if HIDDEN_MARK in job:
        raise _missing(path, f"no job {job!r}")
    version: int | None = None
    if parts and parts[0] == "versions":
        if len(parts) == 1:
            return Ref(job, area="versions")
        if not _NUMBER.fullmatch(parts[1]):
            raise _missing(path, f"versions are numbered; {parts[1]!r} is not a version")
        version, parts = int(parts[1]), parts[2:]
    if not parts:
        return Ref(job, version)
    area, parts = parts[0], parts[1:]
    if area not in AREAS or area == "versions" or (version is not None and area == ".data"):
        raise _missing(path, f"a job's folder holds {', '.join(AREAS[:-1])}; not {area!r}")
    if version is not None and area in _JOB_ONLY:
        raise _missing(path, f"{area} is a folder of the job, not of a version")
    if area in _JOB_ONLY:
        return Ref(job, None, area, rest=tuple(parts))
    if area == "config.json":
        if parts:
            raise _missing(path, "config.json is a file")
        return Ref(job, version, area)
    if area == ".data":
        if not parts:
            return Ref(job, None, ".data")  # the folder of the dataset's view versions
        if not _NUMBER.fullmatch(parts[0]):
            raise _missing(path, "dataset views are numbered by the dataset's version")
        version, parts = int(parts[0]), parts[1:]
        area = "data"
    rank: int | None = None
    if area == "ranks" and parts:
        if not _NUMBER.fullmatch(parts[0]):
            raise _missing(path, f"ranks are numbered; {parts[0]!r} is not a rank")
        rank, parts = int(parts[0]), parts[1:]
    index: str | None = None
    if parts and area != "data":
        m = _INDEXED.fullmatch(parts[-1])
        if m is not None:
            parts = parts[:-1] + [m.group(1)]
            index = m.group(2)
        elif "[" in parts[-1] or "]" in parts[-1]:
            raise InvalidRequest(f"{path}: a slice suffix goes after .npy as [start:stop,...]")
    return Ref(job, version, area, rank, tuple(parts), index)
