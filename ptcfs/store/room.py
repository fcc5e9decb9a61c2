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
import os

from ptcfs.pages import populate

__all__ = ["in_memory", "populate", "written_end"]

_libc = ctypes.CDLL(None, use_errno=True)
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
