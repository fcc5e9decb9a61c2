"""Reading a box of one tensor from a ``torch.distributed.checkpoint`` directory,
and writing a directory chunk by chunk, in one process without a process group.

:func:`read_box` asks DCP's own reader for the region ``[start, start+size)``
of one key: DCP reads only the stored chunks that the region overlaps (a
Megatron-Core checkpoint stores a layer per chunk, so one layer of a stacked
tensor costs one layer's bytes). :func:`save_chunks` writes tensors given as
chunks whose values are produced only when DCP writes them, one at a time,
so an export holds one chunk in memory, not the whole model.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["Chunk", "StackedTensor", "read_box", "read_metadata", "reader", "save_chunks"]


class _Reader(dcp.FileSystemReader):
    """DCP's reader of a directory, reading ``.metadata`` once."""

    _md: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._md is None:
            self._md = super().read_metadata(*args, **kwargs)
        return self._md


_READERS: dict[tuple[str, int, int], _Reader] = {}


def reader(path: Path) -> dcp.FileSystemReader:
    """A reader of the DCP directory ``path`` that parses its ``.metadata``
    once, kept while that file stays the same (a few directories at a time):
    reading a checkpoint tensor by tensor, or a tensor piece by piece, costs
    one parse of what can be megabytes of chunk lists, not one per read."""
    try:
        st = (path / ".metadata").stat()
    except OSError:
        return dcp.FileSystemReader(str(path))  # DCP says what is wrong
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _READERS:
        if len(_READERS) >= 4:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = _Reader(str(path))
    return _READERS[key]


def read_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` of the directory ``path``."""
    return reader(path).read_metadata()


class _BoxPlanner(DefaultLoadPlanner):
    def __init__(self, key: str, start: tuple[int, ...], out: torch.Tensor):
        super().__init__(flatten_state_dict=False)
        self.key, self.start, self.out = key, start, out

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:  # set_up_planner gives it first
            raise RuntimeError("DCP called create_local_plan before set_up_planner")
        md = self.metadata.state_dict_metadata[self.key]
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{self.key} is stored as bytes, not as a tensor")
        chunk = ChunkStorageMetadata(torch.Size(self.start), torch.Size(self.out.shape))
        return LoadPlan(create_read_items_for_chunk_list(self.key, md, [chunk]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.out


def read_box(path: Path, key: str, start: tuple[int, ...], size: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """The region of ``key`` from ``start``, of shape ``size``, as stored."""
    out = torch.empty(size, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({}, storage_reader=reader(path),
                 planner=_BoxPlanner(key, start, out), no_dist=True)
    return out


@dataclass(frozen=True)
class Chunk:
    """One stored chunk: its offsets in the key's tensor and a function that
    gives its values (shape: the chunk's sizes)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    get: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class StackedTensor:
    """A key's whole tensor, as the chunks that cover it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


class _ChunkPlanner(DefaultSavePlanner):
    def __init__(self, items: dict[str, StackedTensor | Callable[[], bytes]]):
        super().__init__(flatten_state_dict=False)
        self.items = items
        self.values: dict[tuple[str, tuple[int, ...] | None], Callable[[], Any]] = {}

    def create_local_plan(self) -> SavePlan:
        out = []
        for fqn, item in self.items.items():
            if not isinstance(item, StackedTensor):
                out.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                self.values[(fqn, None)] = _bytes_io(item)
                continue
            props = TensorProperties(dtype=item.dtype)
            for c in item.chunks:
                out.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                        properties=props, size=torch.Size(item.shape))))
                self.values[(fqn, c.offsets)] = c.get
        self.plan = SavePlan(out)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        offset = write_item.index.offset
        return self.values[(write_item.index.fqn, None if offset is None else tuple(offset))]()


def _bytes_io(get: Callable[[], bytes]) -> Callable[[], io.BytesIO]:
    return lambda: io.BytesIO(get())


class _AliasWriter(dcp.FileSystemWriter):
    """DCP's file writer whose metadata also names some keys' chunks under a
    second key: the same bytes, read under either name."""

    def __init__(self, path: Path, aliases: dict[str, str]):
        super().__init__(str(path), thread_count=1)
        self.aliases = aliases

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        extra = []
        for alias, key in self.aliases.items():
            metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[key]
            extra += [dataclasses.replace(r, index=dataclasses.replace(r.index, fqn=alias))
                      for rs in results for r in rs if r.index.fqn == key]
        super().finish(metadata, [*results, extra])


def save_chunks(path: Path, items: dict[str, StackedTensor | Callable[[], bytes]],
                aliases: dict[str, str] | None = None) -> None:
    """Write a DCP directory (``.metadata`` and ``__0_0.distcp``) of tensors given
    by chunks and of byte objects given by functions, each produced when written;
    each key of ``aliases`` reads the bytes of the item it names (no copy)."""
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({}, storage_writer=_AliasWriter(path, aliases or {}),
                 planner=_ChunkPlanner(items), no_dist=True)
