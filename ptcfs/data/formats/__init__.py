"""Dataset formats: one module each, named in one table (:data:`FORMATS`).

A format module defines ``open_source(path, length_key, need_lengths)``,
which opens and checks a dataset of that format as a
:class:`~ptcfs.data.source.Source`. The table imports no format:
``ptcctl data ingest --format`` takes its choices from it, and
:func:`ptcfs.data.open_source` imports the one asked for.
"""

from __future__ import annotations

__all__ = ["FORMATS"]

#: ``--format`` value → its module under ``ptcfs.data.formats``.
FORMATS: dict[str, str] = {
    "npy": "npy",  # a 2-D array [N, L], one sample per row
    "jsonl": "jsonl",  # one JSON value per line
    "files": "files",  # a directory tree of files, one sample each
    "megatron": "megatron",  # Megatron-LM's indexed dataset (.bin + .idx)
}
