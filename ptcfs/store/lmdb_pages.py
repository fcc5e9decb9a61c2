"""Where a big value lies in an LMDB data file, found by reading the
B-tree pages of one snapshot instead of looking the value up.

LMDB's Python binding touches every page of a value it returns (so that a
page fault never happens while it holds the GIL). For the mount, which only
needs to know *where* a chunk lies so that the kernel can splice it, that
costs a page fault per 64 KiB the first time a process sees a chunk: about
a tenth of a second per GiB, on every first read of a tensor. Walking the
tree reads three or four 4 KiB pages per chunk instead.

The walk reads LMDB's on-disk format (``MDB_DATA_VERSION`` 1, the 0.9 series
that the binding bundles) through ``pread`` of the data file, for the
snapshot of one open read transaction: its meta page is the one carrying
its transaction id, and pages reachable from it are not rewritten while it
is open. Anything unexpected (another format, a meta page already reused
by a later commit, a key that is not there, a value that is not on
overflow pages) gives None, and the caller looks the value up the ordinary
way. A found value is checked: its first page must be an overflow page
that names itself and is long enough.
"""

from __future__ import annotations

import os
import struct

__all__ = ["PageWalker"]

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_PAGEHDR = 16  # pgno (8), pad (2), flags (2), lower/upper (2 + 2) or overflow page count (4)
_NODEHDR = 8  # lo, hi, flags, ksize: 2 bytes each
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, pages ×3, entries, root
_META = struct.Struct("<IIQQ")  # magic, version, address, map size; then the two MDB_db
_ROOT = 7  # md_root's place in _DB
_INVALID = (1 << 64) - 1  # P_INVALID: the root of an empty database
_U64 = struct.Struct("<Q")
_MAX_DEPTH = 32


def _node_key(page: bytes, at: int) -> bytes:
    """The key of the node at byte ``at`` of ``page``."""
    ksize = struct.unpack_from("<H", page, at + 6)[0]
    return page[at + _NODEHDR:at + _NODEHDR + ksize]


def _last_at_most(page: bytes, ptrs: tuple[int, ...], key: bytes, first: int) -> int:
    """Index of the last node from ``first`` on whose key is <= ``key``
    (keys are sorted as bytes); ``max(first - 1, 0)`` when there is none."""
    lo, hi, best = first, len(ptrs) - 1, max(first - 1, 0)
    while lo <= hi:
        mid = (lo + hi) // 2
        if _node_key(page, ptrs[mid]) <= key:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


class PageWalker:
    """Finds values of one LMDB environment's data file, open as ``fd``."""

    def __init__(self, fd: int, page_size: int):
        self.fd = fd
        self.psize = page_size
        # (txn id, database name) → the named database's root page
        self._roots: dict[tuple[int, bytes], int | None] = {}

    def _page(self, pgno: int) -> bytes:
        return os.pread(self.fd, self.psize, pgno * self.psize)

    def _main_root(self, txnid: int) -> int | None:
        """The main database's root in the snapshot ``txnid``, from its meta
        page (read twice: a writer may be replacing it)."""
        found = self._meta(txnid)
        if found is None:
            return None
        root = found[1][_ROOT]
        return None if root == _INVALID or root > found[2] else root

    def _search(self, root: int, key: bytes) -> tuple[int, int, bytes] | None:
        """``(node flags, data size, data)`` of ``key``'s leaf node, or None."""
        pgno = root
        for _ in range(_MAX_DEPTH):
            page = self._page(pgno)
            if _U64.unpack_from(page, 0)[0] != pgno:
                return None
            flags, lower = struct.unpack_from("<HH", page, 10)
            if flags & _P_LEAF2 or lower < _PAGEHDR or lower > self.psize:
                return None
            count = (lower - _PAGEHDR) >> 1
            ptrs = struct.unpack_from(f"<{count}H", page, _PAGEHDR)

            if flags & _P_BRANCH:  # node 0 stands for every key below node 1's
                at = ptrs[_last_at_most(page, ptrs, key, first=1)]
                n_lo, n_hi, n_flags = struct.unpack_from("<HHH", page, at)
                pgno = n_lo | (n_hi << 16) | (n_flags << 32)
                continue
            if not flags & _P_LEAF or not count:
                return None
            at = ptrs[_last_at_most(page, ptrs, key, first=0)]
            if _node_key(page, at) != key:
                return None
            n_lo, n_hi, n_flags, ksize = struct.unpack_from("<HHHH", page, at)
            start = at + _NODEHDR + ksize
            size = n_lo | (n_hi << 16)
            inline = size if not n_flags & (_F_BIGDATA | _F_SUBDATA) else \
                (8 if n_flags & _F_BIGDATA else _DB.size)
            return n_flags, size, page[start:start + inline]
        return None

    def _root(self, txnid: int, name: bytes) -> int | None:
        known = self._roots.get((txnid, name), -1)
        if known != -1:
            return known
        root = None
        main = self._main_root(txnid)
        if main is not None:
            found = self._search(main, name)
            if found is not None and found[0] & _F_SUBDATA and not found[0] & _F_DUPDATA:
                db_root = _DB.unpack(found[2])[_ROOT]
                root = None if db_root == _INVALID else db_root
        if len(self._roots) > 64:
            self._roots.clear()
        self._roots[(txnid, name)] = root
        return root

    def free_pages(self, txnid: int, before: int) -> list[int] | None:
        """The pages on LMDB's free list in the snapshot ``txnid`` that
        transactions before ``before`` freed (a writer may take those once no
        reader sees an older snapshot), sorted; None when the snapshot's
        meta page is gone or a page is not what it should be."""
        try:
            meta = self._meta(txnid)
            if meta is None:
                return None
            root = meta[0][_ROOT]
            if root == _INVALID:
                return []
            out: list[int] = []
            pending = [(root, 0)]
            while pending:
                pgno, depth = pending.pop()
                page = self._page(pgno)
                if _U64.unpack_from(page, 0)[0] != pgno or depth > _MAX_DEPTH:
                    return None
                flags, lower = struct.unpack_from("<HH", page, 10)
                count = (lower - _PAGEHDR) >> 1
                ptrs = struct.unpack_from(f"<{count}H", page, _PAGEHDR)
                for at in ptrs:
                    n_lo, n_hi, n_flags, ksize = struct.unpack_from("<HHHH", page, at)
                    if flags & _P_BRANCH:
                        pending.append((n_lo | (n_hi << 16) | (n_flags << 32), depth + 1))
                        continue
                    if not flags & _P_LEAF or ksize != 8:
                        return None
                    start = at + _NODEHDR
                    if _U64.unpack_from(page, start)[0] >= before:
                        continue
                    size = n_lo | (n_hi << 16)
                    if n_flags & _F_BIGDATA:  # the list is on overflow pages
                        first = _U64.unpack_from(page, start + 8)[0]
                        raw = os.pread(self.fd, size, first * self.psize + _PAGEHDR)
                    else:
                        raw = page[start + 8:start + 8 + size]
                    n = _U64.unpack_from(raw, 0)[0]  # an ID list: its length, then pages
                    out.extend(struct.unpack_from(f"<{n}Q", raw, 8))
            return sorted(out)
        except (OSError, struct.error, IndexError):
            return None

    def _meta(self, txnid: int) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """The free and main databases' records of snapshot ``txnid``, and
        its last page in use (the meta page is read twice: a writer may be
        replacing it)."""
        meta = txnid & 1  # LMDB alternates its two meta pages by transaction id
        first = self._page(meta)[:_PAGEHDR + _META.size + 2 * _DB.size + 16]
        if self._page(meta)[:len(first)] != first:
            return None
        magic, version, _, _ = _META.unpack_from(first, _PAGEHDR)
        at = _PAGEHDR + _META.size
        last_pg, found_txnid = struct.unpack_from("<QQ", first, at + 2 * _DB.size)
        if magic != _MAGIC or version != _DATA_VERSION or found_txnid != txnid:
            return None
        return _DB.unpack_from(first, at), _DB.unpack_from(first, at + _DB.size), last_pg

    def locate(self, txnid: int, db_name: bytes, key: bytes) -> tuple[int, int] | None:
        """``(file offset, size)`` of the value of ``key`` in the named
        database ``db_name`` as the snapshot ``txnid`` sees it, when that
        value lies on overflow pages; None otherwise (look it up instead)."""
        try:
            root = self._root(txnid, db_name)
            found = None if root is None else self._search(root, key)
            if found is None or not found[0] & _F_BIGDATA or found[0] & _F_SUBDATA:
                return None
            _, size, data = found
            pgno = _U64.unpack(data)[0]
            head = self._page(pgno)[:_PAGEHDR]
            self_pgno, flags, pages = struct.unpack_from("<Q2xHI", head)
            if self_pgno != pgno or not flags & _P_OVERFLOW or \
                    pages * self.psize < size + _PAGEHDR:
                return None
            return pgno * self.psize + _PAGEHDR, size
        except (OSError, struct.error, IndexError):
            return None
