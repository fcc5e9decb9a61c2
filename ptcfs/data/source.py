"""What ingest reads: a dataset in one format, as samples of stored bytes.

Each format module opens its input, checks all of it that can be checked
without reading every byte (and the records themselves where the format
needs parsing), and describes it as a :class:`Source`:

1. ``count`` samples, ``sizes[i]`` bytes each once stored, and optionally
   ``tokens[i]`` (the length the balanced deal uses);
2. ``index_entries()``: format details every host needs to build views
   (Megatron's sequence sizes, the files' names), stored on every host;
3. ``read(first, stop)``: the stored bytes of samples ``[first, stop)``,
   concatenated (called from worker threads, in any order).

Bad input raises :class:`~ptcfs.errors.BadDataset` naming the file and
the offending record.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Source", "SourceInfo"]


@dataclass(frozen=True, eq=False)
class SourceInfo:
    """The shape of a source's samples."""

    format: str
    path: str
    sizes: np.ndarray
    tokens: np.ndarray | None = None
    dtype: str = "|u1"  # numpy dtype string
    sample_shape: tuple[int, ...] = ()
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


class Source(ABC):
    """An opened dataset (see the module docstring)."""

    info: SourceInfo

    @abstractmethod
    def read(self, first: int, stop: int) -> bytes | memoryview:
        """The stored bytes of samples ``[first, stop)``, concatenated."""

    def close(self) -> None:  # noqa: B027 (sources without open files need nothing)
        """Release files the source holds open."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
