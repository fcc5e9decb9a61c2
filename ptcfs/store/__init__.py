"""Tensor stores: the contract and its backends."""

from ptcfs.store.base import EntryInfo, Reader, TensorStore, VersionInfo, part_key
from ptcfs.store.lmdb_store import LmdbStore
from ptcfs.store.memory_store import MemoryStore

__all__ = [
    "EntryInfo",
    "LmdbStore",
    "MemoryStore",
    "Reader",
    "TensorStore",
    "VersionInfo",
    "part_key",
]
