"""Writing a rank's state through the mount.

A job saves by writing ``ranks/<rank>/state.safetensors`` (all of the rank's
tensors) or ``ranks/<rank>/<name>.npy`` (one) under ``/ptc/<job>/``. The
bytes are spooled to a file on the host's disk while they arrive; when the
writer closes the file, its header is checked against the tensors the rank
holds under the current configuration (names, shapes, dtypes: all of them
for a safetensors file), and only then are the sub-tensors put into the
job's open save version (:mod:`ptcfs.client.control.saving`). Nothing becomes
current until ``ptcctl commit JOB --step N``.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidRequest, PtcError
from ptcfs.fuse.formats import Declared, parse_npy_header, parse_safetensors_header
from ptcfs.fuse.paths import SAFETENSORS
from ptcfs.fuse.spool import SpoolFile
from ptcfs.types import Slice, TensorSpec

__all__ = ["WriteSession", "Put"]

log = logging.getLogger("ptcfs.mount")

#: ``put(job, tensor, part, bytes, shape, dtype, rank=, uid=)`` into the job's open
#: save version (``rank`` and ``uid``: the writer's, for the audit trail).
Put = Callable[..., None]


class WriteSession(SpoolFile):
    """One file being written: ``name`` is ``state.safetensors``, a tensor
    name (one the rank does not hold is refused at close), or None for a
    temporary file that is renamed later; ``expected`` the rank's
    sub-tensors (``TensorSpec``, ``Slice``)."""

    def __init__(self, spool: Path, job: str, rank: int, name: str | None,
                 expected: list[tuple[TensorSpec, Slice]], uid: int = -1):
        super().__init__(spool, f"/{job}/ranks/{rank}/{name}", uid)
        spool.chmod(0o700)  # the bytes of ranks' saves: the daemon's user's only
        self.job, self.rank, self.name = job, rank, name  # uid: the audit trail's writer
        self.expected = {spec.name: (spec, sl) for spec, sl in expected}
        self.error: InvalidRequest | None = None

    def finish(self, put: Put) -> None:
        """Check the file and put its tensors (once; again after more writes).
        A bad file raises InvalidRequest (EINVAL for the writer's close)."""
        with self.lock:
            if self.name is None:  # a temporary file: checked once renamed
                return
            if self.closed:  # checked since its last write
                if self.error is not None:
                    raise self.error
                return
            self.closed = True
            try:
                self._store(put)
                self.error = None
            except InvalidRequest as e:
                log.warning("refused %s: %s", self.what, e)
                self.error = e
                raise

    def rename(self, name: str) -> None:
        """The file gets its final name (``state.safetensors`` or a tensor's)."""
        with self.lock:
            self.name, self.what = name, f"/{self.job}/ranks/{self.rank}/{name}"
            self.closed = False

    def close(self) -> None:
        self.drop()

    def _store(self, put: Put) -> None:
        if self.size == 0:
            raise InvalidRequest(f"{self.what}: the file is empty")
        failed: BaseException | None = None
        with mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) as m:
            data = memoryview(m)
            try:
                declared = self._declared(data)
                for d in declared:
                    spec, sl = self.expected[d.name]
                    put(self.job, spec.name, sl.key(), data[d.start:d.stop], d.shape, d.dtype,
                        rank=self.rank, uid=self.uid)
            except BaseException as e:
                if not isinstance(e, PtcError | OSError):
                    log.exception("storing %s failed", self.what)
                # its traceback's frames (and those of the errors it was raised
                # from) hold views of the map, which could then not be closed
                # (BufferError, hiding the error: EIO instead of its errno)
                failed = _without_frames(e)
            finally:
                data.release()
        if failed is not None:
            raise failed

    def _declared(self, data: memoryview) -> list[Declared]:
        head = bytes(data[:1 << 20])
        if self.name == SAFETENSORS:
            found, _ = parse_safetensors_header(head, self.what)
            names = {d.name for d in found}
            missing = sorted(set(self.expected) - names)
            extra = sorted(names - set(self.expected))
            if missing or extra:
                raise InvalidRequest(
                    f"{self.what}: the tensors do not match rank {self.rank}'s: "
                    + (f"missing {_few(missing)}" if missing else "")
                    + ("; " if missing and extra else "")
                    + (f"not held by this rank {_few(extra)}" if extra else ""))
        else:
            assert self.name is not None  # finish() skips unnamed files
            if self.name not in self.expected:
                raise InvalidRequest(f"{self.what}: rank {self.rank} holds no tensor "
                                     f"{self.name!r}; write state.safetensors or the .npy of "
                                     "one of its tensors")
            descr, shape, start = parse_npy_header(head, self.what)
            spec = self.expected[self.name][0]
            want = numpy_dtype(spec.dtype)
            if np.dtype(descr) != want:
                raise InvalidRequest(f"{self.what}: dtype {np.dtype(descr)} does not match the "
                                     f"tensor's {spec.dtype} ({want})")
            found = [Declared(self.name, spec.dtype, shape, start,
                              start + want.itemsize * int(np.prod(shape)))]
        for d in found:
            spec, sl = self.expected[d.name]
            local = sl.local_shape(spec.shape)
            if d.dtype != spec.dtype:
                raise InvalidRequest(f"{self.what}: {d.name} is {d.dtype}; rank {self.rank} "
                                     f"holds it as {spec.dtype}")
            if tuple(d.shape) != tuple(local):
                raise InvalidRequest(f"{self.what}: {d.name} has shape {list(d.shape)}; rank "
                                     f"{self.rank} holds {list(local)}")
            if d.stop > self.size or d.stop - d.start != numpy_dtype(spec.dtype).itemsize * \
                    int(np.prod(local)):
                raise InvalidRequest(f"{self.what}: {d.name}'s bytes are cut short or mis-sized "
                                     f"({d.stop - d.start} bytes; the file has {self.size})")
        return found


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _without_frames(e: BaseException) -> BaseException:
    """``e`` with no traceback along its chains of causes and contexts."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        link = todo.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        todo += [link.__cause__, link.__context__]
    return e
