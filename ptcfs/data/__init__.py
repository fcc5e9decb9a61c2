"""Dataset state: ingest, the seeded order, the deal to data-parallel ranks,
and the per-rank views under ``/ptc/<job>/data/``.

Pure functions and store reads only (no sockets): the cluster side lives in
:mod:`ptcfs.client.control.datastate`.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from ptcfs.data.deal import RankView, balanced_ranks, deal_steps, even_bounds, view_steps
from ptcfs.data.formats import FORMATS
from ptcfs.data.names import store_job
from ptcfs.data.order import epoch_order, stream_samples
from ptcfs.data.record import Chunk, DatasetRecord, Position
from ptcfs.data.source import Source, SourceInfo
from ptcfs.errors import BadDataset, DatasetExists

__all__ = ["BadDataset", "Chunk", "DatasetExists", "DatasetRecord", "FORMATS", "Position",
           "RankView", "Source", "SourceInfo", "balanced_ranks", "deal_steps", "epoch_order",
           "even_bounds", "open_source", "store_job", "stream_samples", "view_steps"]


def open_source(fmt: str, path: str | Path, length_key: str | None = None,
                need_lengths: bool = False) -> Source:
    """Open and check a dataset of format ``fmt`` (one of :data:`FORMATS`).
    ``length_key``/``need_lengths``: jsonl's length field, and whether every
    record must have it (for the balanced deal)."""
    name = FORMATS.get(fmt)
    if name is None:
        raise BadDataset(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    source: Source = import_module(f"ptcfs.data.formats.{name}").open_source(
        path, length_key, need_lengths)
    return source
