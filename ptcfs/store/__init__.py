"""Tensor stores: the contract and its backends."""

from ptcfs.store.base import EntryInfo, Reader, TensorStore, VersionInfo, part_key
from ptcfs.store.lmdb_store import LmdbStore

__all__ = ["EntryInfo", "LmdbStore", "Reader", "TensorStore", "VersionInfo", "part_key"]
