"""The folders of the mount that take the frameworks' own saves:
``/<job>/dcp/step-<N>/`` (``dcp.save``, :mod:`ptcfs.fuse.dcpwrite`) and
``/<job>/hf-save/`` (``save_pretrained``, :mod:`ptcfs.fuse.hfwrite`).

:class:`~ptcfs.fuse.fs.PtcFS` hands every operation on a path in these
areas here (:meth:`SaveFolders.takes`): which save a path belongs to, and
the caller's checks (only the job's owner, or root, writes; EACCES for
what cannot be done there). Errors are raised, as everywhere below the
FUSE boundary; ``fs.py`` turns them into errno.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from ptcfs.fuse.dcpdir import parse_step, steps
from ptcfs.fuse.dcpwrite import DcpSaves
from ptcfs.fuse.hfdir import HF_SAVE
from ptcfs.fuse.hfwrite import HfSaves
from ptcfs.fuse.paths import parse_path
from ptcfs.fuse.spool import SpoolFile

__all__ = ["SaveFolders", "DropStep", "refused"]

#: ``drop(job, step)``: delete the job's versions of that step (a step folder removed)
DropStep = Callable[[str, int], None]
#: ``check(job, path)``: EACCES unless the caller may write ``job``
CheckWriter = Callable[[str, str], None]
_AREAS = ("dcp", HF_SAVE)


def refused(path: str, why: str) -> PermissionError:
    return PermissionError(errno.EACCES, f"{path}: {why}")


class SaveFolders:
    """The ``dcp/`` and ``hf-save/`` saves of one mount (module docstring)."""

    def __init__(self, catalog: Any, read: Callable[[Any], bytes], check_writer: CheckWriter,
                 dcp: DcpSaves | None = None, drop_step: DropStep | None = None,
                 hf: HfSaves | None = None):
        self.catalog = catalog
        self.check_writer = check_writer
        self.dcp = dcp
        self.drop_step = drop_step
        self.hf = hf
        if dcp is not None:  # the tree lists the saves being written
            catalog.writing = dcp.listing
            catalog.refused = dcp.refusal
        if hf is not None:
            catalog.hf_writing = hf.listing
            catalog.hf_refused = hf.refusal
            hf.bind(lambda job: catalog.view(job, None), read)

    @staticmethod
    def takes(path: str) -> bool:
        """Whether ``path`` lies in a save folder (its operations go here)."""
        return parse_path(path).area in _AREAS

    def session(self, path: str) -> SpoolFile | None:
        """A file of a save being written (closed or not), else None."""
        ref = parse_path(path)
        if ref.area == HF_SAVE and self.hf is not None and len(ref.rest) == 1:
            return self.hf.file(ref.job, ref.rest[0])
        if self.dcp is None or ref.area != "dcp" or len(ref.rest) != 2:
            return None
        return self.dcp.file(ref.job, *ref.rest)

    def open(self, path: str, uid: int, pid: int) -> SpoolFile:
        """A file of a save, opened for writing by ``uid`` (thread ``pid``)."""
        ref = parse_path(path)
        if ref.area == HF_SAVE:
            hf = self._hf(path)
            if len(ref.rest) != 1:
                raise refused(path, "the files of a save go into hf-save/ itself")
            self.catalog.resolve(parse_path(f"/{ref.job}/{HF_SAVE}"))  # a job with HF names
            return hf.create(ref.job, ref.rest[0], uid, pid)
        dcp, rest = self._dcp(path)
        if len(rest) != 2:
            raise refused(path, "files of a save go into its step-<N> folder")
        return dcp.create(ref.job, rest[0], rest[1], uid)

    def rename(self, old: str, new: str, uid: int) -> None:
        ref, new_ref = parse_path(old), parse_path(new)
        if ref.area == HF_SAVE:
            hf = self._hf(old)
            if len(ref.rest) != 1 or (new_ref.job, new_ref.area) != (ref.job, HF_SAVE) or \
                    len(new_ref.rest) != 1:
                raise refused(new, "rename within hf-save/")
            hf.rename(ref.job, ref.rest[0], new_ref.rest[0])
            return
        dcp, rest = self._dcp(old)
        if len(rest) != 2 or new_ref.job != ref.job or new_ref.rest[:1] != rest[:1] or \
                len(new_ref.rest) != 2:
            raise refused(new, "rename within the same step folder")
        dcp.rename(ref.job, rest[0], rest[1], new_ref.rest[1],
                   self.catalog.view(ref.job, None).state, uid)

    def unlink(self, path: str) -> None:
        ref = parse_path(path)
        if ref.area == HF_SAVE:
            hf = self._hf(path)
            if len(ref.rest) != 1 or not hf.unlink(ref.job, ref.rest[0]):
                raise FileNotFoundError(errno.ENOENT, path)
            return
        dcp, rest = self._dcp(path)
        if len(rest) != 2:
            raise IsADirectoryError(errno.EISDIR, path)
        if dcp.unlink(ref.job, *rest):
            return
        if parse_step(rest[0]) in steps(self.catalog.committed(ref.job)):
            return  # a committed step goes with its folder (rm -r: files, then rmdir)
        raise FileNotFoundError(errno.ENOENT, path)

    def mkdir(self, path: str, uid: int) -> None:
        ref = parse_path(path)
        if ref.area != "dcp":
            raise refused(path, "folders cannot be made here")
        dcp, rest = self._dcp(path)
        step = parse_step(rest[0])
        if len(rest) != 1 or step is None:
            raise refused(path, "only step-<N> folders are made under dcp/")
        dcp.mkdir(ref.job, rest[0], step, uid, step in steps(self.catalog.committed(ref.job)))

    def rmdir(self, path: str) -> None:
        """A ``dcp/step-<N>`` folder: a save being written is forgotten; a
        committed step's versions are deleted unless one is current or open."""
        ref = parse_path(path)
        if ref.area != "dcp":
            raise refused(path, "committed state cannot be deleted")
        dcp, rest = self._dcp(path)
        if len(rest) != 1 or dcp.rmdir(ref.job, rest[0]):
            return
        step = parse_step(rest[0])
        if step not in steps(self.catalog.committed(ref.job)) or self.drop_step is None:
            raise FileNotFoundError(errno.ENOENT, path)
        self.drop_step(ref.job, step)

    def _hf(self, path: str) -> HfSaves:
        if self.hf is None:
            raise refused(path, "this mount takes no Hugging Face saves")
        self.check_writer(parse_path(path).job, path)
        return self.hf

    def _dcp(self, path: str) -> tuple[DcpSaves, tuple[str, ...]]:
        """The mount's DCP saves and the path's parts below ``dcp/``, which
        the caller may write (EACCES otherwise)."""
        ref = parse_path(path)
        if self.dcp is None:
            raise refused(path, "this mount takes no DCP saves")
        self.check_writer(ref.job, path)
        if not ref.rest or parse_step(ref.rest[0]) is None:
            raise refused(path, "a save goes into a step-<N> folder")
        return self.dcp, ref.rest
