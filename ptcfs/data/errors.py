"""Errors of dataset ingest and state; both are ptcfs errors (EINVAL / EEXIST-like)."""

from __future__ import annotations

from ptcfs.errors import BadInput, PtcError

__all__ = ["BadDataset", "DatasetExists"]


class BadDataset(BadInput):
    """The input is not a valid dataset of its format; the message names the
    file and the offending record (``ptcctl`` exits 2)."""


class DatasetExists(PtcError, FileExistsError):
    """The job has a dataset already."""
