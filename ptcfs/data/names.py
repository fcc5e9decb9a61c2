"""Fixed names of dataset state (its tunables, ``PTC_DATA_*``, are in
:mod:`ptcfs.settings`)."""

from __future__ import annotations

__all__ = ["STORE_SUFFIX", "store_job", "BALANCES"]


#: A job's dataset lives in the store-job ``<job>@data`` (the mount hides
#: store-jobs whose name holds ``@``).
STORE_SUFFIX = "@data"
#: How each global batch is dealt to the data-parallel ranks.
BALANCES = ("samples", "tokens")


def store_job(job: str) -> str:
    """The store-job that holds ``job``'s dataset."""
    return job + STORE_SUFFIX
