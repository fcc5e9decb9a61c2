"""Answers to libfuse's ``read_buf``: a ``struct fuse_bufvec`` of pieces.

A piece is either memory or a range of an open file. libfuse sends file
ranges to the kernel with ``splice`` when the mount asks for
``FUSE_CAP_SPLICE_WRITE``: the bytes go from the file's pages to the
reader without passing through this process. libfuse frees the vector and
every memory piece with ``free()`` after replying, so both are allocated
with the C library's ``malloc`` here.

The layout is libfuse 3's (``fuse_common.h``)::

    struct fuse_buf { size_t size; enum fuse_buf_flags flags; void *mem;
                      int fd; off_t pos; };
    struct fuse_bufvec { size_t count; size_t idx; size_t off;
                         struct fuse_buf buf[1]; };

(mfusepy declares ``buf`` as a pointer, which is not this layout, so the
structures are declared here.)
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path
from typing import Any

from ptcfs.fuse.reading import MAX_PIECES, FileRange

__all__ = ["FUSE_CAP_SPLICE_WRITE", "bufvec", "splice_max_read"]

#: The kernel's largest FUSE read (256 pages).
KERNEL_MAX_READ = 1 << 20

#: Capability bit: libfuse may reply with splice (fuse_common.h).
FUSE_CAP_SPLICE_WRITE = 1 << 7
_IS_FD, _FD_SEEK = 1 << 1, 1 << 2

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class _Buf(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("flags", ctypes.c_int), ("mem", ctypes.c_void_p),
                ("fd", ctypes.c_int), ("pos", ctypes.c_int64)]


class _Head(ctypes.Structure):
    _fields_ = [("count", ctypes.c_size_t), ("idx", ctypes.c_size_t), ("off", ctypes.c_size_t)]


def _malloc(n: int) -> int:
    addr = _libc.malloc(max(n, 1))
    if not addr:
        raise MemoryError(f"malloc({n}) failed")
    return int(addr)


def bufvec(pieces: list[FileRange | Any]) -> int:
    """A malloc'd ``struct fuse_bufvec`` holding ``pieces`` (file ranges, or
    bytes-like objects and ctypes buffers, copied into malloc'd memory); its
    address, for libfuse to reply with and free."""
    count = max(1, len(pieces))
    vec = _malloc(ctypes.sizeof(_Head) + count * ctypes.sizeof(_Buf))
    bufs = (_Buf * count).from_address(vec + ctypes.sizeof(_Head))
    head = _Head.from_address(vec)
    head.count, head.idx, head.off = count, 0, 0
    ctypes.memset(ctypes.addressof(bufs), 0, ctypes.sizeof(bufs))
    try:
        for b, piece in zip(bufs, pieces):
            if isinstance(piece, FileRange):
                b.size, b.flags, b.fd, b.pos = piece.size, _IS_FD | _FD_SEEK, piece.fd, piece.pos
                continue
            if not isinstance(piece, (bytes, ctypes.Array)) and \
                    not hasattr(piece, "_as_parameter_"):
                piece = bytes(piece)
            n = len(piece)
            b.mem = _malloc(n)
            b.size = n
            ctypes.memmove(b.mem, piece, n)
    except BaseException:
        for b in bufs:
            if b.mem:
                _libc.free(b.mem)
        _libc.free(vec)
        raise
    return vec


def splice_max_read(pipe_max_file: Path = Path("/proc/sys/fs/pipe-max-size")) -> int | None:
    """A ``max_read`` for the mount under which libfuse can splice every
    read: it sends a reply through a pipe of at least the read's bytes plus
    a page per piece and three more, and falls back to copying when the
    pipe cannot grow that far (``/proc/sys/fs/pipe-max-size``, 1 MiB by
    default, unless the process holds CAP_SYS_RESOURCE). None when the
    kernel's own largest read fits."""
    page = mmap.PAGESIZE
    try:
        pipe_max = int(pipe_max_file.read_text())
    except (OSError, ValueError):
        pipe_max = KERNEL_MAX_READ
    room = (pipe_max - page * (MAX_PIECES + 3)) // page * page
    return None if room >= KERNEL_MAX_READ else max(room, 32 * page)
