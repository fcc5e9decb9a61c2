"""``save_pretrained`` into ``/ptc/<job>/hf-save/``: the job's next version.

Every job with Hugging Face names (one that has ``hf/``) has the folder
``hf-save/``. Call order, as transformers' ``save_pretrained`` makes it
(one process, the main one):

1. ``makedirs hf-save`` (it is there).
2. ``config.json``, then ``generation_config.json`` for a model that
   generates. The first file opens the save, owned by the writing process
   and its uid: a file created by another process while that one lives is
   refused (EBUSY: a second writer); a save whose writer is gone (it died
   half-way) is dropped then, and the job is as it was. The same process
   creating a file of its save again starts over.
3. It lists the folder and removes stale ``model-*-of-*`` files: only this
   save's files are listed, and removing one drops it.
4. The weights, with safetensors' ``save_file``: ``model.safetensors``, or
   shards ``model-0000K-of-0000N.safetensors``, each written to a temporary
   ``.tmp*`` file that is renamed to its name (a name that starts with a dot
   is a temporary file, which counts once renamed). Each file's header is
   checked against the job as soon as it has arrived, or is renamed (the
   job's parameter names, their shapes and dtypes, or a narrower dtype
   where the job's values fit it, :func:`~ptcfs.fuse.hfcommit.fits`; an
   unsharded file names them all): a mismatch fails that write or rename
   (EINVAL) and drops the save.
5. A sharded save ends with ``model.safetensors.index.json``.

The commit: at the close (flush) or the rename of the file that completes
the save (a file renamed is written whole), ``model.safetensors`` written
whole when no index is being written, or the index once every shard it
names is written whole. The error of a refused commit reaches the writer
through that rename or close. The files together must
hold each of the job's parameters once (``save_pretrained`` leaves tied
aliases out, as the job's spec does), as the index says, and a
``config.json`` must describe them. Then each sub-tensor of the job's
current configuration is cut from the files and put into the job's open
save, and the save is committed at the job's current step (a
``save_pretrained`` says no step, and the data position stays where it
is): ``config.json`` and ``generation_config.json`` as written replace the
job's (``hf/`` serves them), its other recorded files stay.

Optimizer state (the rule for moments): every optimizer tensor of the job
(``optim/exp_avg/...``, ``optim/exp_avg_sq/...``) and every non-tensor
entry a ``dcp.save`` kept stay as they are in the current version. An fp32
master (``optim/master/<name>``) of an fp16/bf16 parameter follows the
save: where an element of the saved parameter equals the current one, bit
for bit, its master stays (its low bits are not lost); where it changed,
its master is the saved value, widened exactly.

A refusal is one line (EINVAL at the close or the write; the reason in the
mount's log and in ``hf-save/.refused`` until the next save starts), drops
the save and changes nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidRequest, PtcError
from ptcfs.fuse.formats import Declared, parse_safetensors_header
from ptcfs.fuse.hfcommit import (
    Read,
    all_there,
    as_job_holds,
    check,
    describes,
    fits,
    param_specs,
    put_save,
)
from ptcfs.fuse.hfdir import HF_SAVE
from ptcfs.fuse.spool import SpoolFile, close_maps
from ptcfs.model.hfmodels import hf_files, with_hf_files
from ptcfs.model.specfile import encode_spec
from ptcfs.types import ModelSpec

__all__ = ["HF_SAVE", "HfSaves", "HfFile", "INDEX", "REFUSED"]

log = logging.getLogger("ptcfs.mount")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
REFUSED = ".refused"
TEXTS = ("config.json", "generation_config.json")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _is_weights(name: str) -> bool:
    return name == SINGLE or _SHARD.fullmatch(name) is not None


class HfFile(SpoolFile):
    """A file of a save: the header of a weights file is checked once it
    has arrived; the close (flush) may complete the save."""

    name: str

    def __init__(self, saves: HfSaves, spool: Path, job: str, name: str, uid: int):
        super().__init__(spool, f"/{job}/{HF_SAVE}/{name}", uid)
        self.saves, self.job = saves, job
        self.declared: list[Declared] | None = None  # its header, once checked

    def write(self, data: bytes, offset: int) -> int:
        n = super().write(data, offset)
        if self.declared is None and _is_weights(self.name):
            self.saves.arrived(self)
        return n

    def header(self) -> list[Declared] | None:
        """The declared tensors, once the whole header is here (else None)."""
        with self.lock:
            if self.fd < 0 or self.size < 8:
                return None
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if self.size < 8 + n:
                return None
            return parse_safetensors_header(os.pread(self.fd, 8 + n, 0), self.what)[0]

    def finish(self, put: Any) -> None:
        if not self.closed:
            self.closed = True
            self.saves.closed(self)

    def rename(self, name: str) -> None:
        self.name, self.what = name, f"/{self.job}/{HF_SAVE}/{name}"


@dataclass
class _Save:
    job: str
    owner: int  # the writing process
    uid: int
    files: dict[str, HfFile] = field(default_factory=dict)


#: ``view(job)``: the job's current version as files (:class:`~ptcfs.fuse.tree.JobView`)
View = Callable[[str], Any]


class HfSaves:
    """The saves being written into ``hf-save/`` on this mount (module docstring)."""

    def __init__(self, spool: Path, put: Any, commit: Callable[..., None] | None):
        self.spool = spool
        self.put = put
        self.commit = commit
        self.view: View | None = None
        self.read: Read | None = None
        self._lock = threading.Lock()
        self._saves: dict[str, _Save] = {}
        self._refused: dict[str, str] = {}
        self._committing = threading.Lock()  # one check-and-commit at a time

    def bind(self, view: View, read: Read) -> None:
        """How the commit sees the job's current version (the mount's)."""
        self.view, self.read = view, read

    # --- the folder ------------------------------------------------------------------
    def listing(self, job: str) -> list[str]:
        with self._lock:
            s = self._saves.get(job)
            return sorted([*(s.files if s else ()), *([REFUSED] if job in self._refused
                                                       else [])])

    def file(self, job: str, name: str) -> HfFile | None:
        with self._lock:
            s = self._saves.get(job)
            return s.files.get(name) if s is not None else None

    def refusal(self, job: str) -> bytes | None:
        with self._lock:
            why = self._refused.get(job)
        return (why + "\n").encode() if why else None

    def create(self, job: str, name: str, uid: int, pid: int) -> HfFile:
        where = f"/{job}/{HF_SAVE}/{name}"
        if not name.startswith(".") or name == REFUSED:
            _allowed(where, name)
        owner = _process(pid)
        dropped: list[HfFile] = []
        with self._lock:
            s = self._saves.get(job)
            if s is not None and s.owner != owner and _alive(s.owner):
                raise OSError(errno.EBUSY, f"{where}: a save by process {s.owner} (uid "
                              f"{s.uid}) is being written; one writer at a time")
            if s is not None and (s.owner != owner or name in s.files):
                log.info("%s: dropped the unfinished save of process %s", where, s.owner)
                dropped, s = list(s.files.values()), None
            if s is None:
                s = self._saves[job] = _Save(job, owner, uid)
                self._refused.pop(job, None)
            f = s.files[name] = HfFile(self, self.spool, job, name, uid)
        for d in dropped:
            d.drop()
        return f

    def unlink(self, job: str, name: str) -> bool:
        """Drop a file of the save being written (``.refused``: forget the
        refusal); False when there is none."""
        with self._lock:
            if name == REFUSED and job in self._refused:
                del self._refused[job]
                return True
            s = self._saves.get(job)
            f = s.files.pop(name, None) if s is not None else None
        if f is None:
            return False
        f.drop()
        return True

    def rename(self, job: str, old: str, new: str) -> None:
        """A temporary file of the save gets its name: written whole."""
        where = f"/{job}/{HF_SAVE}/{new}"
        _allowed(where, new)
        with self._lock:
            s = self._saves.get(job)
            f = s.files.get(old) if s is not None else None
            if s is None or f is None:
                raise PermissionError(errno.EACCES, f"{where}: only files of the save being "
                                      "written can be renamed")
            replaced = s.files.pop(new, None)
            del s.files[old]
            f.rename(new)
            s.files[new] = f
        if replaced is not None:
            replaced.drop()
        if f.declared is None and _is_weights(new):
            self.arrived(f)
        f.finish(self.put)

    def _drop(self, job: str, why: str | None = None) -> None:
        with self._lock:
            s = self._saves.pop(job, None)
            if why is not None:
                self._refused[job] = why
        for f in s.files.values() if s is not None else ():
            f.drop()

    def _refuse(self, job: str, e: PtcError) -> None:
        log.warning("refused %s/%s: %s", job, HF_SAVE, e)
        self._drop(job, str(e))

    # --- the checks and the commit -----------------------------------------------------
    def arrived(self, f: HfFile) -> None:
        """A weights file's header, checked as soon as it is here."""
        try:
            declared = f.header()
            if declared is None:
                return
            params = param_specs(self._model(f.job))
            for d in declared:
                check(f.what, d, params)
                if d.dtype != params[d.name].dtype and self.view is not None and \
                        self.read is not None:  # refused now, not once all is written
                    fits(f.what, d, params[d.name],
                         partial(_current, self.view(f.job), params[d.name], self.read))
            names = {d.name for d in declared}
            if f.name == SINGLE:
                all_there(f.what, params, names, f.job)
            f.declared = declared
        except InvalidRequest as e:
            self._refuse(f.job, e)
            raise

    def closed(self, f: HfFile) -> None:
        """A file of the save is closed: commit if that completed it."""
        with self._committing:
            with self._lock:
                s = self._saves.get(f.job)
                if s is None or s.files.get(f.name) is not f:
                    return
                files = dict(s.files)
            try:
                weights = _complete(f.job, files)
                if weights is None:
                    return
                self._commit(s, files, weights)
            except PtcError as e:  # refused, or the commit failed (the cluster says why)
                self._refuse(f.job, e)
                raise
            self._drop(f.job)

    def _model(self, job: str) -> ModelSpec:
        if self.view is None:
            raise InvalidRequest(f"/{job}/{HF_SAVE}: this mount cannot take saves")
        return self.view(job).model  # type: ignore[no-any-return]

    def _commit(self, s: _Save, files: dict[str, HfFile], weights: list[HfFile]) -> None:
        what = f"/{s.job}/{HF_SAVE}"
        if self.view is None or self.read is None or self.commit is None:
            raise InvalidRequest(f"{what}: this mount cannot commit saves")
        read = self.read
        jv = self.view(s.job)
        model: ModelSpec = jv.model
        params = param_specs(model)
        texts = {n: _text(files[n], f"{what}/{n}") for n in TEXTS if n in files}
        if "config.json" in texts:
            describes(f"{what}/config.json", texts["config.json"], params,
                      hf_files(model).get("config.json"))
        maps: dict[str, mmap.mmap] = {}
        arrays: dict[str, np.ndarray] = {}
        try:
            for w in weights:
                m = w.map(maps)
                for d in w.header() or ():
                    check(w.what, d, params)
                    if d.name in arrays:
                        raise InvalidRequest(f"{what}: {d.name} is in more than one file")
                    if d.stop > w.size:
                        raise InvalidRequest(f"{w.what}: {d.name}'s bytes are cut short; the "
                                             "save is incomplete")
                    spec = params[d.name]
                    saved = np.frombuffer(m, numpy_dtype(d.dtype), offset=d.start,
                                          count=int(np.prod(spec.shape))).reshape(spec.shape)
                    arrays[d.name] = as_job_holds(w.what, d, saved, spec,
                                                  partial(_current, jv, spec, read))
            all_there(what, params, set(arrays), s.job)
            index = files.get(INDEX)
            if index is not None:
                where = {d.name: w.name for w in weights for d in w.header() or ()}
                for name, file in _index(index).items():
                    if where.get(name, file) != file:
                        raise InvalidRequest(f"{what}/{INDEX}: puts {name} in {file}; it is "
                                             f"in {where[name]}")
            put_save(self.put, read, s.job, s.uid, jv, arrays)
        finally:
            arrays.clear()  # the views of the maps go first
            close_maps(maps)
        record = encode_spec(with_hf_files(model, {**hf_files(model), **texts}))
        self.commit(s.job, jv.state.step, None, s.uid, spec=record)


def _current(jv: Any, spec: Any, read: Read) -> np.ndarray:
    """The job's current values of parameter ``spec``, whole."""
    return np.frombuffer(read(jv.whole(spec, b"")), numpy_dtype(spec.dtype)).reshape(spec.shape)


def _allowed(where: str, name: str) -> None:
    if name not in (*TEXTS, INDEX) and not _is_weights(name):
        raise PermissionError(errno.EACCES, f"{where}: only save_pretrained's model files go "
                              "here (config.json, generation_config.json, model*.safetensors "
                              "and the index); save others elsewhere")


def _complete(job: str, files: dict[str, HfFile]) -> list[HfFile] | None:
    """The weights files of a complete save, else None (more is to come)."""
    index = files.get(INDEX)
    if index is not None:
        if not index.closed:
            return None
        names = sorted(set(_index(index).values()))
        bad = [n for n in names if not _is_weights(n)]
        if bad:
            raise InvalidRequest(f"/{job}/{HF_SAVE}/{INDEX}: names {bad[0]}, not a weights "
                                 "file")
        if not all(n in files and files[n].closed and _whole(files[n]) for n in names):
            return None
        return [files[n] for n in names]
    single = files.get(SINGLE)
    if single is None or not single.closed or not _whole(single):
        return None
    return [single]


def _whole(f: HfFile) -> bool:
    """Every byte its header declares is here."""
    declared = f.header()
    return declared is not None and all(d.stop <= f.size for d in declared)


def _index(f: HfFile) -> dict[str, str]:
    doc = json.loads(_text(f, f.what))
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise InvalidRequest(f"{f.what}: has no weight_map of tensor → file")
    return {str(k): v for k, v in wm.items()}


def _text(f: HfFile, what: str) -> str:
    with f.lock:
        data = os.pread(f.fd, f.size, 0) if f.fd >= 0 else b""
    try:
        text = data.decode()
        json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"{what}: not a JSON file ({e})") from None
    return text


def _process(pid: int) -> int:
    """The process (thread group) of the thread ``pid`` FUSE names."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie wrote its last
    except OSError:
        return False
