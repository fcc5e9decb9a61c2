"""The ``/ptc`` filesystem: FUSE operations over the catalog, the read server
and write sessions.

Errors become errno here and only here (:func:`_errno`): every ptcfs error
subclasses a builtin and :func:`ptcfs.errors.to_errno` maps it; anything
unexpected is logged with its traceback and reported as EIO, so nothing a
user does through the mount stops it.

Caching: every file lives under a committed version (``versions/<v>/``,
``.data/<d>/``) and never changes, so the kernel keeps its pages from open
to open (page-cache speed on repeated reads). The files of each job's
current version that are all on this host are read into the page cache
in the background as soon as the version is committed
(:mod:`ptcfs.fuse.warming`). Filling the page cache is slow where fresh
memory is slow to touch (VMs that hand freed memory back to their host),
so a big file that is not cached yet is read with ``direct_io`` (straight
into the reader's buffer), and when that reader closes, it is queued to
be read into the cache, and the next opens read through the cache
(``PTC_MOUNT_WARM_MIN_BYTES``); so does an open of a file that is open
already, which is how a file is mapped (``np.load(..., mmap_mode=)``
opens it again while it holds it), since the kernel maps no direct_io
file. The background reader runs only while no other
process has a file open through the mount: it is paused (SIGSTOP) at the
first such open and resumed when the last one closes, so that it never
slows a reader down. The current version is reached through links
(``tensors -> versions/<v>/tensors``) that are re-read at every lookup
(``entry_timeout=0``): an open after a commit gets the new version's file,
and a reader that opened the old one keeps reading the old one, whole,
never a mix.

Splicing: reads are answered by :meth:`PtcFS.read_buf`. Where a read's
bytes are all in this host's store (and a few header bytes), the answer
names ranges of the store's data file and libfuse splices them to the
kernel: one copy, by the kernel, instead of two through this process. The
mount's ``max_read`` is lowered just enough for a reply to fit the pipe
libfuse may grow (:func:`~ptcfs.fuse.bufvec.splice_max_read`); otherwise
libfuse would copy every read of the kernel's largest size anyway.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import mfusepy

from ptcfs import settings
from ptcfs.data.names import store_job
from ptcfs.errors import InvalidRequest, PtcError, to_errno
from ptcfs.fuse.bufvec import FUSE_CAP_SPLICE_WRITE, bufvec, splice_max_read
from ptcfs.fuse.dcpwrite import DcpSaves
from ptcfs.fuse.hfwrite import HfSaves
from ptcfs.fuse.paths import NPY, SAFETENSORS, Ref, parse_path
from ptcfs.fuse.pinning import OpenVersions, Pin
from ptcfs.fuse.reading import FileRange, ReadServer
from ptcfs.fuse.savefolders import DropStep, SaveFolders, refused
from ptcfs.fuse.spool import SpoolFile
from ptcfs.fuse.tree import Catalog, Dir, File, Link, Node
from ptcfs.fuse.warming import Warmer
from ptcfs.fuse.writing import Put, WriteSession
from ptcfs.jobstate import DEFAULT_MODE

__all__ = ["PtcFS", "PtcFuse", "FUSE_CAP_AUTO_INVAL_DATA"]

log = logging.getLogger("ptcfs.mount")

FUSE_CAP_AUTO_INVAL_DATA = 1 << 12
F = TypeVar("F", bound=Callable[..., Any])


class PtcFuse(mfusepy.FUSE):
    """mfusepy's FUSE, but a NULL path reaches ``read_buf`` as None: libfuse
    sends one for a file replaced while open (``hard_remove``), and mfusepy
    would fail decoding it."""

    def read_buf(self, path: bytes | None, bufpp: Any, size: int, offset: int,
                 fip: Any) -> int:
        if path is not None:
            return int(super().read_buf(path, bufpp, size, offset, fip))
        fh = fip.contents if self.raw_fi else fip.contents.fh
        return int(self.operations.read_buf(None, bufpp, size, offset, fh))


def _errno(fn: F) -> F:
    """The one place where errors become errno."""

    @functools.wraps(fn)
    def wrap(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except mfusepy.FuseOSError:
            raise
        except (PtcError, OSError) as e:
            code = to_errno(e)
            if code not in (errno.ENOENT,):
                log.info("%s%s: %s", fn.__name__, args[1:2], e)
            raise mfusepy.FuseOSError(code) from e
        except Exception as e:
            log.exception("%s%s failed", fn.__name__, args[1:2])
            raise mfusepy.FuseOSError(errno.EIO) from e

    return wrap  # type: ignore[return-value]


class _Handle:
    """An open file: pinned to the node it named at open, or a write session."""

    def __init__(self, node: Node | None = None, session: WriteSession | SpoolFile | None = None,
                 direct: bool = False, version: tuple[str, int] | None = None,
                 path: str | None = None):
        self.node = node
        self.path = path  # a file this mount's readers (not its background one) have open
        self.session = session
        self.direct = direct
        self.version = version  # (store job, version) it reads, kept while it is open
        self.foreground = False  # opened by anyone but this mount's background reader


class PtcFS(mfusepy.Operations):
    """FUSE operations (mfusepy, ``raw_fi=True``)."""

    use_ns = True

    def __init__(self, catalog: Catalog, server: ReadServer, put: Put, spool: Path,
                 on_ready: Callable[[], None] | None = None, warmer: Warmer | None = None,
                 pin: Pin | None = None, dcp: DcpSaves | None = None,
                 drop_step: DropStep | None = None, hf: HfSaves | None = None):
        self.catalog = catalog
        #: saves being written into ``/<job>/dcp/step-<N>/`` and ``/<job>/hf-save/``
        self.saves = SaveFolders(catalog, lambda f: server.read_bytes(f, 0, f.size),
                                 self._check_writer, dcp, drop_step, hf)
        #: what the daemon must keep for this mount's open files
        self.open_versions = OpenVersions(pin) if pin is not None else None
        self.server = server
        #: what the mount did (opens, reads), shared with the read server's lookups
        self.tally = server.tally
        self.put = put
        self.spool = spool
        self.on_ready = on_ready
        self.started = time.time_ns()
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._next = 1
        self._writing: dict[str, WriteSession | SpoolFile] = {}
        self._reading: dict[str, int] = {}  # path → readers' open handles (not the warmer's)
        self.warmer = warmer
        #: files at least this big are read with direct_io until they are in the
        #: page cache, and read into it in the background (module docstring)
        self.warm_min_bytes = int(settings.get("PTC_MOUNT_WARM_MIN_BYTES"))
        #: reads of bytes held in this host's store are spliced from its data file
        #: (``PTC_MOUNT_SPLICE=0`` copies them through this process instead)
        self.splice = bool(settings.get("PTC_MOUNT_SPLICE"))
        #: the mount's largest read (its ``max_read`` option) where the kernel's
        #: own would be too big to splice, else None
        self.max_read = splice_max_read() if self.splice else None

    # --- set-up -----------------------------------------------------------------
    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is not None:
            config.attr_timeout = 0.0
            config.entry_timeout = 0.0
            config.negative_timeout = 0.0
            config.kernel_cache = 0
            config.auto_cache = 0
            # a file replaced while open (a saver renaming its temporary file over
            # state.safetensors while a reader or cache filler has it open) is
            # replaced at once: open handles keep the version they opened, so
            # libfuse need not hide the old name as .fuse_hiddenXXX
            config.hard_remove = 1
        if conn is not None:
            conn.want &= ~FUSE_CAP_AUTO_INVAL_DATA
            if self.splice and conn.capable & FUSE_CAP_SPLICE_WRITE:
                conn.want |= FUSE_CAP_SPLICE_WRITE
            if self.max_read is not None:  # the same as the mount option, or libfuse refuses
                conn.max_read = self.max_read
        if self.on_ready is not None:
            threading.Thread(target=self.on_ready, name="mount-ready", daemon=True).start()

    # --- metadata ---------------------------------------------------------------
    def _node(self, path: str) -> Node:
        return self.catalog.resolve(parse_path(path))

    @_errno
    def getattr(self, path: str | None, fh: Any = None) -> dict[str, Any]:
        if path is None:  # a file replaced while open (hard_remove): ask its handle
            h = self._get(fh.fh) if fh is not None else None
            session, node = (h.session, h.node) if h is not None else (None, None)
            if session is None and node is None:
                raise FileNotFoundError(errno.ENOENT, "a removed file")
        else:
            # a file being written shows its size only through its handle (when
            # the kernel passes it) and where nothing committed has its name:
            # readers see the committed file whole until the save is committed
            h = self._handles.get(fh.fh) if fh is not None else None
            session = h.session if h is not None else None
            node = None
            if session is None:
                try:
                    node = self._node(path)
                except FileNotFoundError:
                    with self._lock:
                        session = self._writing.get(path)
                    if session is None:
                        session = self.saves.session(path)
                    if session is None:
                        raise
        uid, gid, bits = self._access(path if path is not None else
                                      (session.what if session is not None else "/"))
        if session is not None:
            return self._attrs(stat.S_IFREG | _mode(bits, False, True), session.size,
                               self.started, uid, gid)
        assert node is not None
        mtime = int(node.mtime * 1e9) if node.mtime else self.started
        if isinstance(node.item, Link):
            return self._attrs(stat.S_IFLNK | 0o777, len(node.item.target), mtime, uid, gid)
        if isinstance(node.item, Dir):
            return self._attrs(stat.S_IFDIR | _mode(bits, True, node.writable), 0, mtime,
                               uid, gid, nlink=2)
        return self._attrs(stat.S_IFREG | _mode(bits, False, node.writable),
                           node.item.size, mtime, uid, gid)

    def _open_save(self, path: str, fi: Any) -> int:
        """A file of a save into ``dcp/step-<N>/`` or ``hf-save/``."""
        uid, _, pid = mfusepy.fuse_get_context()
        session = self.saves.open(path, uid, pid)
        with self._lock:
            self._writing[path] = session
        fi.direct_io = 1
        fi.fh = self._add(_Handle(session=session))
        return 0

    def _access(self, path: str) -> tuple[int, int, int]:
        """``(uid, gid, mode)`` of the job ``path`` is under: its record's
        owner and mode; the mount's user and 0755 for the root folder."""
        job = path.strip("/").split("/", 1)[0]
        if not job:
            return os.getuid(), os.getgid(), 0o755
        return self.catalog.access(job) or (os.getuid(), os.getgid(), DEFAULT_MODE)

    def _check_writer(self, job: str, path: str) -> None:
        """EACCES unless the caller owns ``job`` or is root: only they write
        its ranks' state (the kernel checks the modes too: ``default_permissions``)."""
        uid = mfusepy.fuse_get_context()[0]
        owner = self._access(job)[0]
        if uid not in (0, owner):
            raise PermissionError(errno.EACCES, f"{path}: uid {uid} does not own job {job!r} "
                                  f"(uid {owner} does)")

    def _attrs(self, mode: int, size: int, mtime_ns: int, uid: int, gid: int,
               nlink: int = 1) -> dict[str, Any]:
        return {"st_mode": mode, "st_nlink": nlink, "st_size": size, "st_uid": uid,
                "st_gid": gid, "st_mtime": mtime_ns, "st_ctime": mtime_ns,
                "st_atime": mtime_ns, "st_blksize": 1 << 20,
                "st_blocks": -(-size // 512)}

    @_errno
    def readlink(self, path: str) -> str:
        node = self._node(path)
        if not isinstance(node.item, Link):
            raise OSError(errno.EINVAL, f"{path} is not a link")
        return node.item.target

    @_errno
    def readdir(self, path: str, fh: Any) -> list[str]:
        node = self._node(path)
        if not isinstance(node.item, Dir):
            raise NotADirectoryError(errno.ENOTDIR, path)
        return [".", "..", *(name for name, _ in node.item.entries)]

    @_errno
    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 1 << 20, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0,
                "f_bavail": 0, "f_files": 0, "f_ffree": 0, "f_namemax": 255}

    # --- reading ----------------------------------------------------------------
    @_errno
    def open(self, path: str, fi: Any) -> int:
        if fi.flags & (os.O_WRONLY | os.O_RDWR) and self.saves.takes(path):
            return self._open_save(path, fi)
        if fi.flags & (os.O_WRONLY | os.O_RDWR):
            return self._open_write(path, fi, truncate=bool(fi.flags & os.O_TRUNC))
        node = self._node(path)
        if isinstance(node.item, Dir):
            raise IsADirectoryError(errno.EISDIR, path)
        if isinstance(node.item, Link):  # the kernel follows links itself
            raise OSError(errno.ELOOP, path)
        w = self.warmer
        ours = w is not None and w.is_warmer(mfusepy.fuse_get_context()[2])
        with self._lock:
            again = self._reading.get(path, 0) > 0
            if not ours:
                self._reading[path] = self._reading.get(path, 0) + 1
        # a file opened again while it is open is about to be mapped (np.load
        # does that), and the kernel maps no direct_io file (ENODEV)
        direct = (w is not None and not ours and node.item.size >= self.warm_min_bytes
                  and not again and not w.use_cache(path))
        fi.keep_cache = 1  # immutable: see the module docstring
        fi.direct_io = int(direct)
        if not ours:
            self.tally.add("opens_direct" if direct else "opens_cache")
        version = None
        if node.version and not ours:  # the background reader lets versions go
            ref = parse_path(path)
            version = (store_job(ref.job) if ref.area in ("data", ".data") else ref.job,
                       node.version)
            if self.open_versions is not None:
                self.open_versions.opened(version)
        fi.fh = self._add(_Handle(node=node, direct=direct, version=version,
                                  path=None if ours else path), foreground=not ours)
        return 0

    def stop(self) -> None:
        """Stop the background reader and the pins' batches (when the mount goes away)."""
        if self.warmer is not None:
            self.warmer.stop()
        if self.open_versions is not None:
            self.open_versions.stop()

    @_errno
    def read(self, path: str | None, size: int, offset: int, fi: Any) -> Any:
        h = self._get(fi.fh)
        if h.session is not None:
            return os.pread(h.session.fd, size, offset)
        assert h.node is not None  # a read handle always has its node
        item: File = h.node.item  # type: ignore[assignment]
        out = self.server.read(item, offset, size)
        self.tally.add("reads_copy")
        self.tally.add("read_bytes_copy", len(out))  # bytes, a Span or a ctypes array
        return out

    @_errno
    def read_buf(self, path: str | None, bufpp: Any, size: int, offset: int, fi: Any) -> int:
        """Like :meth:`read`, answered with a ``fuse_bufvec``: bytes that lie
        in the store's data file on this host are named by file range, and
        libfuse splices them to the reader without a copy in this process."""
        h = self._get(fi.fh)
        pieces = None
        if h.session is None and h.node is not None and self.splice:
            pieces = self.server.pieces(h.node.item, offset, size)  # type: ignore[arg-type]
            if pieces is not None:
                self.tally.add("reads_splice")
                self.tally.add("read_bytes_splice",
                               sum(p.size if isinstance(p, FileRange) else len(p)
                                   for p in pieces))
        if pieces is None:
            pieces = [self.read(path, size, offset, fi)]
        bufpp[0] = ctypes.cast(bufvec(pieces), type(bufpp[0]))
        return 0

    # --- writing ----------------------------------------------------------------
    def _rank_target(self, path: str, scratch_ok: bool = False
                     ) -> tuple[Ref, str | None, list[Any]]:
        ref = parse_path(path)
        self._check_writer(ref.job, path)
        current = max(self.catalog.committed(ref.job) or [0])
        if ref.area != "ranks" or ref.rank is None or not ref.rest or \
                ref.version not in (None, current):
            raise PermissionError(errno.EACCES, f"{path}: only the current version's "
                                  "ranks/<rank>/ files can be written")
        if ref.index is not None:
            raise InvalidRequest(f"{path}: write the whole tensor, not a slice of it")
        jv = self.catalog.view(ref.job, None)
        expected = jv.ranks[ref.rank] if ref.rank < jv.state.config.world else None
        if expected is None:
            raise FileNotFoundError(errno.ENOENT, f"{path}: no rank {ref.rank}")
        rel = "/".join(ref.rest)
        if rel == SAFETENSORS:
            return ref, rel, expected
        name = rel[: -len(NPY)] if rel.endswith(NPY) else None
        if name is None or name not in {s.name for s, _ in expected}:
            if scratch_ok and name is not None:  # refused at close (EINVAL), as a bad header
                return ref, name, expected
            if scratch_ok:  # a temporary file, renamed to its final name later
                return ref, None, expected
            raise PermissionError(errno.EACCES, f"{path}: rank {ref.rank} holds no tensor by "
                                  f"that name; write state.safetensors or <name>.npy")
        return ref, name, expected

    def _open_write(self, path: str, fi: Any, truncate: bool) -> int:
        ref, name, expected = self._rank_target(path, scratch_ok=True)
        assert ref.rank is not None  # checked by _rank_target
        session = WriteSession(self.spool, ref.job, ref.rank, name, expected,
                               uid=mfusepy.fuse_get_context()[0])
        with self._lock:
            self._writing[path] = session
        fi.direct_io = 1
        fi.fh = self._add(_Handle(session=session))
        return 0

    @_errno
    def create(self, path: str, mode: int, fi: Any) -> int:
        if self.saves.takes(path):
            return self._open_save(path, fi)
        return self._open_write(path, fi, truncate=True)

    @_errno
    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        h = self._get(fi.fh)
        if h.session is None:
            raise PermissionError(errno.EBADF, f"{path} is open for reading")
        return h.session.write(data, offset)

    @_errno
    def truncate(self, path: str, length: int, fi: Any = None) -> int:
        with self._lock:
            session = self._writing.get(path)
        if session is None:
            self._rank_target(path)  # refuse paths that cannot be written
            return 0  # opening with O_TRUNC starts a new session anyway
        session.truncate(length)
        return 0

    @_errno
    def flush(self, path: str, fi: Any) -> int:
        h = self._get(fi.fh)
        if h.session is not None:
            h.session.finish(self.put)
        return 0

    @_errno
    def release(self, path: str, fi: Any) -> int:
        with self._lock:
            h = self._handles.pop(fi.fh, None)
            if h is not None and h.session is not None and \
                    self._writing.get(path) is h.session:
                del self._writing[path]
            if h is not None and h.path is not None:
                left = self._reading.pop(h.path, 1) - 1
                if left:
                    self._reading[h.path] = left
        if h is not None and h.version is not None and self.open_versions is not None:
            self.open_versions.closed(h.version)
        if h is not None and h.foreground and self.warmer is not None:
            self.warmer.closed()
        if h is not None and h.direct and path is not None and self.warmer is not None:
            item: File = h.node.item  # type: ignore[union-attr,assignment]
            self.warmer.want([(path, item.size)], read=True)  # direct handles are files
        if h is not None and h.session is not None:
            if h.session.name is None:  # a temporary file: kept until renamed or unlinked
                with self._lock:
                    self._writing[path] = h.session
                return 0
            try:
                h.session.finish(self.put)
            except PtcError:
                pass  # already logged, and reported to the writer's flush
            finally:
                h.session.close()
        return 0

    @_errno
    def rename(self, old: str, new: str) -> int:
        """A temporary file written in a rank's folder becomes its state file
        (how safetensors' ``save_file`` and other atomic savers write)."""
        if self.saves.takes(old):
            self.saves.rename(old, new, mfusepy.fuse_get_context()[0])
            return 0
        with self._lock:
            session = self._writing.get(old)
        if not isinstance(session, WriteSession):
            raise PermissionError(errno.EACCES, f"{old}: only files written here can be renamed")
        ref, name, _ = self._rank_target(new)
        if name is None or (ref.job, ref.rank) != (session.job, session.rank):
            raise PermissionError(errno.EACCES, f"{new}: rename within the same rank's folder")
        with self._lock:
            self._writing.pop(old, None)
        session.rename(name)
        try:
            session.finish(self.put)
        finally:
            session.close()
        return 0

    @_errno
    def unlink(self, path: str) -> int:
        if self.saves.takes(path):
            self.saves.unlink(path)
            return 0
        self._check_writer(parse_path(path).job, path)
        with self._lock:
            session = self._writing.pop(path, None)
        if session is None:
            raise PermissionError(errno.EACCES, f"{path}: committed state cannot be deleted")
        session.close()
        return 0

    # --- what the mount does not do: EACCES, as documented (not ENOSYS) ------------
    @_errno
    def mkdir(self, path: str, mode: int) -> int:
        self.saves.mkdir(path, mfusepy.fuse_get_context()[0])  # dcp/step-<N> only
        return 0

    @_errno
    def rmdir(self, path: str) -> int:
        """A ``dcp/step-<N>`` folder (:meth:`SaveFolders.rmdir`); no other."""
        self.saves.rmdir(path)
        return 0

    @_errno
    def mknod(self, path: str, mode: int, dev: int) -> int:
        raise refused(path, "only regular files can be written, in a rank's folder")

    @_errno
    def symlink(self, target: str, source: str) -> int:
        raise refused(target, "links cannot be made here")

    @_errno
    def link(self, target: str, source: str) -> int:
        raise refused(target, "links cannot be made here")

    @_errno
    def chmod(self, path: str, mode: int) -> int:
        raise refused(path, "modes cannot be changed")

    @_errno
    def chown(self, path: str, uid: int, gid: int) -> int:
        raise refused(path, "owners cannot be changed")

    # --- handles ----------------------------------------------------------------
    def _add(self, h: _Handle, foreground: bool = True) -> int:
        """A handle for ``h``; ``foreground`` unless the background reader
        opened it (the first foreground open pauses that reader)."""
        if foreground and self.warmer is not None:
            h.foreground = True
            self.warmer.opened()
        with self._lock:
            fh = self._next
            self._next += 1
            self._handles[fh] = h
            return fh

    def _get(self, fh: int) -> _Handle:
        with self._lock:
            h = self._handles.get(fh)
        if h is None:
            raise OSError(errno.EBADF, "unknown file handle")
        return h


def _mode(bits: int, folder: bool, writable: bool) -> int:
    """Permission bits of a file or folder of a job of mode ``bits``: its
    owner always reads (and writes what can be written), folders may be
    entered where they may be read, and nothing committed is writable."""
    m = bits | 0o600
    m = m | ((m & 0o444) >> 2) if folder else m & 0o666
    return m if writable else m & ~0o222
