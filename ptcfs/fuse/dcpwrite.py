"""``dcp.save`` into ``/ptc/<job>/dcp/step-<N>/``: the job's next version at step N.

Call order, as DCP's ``FileSystemWriter`` makes it (every rank, then the
coordinator rank):

1. ``mkdir step-<N>`` (every rank; the first makes it): a folder of a save
   being written, owned by the caller. Refused for a step that is committed.
2. Each rank writes its ``__<r>_<i>.distcp`` files: spooled to the host's
   disk (unlinked at once: nothing is left behind), nothing stored yet. A
   second file of the same name (a second writer of the step) is refused.
3. The coordinator writes ``.metadata.tmp`` and renames it ``.metadata``:
   that rename is the commit. The metadata is read (:mod:`ptcfs.dcp.pickles`,
   no code runs) and checked against the job: every tensor of the job's
   spec there, of its shape and dtype, its chunks covering it and lying in
   files written whole. Only then is each sub-tensor of the job's current
   configuration cut from the chunks and put into the job's open save, and
   the save committed at step N with the save's keys and non-tensor entries
   (:class:`ptcfs.dcp.layout.Saved`). torchtitan's fused query/key/value
   moments are split into the job's ``wq``/``wk``/``wv`` moments, its
   stacked experts (and their moments) into the job's tensor of each expert
   (:func:`ptcfs.dcp.titan.split_chunks`); the moments of a tensor that the
   saved optimizer keeps no state of while it keeps state of others (a
   buffer: the MoE's load-balancing bias) are zeros, as the import makes
   them. Any refusal fails the rename (EINVAL;
   the reason in the mount's log and in the folder's ``.refused`` file) and
   changes nothing; a writer that dies before the rename leaves the job as
   it was.

Removing ``step-<N>/`` (``rm -r``, torchtitan's purge of old steps): the
files of a committed step unlink as no-ops and the folder's ``rmdir``
deletes that step's versions on every host, unless one is the current
version or open on a mount (EBUSY); a save being written is forgotten.

Writes of one step's folder go through one host's mount (the ranks of a
save on several hosts write through a mount they share).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.boxes import box_volume
from ptcfs.dcp import pickles as pk
from ptcfs.dcp.layout import Saved, job_name
from ptcfs.dcp.titan import Composite, composite_of, split_chunks
from ptcfs.dcp.zipped import read_tensor
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidRequest
from ptcfs.fuse.spool import Chunks, SpoolFile, close_maps, put_layout
from ptcfs.jobstate import JobState
from ptcfs.types import Box

__all__ = ["DcpSaves", "Commit", "METADATA", "TMP", "REFUSED"]

log = logging.getLogger("ptcfs.mount")

METADATA = ".metadata"
TMP = ".metadata.tmp"
REFUSED = ".refused"
#: bytes of non-tensor entries a save may keep with its version (in its record, compressed)
MAX_KEPT_BYTES = 4 << 20
#: ``commit(job, step, saved, uid, spec=None)``: the job's open save committed at
#: ``step`` (``spec``: the record's new spec, for a save that changes its model files)
Commit = Callable[..., None]


@dataclass
class _Folder:
    job: str
    name: str
    step: int
    uid: int
    files: dict[str, SpoolFile] = field(default_factory=dict)
    refused: str = ""


class DcpSaves:
    """The step folders being written on this mount (module docstring)."""

    def __init__(self, spool: Path, put: Any, commit: Commit | None):
        self.spool = spool
        self.put = put
        self.commit = commit
        self._lock = threading.Lock()
        self._folders: dict[tuple[str, str], _Folder] = {}

    def listing(self, job: str) -> dict[str, list[str]]:
        with self._lock:
            return {f.name: sorted([*f.files, *([REFUSED] if f.refused else [])])
                    for (j, _), f in self._folders.items() if j == job}

    def file(self, job: str, folder: str, name: str) -> SpoolFile | None:
        with self._lock:
            f = self._folders.get((job, folder))
            return f.files.get(name) if f is not None else None

    def refusal(self, job: str, folder: str) -> bytes | None:
        with self._lock:
            f = self._folders.get((job, folder))
            return (f.refused + "\n").encode() if f is not None and f.refused else None

    def mkdir(self, job: str, folder: str, step: int, uid: int, committed: bool) -> None:
        if committed:
            raise FileExistsError(errno.EEXIST, f"/{job}/dcp/{folder}: step {step} is "
                                  "committed; save to a new step")
        with self._lock:
            if (job, folder) in self._folders:
                raise FileExistsError(errno.EEXIST, f"/{job}/dcp/{folder} exists")
            self._folders[(job, folder)] = _Folder(job, folder, step, uid)

    def create(self, job: str, folder: str, name: str, uid: int) -> SpoolFile:
        with self._lock:
            f = self._folders.get((job, folder))
            if f is None:
                raise FileNotFoundError(errno.ENOENT, f"/{job}/dcp/{folder}: make the folder "
                                        "first (a new step's)")
            if uid not in (0, f.uid):
                raise PermissionError(errno.EACCES, f"/{job}/dcp/{folder}: being written by "
                                      f"uid {f.uid}")
            if name in f.files or name == METADATA:
                raise FileExistsError(errno.EEXIST, f"/{job}/dcp/{folder}/{name}: written "
                                      "already (a second writer of this step?)")
            session = SpoolFile(self.spool, f"/{job}/dcp/{folder}/{name}", uid)
            f.files[name] = session
            return session

    def unlink(self, job: str, folder: str, name: str) -> bool:
        """Drop a file of a save being written (``.refused``: forget the
        refusal, so that ``rm -r`` clears a refused folder); False when there
        is none."""
        with self._lock:
            f = self._folders.get((job, folder))
            if f is not None and name == REFUSED and f.refused:
                f.refused = ""
                return True
            session = f.files.pop(name, None) if f is not None else None
        if session is None:
            return False
        session.drop()
        return True

    def rmdir(self, job: str, folder: str) -> bool:
        """Forget a folder being written; False when there is none."""
        with self._lock:
            f = self._folders.pop((job, folder), None)
        if f is None:
            return False
        for s in f.files.values():
            s.drop()
        return True

    def rename(self, job: str, folder: str, old: str, new: str, state: JobState,
               uid: int) -> None:
        """``.metadata.tmp`` → ``.metadata``: the commit (module docstring)."""
        with self._lock:
            f = self._folders.get((job, folder))
        if f is None or old not in f.files:
            raise PermissionError(errno.EACCES, f"/{job}/dcp/{folder}/{old}: only files "
                                  "written here can be renamed")
        if new != METADATA or old != TMP:
            raise PermissionError(errno.EACCES, f"/{job}/dcp/{folder}: only {TMP} is renamed, "
                                  f"to {METADATA}")
        if uid not in (0, f.uid):
            raise PermissionError(errno.EACCES, f"/{job}/dcp/{folder}: being written by uid "
                                  f"{f.uid}")
        try:
            saved = self._store(f, state)
            if self.commit is None:
                raise InvalidRequest("this mount cannot commit saves")
            self.commit(job, f.step, saved, uid)
        except InvalidRequest as e:
            f.refused = str(e)
            log.warning("refused %s/%s: %s", job, folder, e)
            raise
        self.rmdir(job, folder)

    # --- the commit's checks and puts -----------------------------------------------
    def _store(self, f: _Folder, state: JobState) -> Saved:
        what = f"/{f.job}/dcp/{f.name}"
        meta_file = f.files[TMP]
        md = pk.load(os.pread(meta_file.fd, meta_file.size, 0), f"{what}/{METADATA}")
        items: dict[str, Any] = getattr(md, "state_dict_metadata", {})
        where = {(idx.fqn, tuple(getattr(idx, "offset", None) or ())): info
                 for idx, info in getattr(md, "storage_data", {}).items()}
        model = state.model_spec()
        specs = {s.name: s for s in model.tensors_for(state.config.pp)}
        names: dict[str, str] = {}
        composites: dict[str, Composite] = {}  # keys made of several job tensors
        kept = Saved()
        maps: dict[str, mmap.mmap] = {}
        chunks: dict[str, Chunks] = {}
        try:
            for key, item in items.items():
                name = job_name(key, set(specs)) if item.kind == "TensorStorageMetadata" \
                    else None
                comp = composite_of(key, model, f.job) if item.kind == \
                    "TensorStorageMetadata" and name is None else None
                if name is not None:
                    _fits(key, item, specs[name].dtype, specs[name].shape, name, f, what)
                    names[key] = name
                    continue
                if comp is not None:
                    stacked = comp.runs[0].index is not None
                    _fits(key, item, comp.dtype, comp.shape,
                          f"its {len(comp.runs)} experts" if stacked else "it", f, what)
                    composites[key] = comp
                    continue
                kept.blobs[key] = self._blob(f, where, key, item, what, maps)
                if item.kind == "TensorStorageMetadata":
                    kept.tensors[key] = (item.properties.state[0], tuple(item.size))
            held = set(names.values()) | {r.name for c in composites.values() for r in c.runs}
            zeros = _unstepped(items, set(specs) - held, held)
            missing = sorted(set(specs) - held - set(zeros))
            if missing:
                raise InvalidRequest(f"{what}: the save holds no {', '.join(missing[:3])}"
                                     + (f" and {len(missing) - 3} more" if len(missing) > 3
                                        else "") + f" of job {f.job!r}")
            if len(kept.packed()) > MAX_KEPT_BYTES:
                raise InvalidRequest(f"{what}: its non-tensor entries exceed "
                                     f"{MAX_KEPT_BYTES >> 20} MiB compressed")
            dtypes = {**{k: specs[n].dtype for k, n in names.items()},
                      **{k: c.dtype for k, c in composites.items()}}
            chunks.update({key: [self._chunk(f, where, key, c, dtype, what, maps)
                                 for c in items[key].chunks] for key, dtype in dtypes.items()})
            for name in zeros:
                shape = specs[name].shape
                chunks[name] = [(tuple((0, n) for n in shape),
                                 np.zeros(shape, numpy_dtype(specs[name].dtype)))]
            for key, name in names.items():
                _covered(key, chunks[key], specs[name].shape, what)
            for key, comp in composites.items():
                _covered(key, chunks[key], comp.shape, what)
                for name, parts in split_chunks(comp, chunks.pop(key)).items():
                    chunks[name] = parts  # a job tensor's name: no key of the save
            by_name = {n: k for k, n in names.items()}
            for spec in specs.values():
                put_layout(self.put, f.job, spec, state.config,
                           chunks[by_name.get(spec.name, spec.name)], f.uid)
            kept.keys.update(names)
            return kept
        finally:
            chunks.clear()  # the views of the maps go first
            close_maps(maps)

    def _file(self, f: _Folder, info: Any, what: str, maps: dict[str, mmap.mmap]
              ) -> tuple[mmap.mmap, int, int]:
        rel = str(getattr(info, "relative_path", ""))
        if getattr(info, "transform_descriptors", None):
            raise InvalidRequest(f"{what}/{rel}: stored with transforms "
                                 f"{info.transform_descriptors}; save without extensions")
        s = f.files.get(rel)
        start, length = int(info.offset), int(info.length)
        if s is None or not s.closed or start + length > s.size:
            raise InvalidRequest(f"{what}: {rel} is missing or half-written; the save is "
                                 "incomplete")
        return s.map(maps), start, length

    def _blob(self, f: _Folder, where: dict[Any, Any], key: str, item: Any, what: str,
              maps: dict[str, mmap.mmap]) -> bytes:
        if item.kind == "TensorStorageMetadata" and len(item.chunks) != 1:
            raise InvalidRequest(f"{what}: {key} is not a tensor of job {f.job!r}")
        offset = tuple(item.chunks[0].offsets) if item.kind == "TensorStorageMetadata" else ()
        info = where.get((key, offset))
        if info is None:
            raise InvalidRequest(f"{what}: the metadata says nothing of where {key} is")
        m, start, length = self._file(f, info, what, maps)
        return bytes(m[start:start + length])

    def _chunk(self, f: _Folder, where: dict[Any, Any], key: str, c: Any, dtype: str,
               what: str, maps: dict[str, mmap.mmap]) -> tuple[Box, np.ndarray]:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        info = where.get((key, offsets))
        if info is None:
            raise InvalidRequest(f"{what}: the metadata says nothing of where {key} "
                                 f"{list(offsets)} is")
        m, start, length = self._file(f, info, what, maps)
        st = read_tensor(memoryview(m)[start:start + length], f"{what} [{key}]")
        if st.dtype != dtype or st.size != sizes:
            raise InvalidRequest(f"{what}: {key} {list(offsets)} is stored as {st.dtype} "
                                 f"{list(st.size)}, not {dtype} {list(sizes)}")
        isz = numpy_dtype(dtype).itemsize
        base = np.frombuffer(m, np.uint8, count=st.nbytes, offset=start + st.start)
        end = st.offset + sum((n - 1) * s for n, s in zip(sizes, st.stride)) + 1
        if min(sizes, default=1) > 0 and end * isz > st.nbytes:
            raise InvalidRequest(f"{what}: {key} {list(offsets)} runs past its storage")
        arr = np.lib.stride_tricks.as_strided(
            base.view(numpy_dtype(dtype))[st.offset:], sizes, [s * isz for s in st.stride])
        return tuple((o, o + n) for o, n in zip(offsets, sizes)), arr


def _fits(key: str, item: Any, dtype: str, shape: tuple[int, ...], held: str, f: _Folder,
          what: str) -> None:
    """A saved tensor item is of the dtype and shape the job holds (``held``) as."""
    have = item.properties.state[0], tuple(item.size)
    if have != (dtype, tuple(shape)):
        raise InvalidRequest(f"{what}: {key} is {have[0]} {list(have[1])}; job {f.job!r} holds "
                             f"{held} as {dtype} {list(shape)}")


def _unstepped(items: dict[str, Any], absent: set[str], held: set[str]) -> list[str]:
    """The job's Adam moments of ``absent`` that are zeros: those of a tensor
    the save holds (in ``held``) whose optimizer keeps no state of it while
    it keeps state (an Adam ``step``) of others: a buffer, such as the MoE's
    load-balancing bias (the import makes them zeros too)."""
    stepped = set()
    for k in items:
        for prefix in ("optimizer.state.", "optim.state.", "state."):
            if k.startswith(prefix) and k.endswith(".step"):
                stepped.add(k[len(prefix):-len(".step")])
    if not stepped:
        return []
    return sorted(n for n in absent if n.startswith(("optim/exp_avg/", "optim/exp_avg_sq/"))
                  and (p := n.split("/", 2)[2]) in held and p not in stepped)


def _covered(key: str, chunks: Chunks, shape: tuple[int, ...],
             what: str) -> None:
    have = sum(box_volume(b) for b, _ in chunks)
    whole = 1
    for n in shape:
        whole *= n
    if have != whole:
        raise InvalidRequest(f"{what}: the chunks of {key} hold {have} of its {whole} "
                             "elements; the save is incomplete")

