"""Tensor stores: the contract and its backends."""

from ptcfs.store.base import EntryInfo, Reader, TensorStore, VersionInfo, part_key

__all__ = ["EntryInfo", "Reader", "TensorStore", "VersionInfo", "part_key"]
