"""What a parsed path is: a folder, or a file made of headers and stored bytes.

The tree reads everything it needs from the host's own store: every host
keeps the metadata of every version of every job (:mod:`ptcfs.jobstate`),
so it knows each tensor's shape and where each sub-tensor lives in the
cluster, and builds files as :class:`~ptcfs.vfile.VFile` (header and whole
stored byte ranges) or :class:`ArrayFile` (a region of a tensor gathered
from the sub-tensors that hold it).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ptcfs.boxes import contiguous_range
from ptcfs.data.names import store_job
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import JobNotFound, StoreDamaged, TensorNotFound, VersionNotFound
from ptcfs.fuse.dcpdir import check_rest, step_name, steps
from ptcfs.fuse.formats import npy_header, safetensors_header
from ptcfs.fuse.hfdir import HF, HF_SAVE, hf_dir, model_files
from ptcfs.fuse.paths import HIDDEN_MARK, NPY, SAFETENSORS, Ref
from ptcfs.jobstate import DEFAULT_MODE, JobState
from ptcfs.sharding import rank_coords, rank_tensors
from ptcfs.slicing import parse_index
from ptcfs.store.base import TensorStore
from ptcfs.types import Box, ModelSpec, Slice, TensorSpec, box_intersect, full_box
from ptcfs.vfile import Literal, StoreRange, VFile

__all__ = ["Catalog", "Dir", "File", "Link", "ArrayFile", "Piece", "Node", "JobView",
           "local_to"]


@dataclass(frozen=True)
class Piece:
    """Part of an array file's tensor: ``box`` of the tensor is ``box``
    shifted to ``entry_start`` in a stored entry of ``entry_shape``."""

    box: Box
    entry_start: tuple[int, ...]
    entry_shape: tuple[int, ...]
    job: str
    version: int
    tensor: str
    part: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class ArrayFile:
    """An ``.npy`` file of ``region`` of a tensor held in ``pieces``."""

    header: bytes
    itemsize: int
    region: Box
    pieces: tuple[Piece, ...]

    @property
    def extents(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    @property
    def size(self) -> int:
        return len(self.header) + self.itemsize * math.prod(self.extents)


File = VFile | ArrayFile


def local_to(item: File, host: str) -> bool:
    """True when every byte of ``item`` that lives in a store is in ``host``'s."""
    if isinstance(item, ArrayFile):
        return all(host in p.hosts for p in item.pieces)
    return all(host in s.hosts for s in item.segments if isinstance(s, StoreRange))


@dataclass(frozen=True)
class Dir:
    """A folder: its entries as ``(name, is a folder)``."""

    entries: tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class Link:
    """A symbolic link (the current version's folders), relative to its folder."""

    target: str


@dataclass(frozen=True)
class Node:
    """A resolved path: a folder, a file or a link; of which version; writable
    or not."""

    item: Dir | File | Link
    version: int = 0
    mtime: float = 0.0
    writable: bool = False


class JobView:
    """One committed version of a job, as files."""

    def __init__(self, state: JobState, mtime: float):
        self.state = state
        self.mtime = mtime
        self._dcp: dict[str, VFile] | None = None
        self._hf: tuple[dict[str, File] | None] | None = None
        self.model: ModelSpec = state.model_spec()
        self.specs: dict[str, TensorSpec] = {
            s.name: s for s in self.model.tensors_for(state.config.pp)}
        self._lock = threading.Lock()
        self._placed: dict[str, dict[Slice, dict[str, list[int]]]] = {}
        #: rank_file's answers (a version never changes; a path is looked up often)
        self._rank_files: dict[tuple[int, str, str | None], File] = {}

    def placed(self, spec: TensorSpec) -> dict[Slice, dict[str, list[int]]]:
        with self._lock:
            if spec.name not in self._placed:
                s = self.state
                self._placed[spec.name] = s.placement(spec, self.model)
            return self._placed[spec.name]

    @cached_property
    def ranks(self) -> list[list[tuple[TensorSpec, Slice]]]:
        return [rank_tensors(self.model, self.state.config, r)
                for r in range(self.state.config.world)]

    def config_json(self) -> bytes:
        s = self.state
        doc: dict[str, Any] = {
            **s.to_meta(), "world": s.config.world,
            "ranks": {str(c.rank): {"host": c.host, "pp_rank": c.pp_rank, "dp_rank": c.dp_rank,
                                    "fsdp_rank": c.fsdp_rank, "cp_rank": c.cp_rank,
                                    "tp_rank": c.tp_rank, "data_rank": c.data_rank,
                                    "ep_rank": c.ep_rank} for c in rank_coords(s.config)},
        }
        return (json.dumps(doc, indent=2) + "\n").encode()

    # --- files ------------------------------------------------------------------
    def tensor_file(self, name: str, index: str | None) -> File:
        spec = self._spec(name)
        return _array_file(spec.dtype, spec.shape, self._pieces(spec), index)

    def whole(self, spec: TensorSpec, header: bytes) -> File:
        """Tensor ``spec`` whole, in C order, after ``header``."""
        af = ArrayFile(header, numpy_dtype(spec.dtype).itemsize, full_box(spec.shape),
                       tuple(self._pieces(self._spec(spec.name))))
        return _as_ranges(af, spec.shape) or af

    def hf_files(self) -> dict[str, File] | None:
        """The version as a ``save_pretrained`` directory (:mod:`ptcfs.fuse.hfdir`);
        None when the job has no Hugging Face names."""
        if self._hf is None:  # built unlocked: whole() takes the lock through placed()
            files = (hf_dir(self.model, self.whole),)
            with self._lock:
                if self._hf is None:
                    self._hf = files
        return self._hf[0]

    @cached_property
    def has_hf(self) -> bool:
        return model_files(self.model) is not None

    def _pieces(self, spec: TensorSpec) -> list[Piece]:
        pieces = []
        for sl, hosts in self.placed(spec).items():
            local_shape = sl.local_shape(spec.shape)
            for logical, local in sl.pieces(spec.shape):
                pieces.append(Piece(logical, tuple(a for a, _ in local), local_shape,
                                    self.state.job, self.state.version, spec.name, sl.key(),
                                    tuple(hosts)))
        return pieces

    def rank_file(self, rank: int, name: str, index: str | None) -> File:
        key = (rank, name, index)
        found = self._rank_files.get(key)
        if found is not None:
            return found
        spec, sl = self._rank_entry(rank, name)
        shape = sl.local_shape(spec.shape)
        hosts = tuple(self.placed(spec)[sl])
        piece = Piece(full_box(shape), (0,) * len(shape), shape, self.state.job,
                      self.state.version, spec.name, sl.key(), hosts)
        made = _array_file(spec.dtype, shape, [piece], index)
        with self._lock:
            if len(self._rank_files) > 4096:  # slices of files: a bound on what is kept
                self._rank_files.clear()
            self._rank_files[key] = made
        return made

    def safetensors(self, rank: int) -> VFile:
        entries = self._rank(rank)
        described = []
        segments: list[Literal | StoreRange] = []
        for spec, sl in entries:
            shape = sl.local_shape(spec.shape)
            nbytes = numpy_dtype(spec.dtype).itemsize * math.prod(shape)
            described.append((spec.name, spec.dtype, shape, nbytes))
            segments.extend(self.entry(spec, sl).segments)
        meta = {"format": "pt", "job": self.state.job, "version": str(self.state.version),
                "rank": str(rank), "step": str(self.state.step)}
        return VFile((Literal(safetensors_header(described, meta)), *segments))

    def entry(self, spec: TensorSpec, sl: Slice) -> VFile:
        """The stored sub-tensor ``sl`` of ``spec``, its bytes alone."""
        nbytes = numpy_dtype(spec.dtype).itemsize * math.prod(sl.local_shape(spec.shape))
        return VFile((StoreRange(self.state.job, self.state.version, spec.name, sl.key(), 0,
                                 nbytes, tuple(self.placed(spec)[sl])),))

    def dcp_files(self) -> dict[str, VFile]:
        """The version as a DCP checkpoint's files (:mod:`ptcfs.dcp.view`)."""
        with self._lock:
            if self._dcp is None:
                from ptcfs.dcp.view import view_files

                self._dcp = view_files(self.state, self._placed_unlocked)
            return self._dcp

    def _placed_unlocked(self, spec: TensorSpec) -> dict[Slice, dict[str, list[int]]]:
        if spec.name not in self._placed:
            self._placed[spec.name] = self.state.placement(spec, self.model)
        return self._placed[spec.name]

    # --- folders ----------------------------------------------------------------
    def tensor_dir(self, folder: tuple[str, ...], names: list[str]) -> Dir:
        return _folder(folder, names, path=f"/{self.state.job}/tensors")

    def rank_names(self, rank: int) -> list[str]:
        self._rank(rank)  # a rank out of range says so
        return self._rank_names[rank]

    @cached_property
    def _rank_names(self) -> list[list[str]]:
        return [[spec.name for spec, _ in r] for r in self.ranks]

    def _spec(self, name: str) -> TensorSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise TensorNotFound(f"job {self.state.job!r} version {self.state.version} has no "
                                 f"tensor {name!r}")
        return spec

    def _rank(self, rank: int) -> list[tuple[TensorSpec, Slice]]:
        if not 0 <= rank < self.state.config.world:
            last = self.state.config.world - 1
            raise TensorNotFound(f"job {self.state.job!r} has ranks 0..{last}; no rank {rank}")
        return self.ranks[rank]

    def _rank_entry(self, rank: int, name: str) -> tuple[TensorSpec, Slice]:
        for spec, sl in self._rank(rank):
            if spec.name == name:
                return spec, sl
        raise TensorNotFound(f"rank {rank} of job {self.state.job!r} holds no tensor {name!r}")


def _array_file(dtype: str, shape: tuple[int, ...], pieces: list[Piece],
                index: str | None) -> File:
    region, out_shape = parse_index(index, shape) if index is not None else (full_box(shape),
                                                                            shape)
    itemsize = numpy_dtype(dtype).itemsize
    af = ArrayFile(npy_header(dtype, out_shape), itemsize, region, tuple(pieces))
    return _as_ranges(af, shape) or af


def _as_ranges(af: ArrayFile, shape: tuple[int, ...]) -> VFile | None:
    """The same file as whole byte ranges, when the region is one run of the
    tensor (the whole tensor, or rows of it) and each piece's part of it is
    one run of the tensor and of its entry (row splits, replicated tensors,
    whole entries): such files are read without gathering, and spliced."""
    whole = contiguous_range(af.region, shape, af.itemsize)
    if whole is None:
        return None
    lo, total = whole
    runs = []
    for p in af.pieces:
        sub = box_intersect(p.box, af.region)
        if sub is None:
            continue
        outer = contiguous_range(sub, shape, af.itemsize)
        entry_box = tuple((s + a - pa, s + b - pa)
                          for s, (a, b), (pa, _) in zip(p.entry_start, sub, p.box))
        inner = contiguous_range(entry_box, p.entry_shape, af.itemsize)
        if outer is None or inner is None:
            return None
        runs.append((outer[0] - lo, StoreRange(p.job, p.version, p.tensor, p.part, inner[0],
                                               inner[1], p.hosts)))
    runs.sort(key=lambda r: r[0])
    pos = 0
    for start, seg in runs:
        if start != pos:
            return None
        pos += seg.length
    if pos != total:
        return None
    return VFile((Literal(af.header), *(seg for _, seg in runs)))


def _folder(folder: tuple[str, ...], names: list[str], path: str) -> Dir:
    """The entries of ``folder`` among tensor ``names`` ("a/b" is a folder a)."""
    depth = len(folder)
    seen: dict[str, bool] = {}
    for n in names:
        parts = n.split("/")
        if len(parts) <= depth or tuple(parts[:depth]) != folder:
            continue
        if len(parts) == depth + 1:
            seen.setdefault(parts[depth] + NPY, False)
        else:
            seen[parts[depth]] = True
    if not seen and folder:
        raise TensorNotFound(f"{path}/{'/'.join(folder)}: no such folder")
    return Dir(tuple(sorted(seen.items())))


class Catalog:
    """Paths → nodes, from one host's store (``data_tree``: the dataset views
    of a job, or None when it has none)."""

    def __init__(self, store: TensorStore):
        self.store = store
        self._data_cache: dict[str, tuple[int | None, dict[str, VFile] | None]] = {}
        self._views: dict[tuple[str, int], JobView] = {}
        #: job → (the store's changes() when read, its committed versions)
        self._committed: dict[str, tuple[int, dict[int, dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def jobs(self) -> list[str]:
        """Jobs with model state, and jobs with only a dataset (``<job>@data``);
        none where the store's data file was cut short (``ptcctl status``
        names it): the root stays a folder."""
        names = set()
        try:
            held = self.store.jobs()
        except StoreDamaged:
            return []
        for j in held:
            if HIDDEN_MARK not in j:
                if self.committed(j):
                    names.add(j)
            elif j.endswith(HIDDEN_MARK + "data") and self._data(j[: -len("@data")])[0]:
                names.add(j[: -len("@data")])
        return sorted(names)

    def committed(self, job: str) -> dict[int, dict[str, Any]]:
        """The job's committed versions and their records (read once per
        write to the store: each lookup of a path asks two or three times,
        and a stat through the mount is some ten lookups)."""
        mark = self.store.changes()
        with self._lock:
            hit = self._committed.get(job)
        if mark is not None and hit is not None and hit[0] == mark:
            return dict(hit[1])
        out = {v.version: v.meta for v in self.store.versions(job) if v.state == "committed"}
        if mark is not None:
            with self._lock:
                if len(self._committed) > 256:
                    self._committed.clear()
                self._committed[job] = (mark, out)
        return dict(out)

    def access(self, job: str) -> tuple[int, int, int] | None:
        """``(uid, gid, mode)`` of the job's files, from its current version's
        record (read at each call: ``ptcctl job chown`` changes it in
        place; a record without an owner: the mount's user); a job with only
        a dataset, its dataset's record (None: it has none)."""
        committed = self.committed(job) if job and HIDDEN_MARK not in job else {}
        if not committed and job and HIDDEN_MARK not in job:
            data = self.committed(store_job(job))
            if data and "owner" in data[max(data)]:
                committed = data
        if not committed:
            return None
        meta = committed[max(committed)]
        owner = meta.get("owner")
        if not (isinstance(owner, list) and len(owner) == 2):
            owner = [os.getuid(), os.getgid()]
        mode = meta.get("mode", DEFAULT_MODE)
        return int(owner[0]), int(owner[1]), int(mode) if type(mode) is int else DEFAULT_MODE

    def view(self, job: str, version: int | None) -> JobView:
        committed = self.committed(job) if HIDDEN_MARK not in job else {}
        if not committed:
            raise JobNotFound(f"no job {job!r} on this host")
        v = max(committed) if version is None else version
        if v not in committed:
            raise VersionNotFound(f"job {job!r} has no committed version {v} here (kept: "
                                  f"{', '.join(map(str, sorted(committed)))})")
        with self._lock:
            jv = self._views.get((job, v))
            if jv is None:
                meta = committed[v]
                jv = JobView(JobState.from_meta(meta), float(meta.get("committed_at", 0.0)))
                if len(self._views) > 64:
                    self._views.clear()
                self._views[(job, v)] = jv
            return jv

    def resolve(self, ref: Ref) -> Node:
        if not ref.job:
            return Node(Dir(tuple((j, True) for j in self.jobs())))
        if ref.is_version_list:
            versions = sorted(self.committed(ref.job)) if HIDDEN_MARK not in ref.job else []
            if not versions:
                raise JobNotFound(f"no job {ref.job!r} on this host")
            return Node(Dir(tuple((str(v), True) for v in versions)))
        if ref.area in ("data", ".data"):
            return self._data_node(ref)
        if ref.area == "dcp":
            return self._dcp_node(ref)
        if ref.area == HF_SAVE:
            return self._hf_save_node(ref)
        if ref.area == "" and ref.version is None and not self.committed(ref.job) and \
                HIDDEN_MARK not in ref.job and self._data(ref.job)[1] is not None:
            return Node(Dir((("data", True),)))  # a job with a dataset and no model state
        jv = self.view(ref.job, ref.version)
        if ref.version is None and (ref.area == "config.json" or (
                ref.area in ("tensors", "ranks", HF) and ref.rank is None and not ref.rest)):
            return Node(Link(f"versions/{jv.state.version}/{ref.area}"), jv.state.version,
                        jv.mtime)
        node = self._resolve_in(jv, ref)
        current = ref.version is None or ref.version == max(self.committed(ref.job))
        return Node(node, jv.state.version, jv.mtime,
                    writable=current and ref.area == "ranks" and ref.rank is not None)

    #: folders of saves being written under ``/<job>/dcp/`` → their files (the write side)
    writing: Callable[[str], dict[str, list[str]]] = staticmethod(lambda job: {})  # type: ignore
    #: the reason a save's commit was refused (``/<job>/dcp/<folder>/.refused``), if it was
    refused: Callable[[str, str], bytes | None] = staticmethod(lambda job, f: None)  # type: ignore

    #: the files of the save being written into ``/<job>/hf-save/`` (and ``.refused``)
    hf_writing: Callable[[str], list[str]] = staticmethod(lambda job: [])  # type: ignore
    #: why the last save into ``/<job>/hf-save/`` was refused, if it was
    hf_refused: Callable[[str], bytes | None] = staticmethod(lambda job: None)  # type: ignore

    def _hf_save_node(self, ref: Ref) -> Node:
        """``/<job>/hf-save/``: a save being written (:mod:`ptcfs.fuse.hfwrite`)."""
        jv = self.view(ref.job, None)
        where = f"/{ref.job}/{HF_SAVE}/{'/'.join(ref.rest)}"
        if not jv.has_hf:
            raise TensorNotFound(f"{where}: job {ref.job!r} has no Hugging Face names")
        names = self.hf_writing(ref.job)
        if not ref.rest:
            return Node(Dir(tuple((n, False) for n in names)), writable=True)
        why = self.hf_refused(ref.job)
        if ref.rest == (".refused",) and why is not None:
            return Node(VFile.of_bytes(why))
        raise TensorNotFound(f"{where}: " + ("being written" if ref.rest[0] in names
                                             else "no such file"))

    def _dcp_node(self, ref: Ref) -> Node:
        """``/<job>/dcp/``: a ``step-<N>/`` folder per kept step (:mod:`ptcfs.fuse.dcpdir`)."""
        committed = self.committed(ref.job) if HIDDEN_MARK not in ref.job else {}
        if not committed:
            raise JobNotFound(f"no job {ref.job!r} on this host")
        by_step, writing = steps(committed), self.writing(ref.job)
        if not ref.rest:
            names = {step_name(s): True for s in by_step} | dict.fromkeys(writing, True)
            return Node(Dir(tuple(sorted(names.items()))), writable=True)
        folder, step = ref.rest[0], check_rest(ref.job, ref.rest)
        if step not in by_step or folder in writing:
            if folder in writing and len(ref.rest) == 1:
                return Node(Dir(tuple((n, False) for n in sorted(writing[folder]))),
                            writable=True)
            why = self.refused(ref.job, folder) if folder in writing else None
            if why is not None and ref.rest[1:] == (".refused",):
                return Node(VFile.of_bytes(why))
            if folder in writing:
                raise TensorNotFound(f"/{ref.job}/dcp/{'/'.join(ref.rest)}: being written")
            raise TensorNotFound(f"job {ref.job!r} has no committed version of step {step} "
                                 f"(steps kept: {', '.join(map(str, sorted(by_step)))})")
        jv = self.view(ref.job, by_step[step])
        files = jv.dcp_files()
        if len(ref.rest) == 1:
            return Node(Dir(tuple((n, False) for n in sorted(files))), jv.state.version,
                        jv.mtime, writable=True)
        item = files.get(ref.rest[1])
        if item is None:
            raise TensorNotFound(f"/{ref.job}/dcp/{folder}/{ref.rest[1]}: no such file")
        return Node(item, jv.state.version, jv.mtime)

    def _data_node(self, ref: Ref) -> Node:
        """``data`` links to ``.data/<d>``, the views at the dataset's version d."""
        version, files = self._data(ref.job) if HIDDEN_MARK not in ref.job else (None, None)
        if files is None or version is None:
            raise TensorNotFound(f"job {ref.job!r} has no dataset")
        if ref.area == ".data":
            return Node(Dir(((str(version), True),)), version)
        if ref.version is None:
            if not ref.rest:
                return Node(Link(f".data/{version}"), version)
        elif ref.version != version:
            raise TensorNotFound(f"the dataset of job {ref.job!r} is at version {version} now; "
                                 f"views of version {ref.version} are gone")
        return Node(_data_node(files, ref.rest, ref.job), version)

    def _resolve_in(self, jv: JobView, ref: Ref) -> Dir | File:
        area, rest = ref.area, ref.rest
        if area == "":
            entries = [("config.json", False), ("ranks", True), ("tensors", True)]
            if jv.has_hf:
                entries.append((HF, True))
            if ref.version is None:
                entries += [("versions", True), ("dcp", True)]
                if jv.has_hf:
                    entries.append((HF_SAVE, True))
                if self._data(jv.state.job)[1] is not None:
                    entries.append(("data", True))
            return Dir(tuple(sorted(entries)))
        if area == "config.json":
            return VFile.of_bytes(jv.config_json())
        if area == "tensors":
            return self._tensor_path(jv, rest, ref.index, list(jv.specs),
                                     lambda n: jv.tensor_file(n, ref.index))
        if area == "ranks":
            if ref.rank is None:
                return Dir(tuple((str(r), True) for r in range(jv.state.config.world)))
            rank = ref.rank
            if rest == (SAFETENSORS,):
                return jv.safetensors(rank)
            names = jv.rank_names(rank)
            found = self._tensor_path(jv, rest, ref.index, names,
                                      lambda n: jv.rank_file(rank, n, ref.index))
            if isinstance(found, Dir) and not rest:
                return Dir(tuple(sorted(found.entries + ((SAFETENSORS, False),))))
            return found
        if area == HF:
            return _hf_node(jv, rest)
        raise TensorNotFound(f"/{jv.state.job}/versions/{jv.state.version}/{area}: no such "
                             "folder")

    def _tensor_path(self, jv: JobView, rest: tuple[str, ...], index: str | None,
                     names: list[str], make: Callable[[str], File]) -> Dir | File:
        if rest and rest[-1].endswith(NPY):
            name = "/".join(rest)[: -len(NPY)]
            if name in names:
                return make(name)
            if index is not None or name not in jv.specs:
                raise TensorNotFound(f"job {jv.state.job!r}: no tensor {name!r} here")
        if index is not None:
            raise TensorNotFound(f"job {jv.state.job!r}: only .npy files take a [...] slice")
        return _folder(rest, names, path=f"/{jv.state.job}")

    def _data(self, job: str) -> tuple[int | None, dict[str, VFile] | None]:
        """The dataset's version and views, rebuilt when its version changes."""
        try:
            from ptcfs.data import views
        except ImportError:  # a build without dataset support
            return None, None
        key = views.data_version(job, self.store)
        with self._lock:
            cached = self._data_cache.get(job)
            if cached is not None and cached[0] == key:
                return cached
        tree = views.data_tree(job, self.store) if key is not None else None
        with self._lock:
            self._data_cache[job] = (key, tree)
        return key, tree


def _hf_node(jv: JobView, rest: tuple[str, ...]) -> Dir | File:
    files = jv.hf_files()
    where = f"/{jv.state.job}/versions/{jv.state.version}/{HF}"
    if files is None:
        raise TensorNotFound(f"{where}: job {jv.state.job!r} has no Hugging Face names (import "
                             "it with --format hf, or create it from a preset with names=hf)")
    if not rest:
        return Dir(tuple((n, False) for n in sorted(files)))
    if len(rest) == 1 and rest[0] in files:
        return files[rest[0]]
    raise TensorNotFound(f"{where}/{'/'.join(rest)}: no such file")


def _data_node(files: dict[str, VFile], rest: tuple[str, ...], job: str) -> Dir | File:
    path = "/".join(rest)
    if path in files:
        return files[path]
    prefix = path + "/" if path else ""
    seen: dict[str, bool] = {}
    for name in files:
        if name.startswith(prefix):
            head, sep, _ = name[len(prefix):].partition("/")
            seen[head] = seen.get(head, False) or bool(sep)
    if not seen:
        raise TensorNotFound(f"/{job}/data/{path}: no such file")
    return Dir(tuple(sorted(seen.items())))
