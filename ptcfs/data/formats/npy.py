"""``npy``: a 2-D array ``[N, L]`` (one sample per row), read by memmap."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ptcfs.data.source import Source, SourceInfo
from ptcfs.errors import BadDataset

__all__ = ["NpySource"]


class NpySource(Source):
    """Rows of a ``.npy`` file; a sample's stored bytes are its row."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError as e:
            raise BadDataset(f"{self.path}: no such file") from e
        except EOFError as e:  # an empty file, or one cut short in its header
            raise BadDataset(f"{self.path}: not a .npy file: it ends before its header "
                             f"does ({e})") from e
        except ValueError as e:
            raise BadDataset(f"{self.path}: not a numeric .npy array ({e}); a ragged array "
                             "(rows of different lengths) is stored as Python objects: pad it "
                             "to [N, L] or use --format jsonl or megatron") from e
        except OSError as e:
            raise BadDataset(f"{self.path}: cannot read it as .npy: {e}") from e
        if not isinstance(arr, np.memmap) and not isinstance(arr, np.ndarray):
            raise BadDataset(f"{self.path}: holds no array")
        if arr.ndim != 2:
            raise BadDataset(f"{self.path}: an array of shape {list(arr.shape)}; expected 2-D "
                             "[N, L], one sample per row")
        if not arr.flags.c_contiguous:
            raise BadDataset(f"{self.path}: a Fortran-order array; save it in C order "
                             "(np.ascontiguousarray)")
        if arr.dtype.kind not in "biuf" or arr.dtype.fields is not None:
            raise BadDataset(f"{self.path}: element type {arr.dtype} is not supported; "
                             "store numbers (bool, int, uint or float)")
        if arr.dtype.byteorder == ">":
            raise BadDataset(f"{self.path}: big-endian {arr.dtype}; save it little-endian")
        dtype = arr.dtype.str
        self._arr = arr
        n, length = arr.shape
        row = length * arr.dtype.itemsize
        self.info = SourceInfo("npy", str(self.path), np.full(n, row, dtype=np.int64),
                               tokens=np.full(n, length, dtype=np.int64), dtype=dtype,
                               sample_shape=(int(length),))

    def read(self, first: int, stop: int) -> memoryview:
        return np.ascontiguousarray(self._arr[first:stop]).reshape(-1).view(np.uint8).data

    def close(self) -> None:
        mm = getattr(self._arr, "_mmap", None)
        self._arr = np.empty((0, 0))
        if mm is not None:
            mm.close()


def open_source(path: str | Path, length_key: str | None = None,
                need_lengths: bool = False) -> NpySource:
    """The ``npy`` row of :data:`ptcfs.data.formats.FORMATS`."""
    return NpySource(path)
