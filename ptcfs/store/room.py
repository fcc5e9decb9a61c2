"""Room past an LMDB store's last page in use (see ``LmdbStore.make_room``).

Without writemap, LMDB writes values with ``pwrite``: room is zeros written
past the last page in use, so the next version's writes rewrite pages the
file has. With writemap, LMDB copies values straight into its map, and the
data file is as big as the map (sparse): room is pages past the last one
in use faulted in, writable, in this process's map (``MADV_POPULATE_WRITE``,
Linux 5.14), which also gives the file those pages, zeroed. A write into
them is then one copy, with no page fault and no zeroing.

Whether a store uses writemap by default also lives here: on a filesystem
that keeps files in memory (:func:`in_memory`) it does, since writing
straight into the map saves a copy; on disk it does not, since there every
page written through the map costs a fault and the commit's msync.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["in_memory", "populate", "written_end"]

#: madvise(2) advice: fault pages in for writing (Linux 5.14).
MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_statfs = _libc.statfs
_statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_statfs.restype = ctypes.c_int


#: statfs(2) f_type of filesystems that keep files in memory: tmpfs, ramfs.
_MEMORY_FS = {0x01021994, 0x858458F6}


def in_memory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies on a filesystem that keeps files in memory
    (tmpfs, ramfs), by statfs(2); False where that cannot be told."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type comes first
    if _statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in _MEMORY_FS


def written_end(fd: int, used: int, sparse: bool) -> int:
    """Where the data file's pages from ``used`` on end: the file's size, or
    for a sparse file (writemap) the first hole at or after ``used``."""
    if not sparse:
        return max(used, os.fstat(fd).st_size)
    try:
        return max(used, os.lseek(fd, used, os.SEEK_HOLE))
    except OSError:  # no SEEK_HOLE here: count no room
        return used


def populate(address: int, length: int) -> None:
    """Fault ``[address, address + length)`` of a shared, writable file map
    in for writing: pages the file lacks are allocated (zeroed), and every
    page is mapped writable. Raises OSError (ENOSPC or ENOMEM where the
    filesystem is full, EINVAL on kernels without the advice)."""
    if length <= 0:
        return
    if _madvise(ctypes.c_void_p(address), length, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno() or errno.EIO
        raise OSError(err, os.strerror(err))
