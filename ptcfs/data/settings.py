"""Tunables of dataset state, in one place, with their defaults.

Each may be overridden by a ``PTC_*`` environment variable, read once at
import; explicit arguments (command-line options) win over both.
"""

from __future__ import annotations

import os

__all__ = ["CHUNK_BYTES", "KEEP_POSITIONS", "STORE_SUFFIX", "store_job", "FORMATS",
           "BALANCES", "INGEST_INFLIGHT"]


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a whole number") from None
    if value < 1:
        raise ValueError(f"${name}={value} must be at least 1")
    return value


#: A dataset is stored as chunks of whole samples of about this many bytes
#: (``PTC_DATA_CHUNK_BYTES``); a sample bigger than it gets a chunk of its own.
CHUNK_BYTES = _int("PTC_DATA_CHUNK_BYTES", 16 << 20)
#: Committed read positions kept besides the ingested version
#: (``PTC_DATA_KEEP_POSITIONS``): views of the older ones disappear.
KEEP_POSITIONS = _int("PTC_DATA_KEEP_POSITIONS", 2)
#: Chunks being read and sent at once during an ingest (``PTC_DATA_INGEST_INFLIGHT``).
INGEST_INFLIGHT = _int("PTC_DATA_INGEST_INFLIGHT", 4)
#: A job's dataset lives in the store-job ``<job>@data`` (the mount hides
#: store-jobs whose name holds ``@``).
STORE_SUFFIX = "@data"
#: The formats a dataset can be ingested from.
FORMATS = ("npy", "jsonl", "files", "megatron")
#: How each global batch is dealt to the data-parallel ranks.
BALANCES = ("samples", "tokens")


def store_job(job: str) -> str:
    """The store-job that holds ``job``'s dataset."""
    return job + STORE_SUFFIX
