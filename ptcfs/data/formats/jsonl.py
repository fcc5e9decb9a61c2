"""``jsonl``: one JSON value per line (blank lines are skipped).

A sample's stored bytes are its line, with its line ending made ``\\n``.
Its token count is the record's ``length_key`` field when every record is
an object that has it: a whole number as it is, a list or a string by its
length (``"input_ids": [...]``, ``"text": "..."``).
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from ptcfs.data.source import Source, SourceInfo
from ptcfs.errors import BadDataset

__all__ = ["JsonlSource", "DEFAULT_LENGTH_KEY"]

DEFAULT_LENGTH_KEY = "length"


def _length(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, list | str):
        return len(value)
    return None


class JsonlSource(Source):
    """Lines of a JSONL file, each checked to be one JSON value."""

    def __init__(self, path: str | Path, length_key: str | None = DEFAULT_LENGTH_KEY,
                 need_lengths: bool = False):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise BadDataset(f"{self.path}: cannot open it: {e.strerror or e}") from e
        try:
            size = self.path.stat().st_size
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size \
                else None
            self._scan(length_key, need_lengths)
        except BaseException:
            self.close()
            raise

    def _scan(self, key: str | None, need_lengths: bool) -> None:
        starts: list[int] = []
        ends: list[int] = []
        lengths: list[int] | None = [] if key else None
        data = self._map if self._map is not None else b""
        pos, lineno = 0, 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            stop = len(data) if nl < 0 else nl
            lineno += 1
            end = stop - 1 if stop > pos and data[stop - 1] == 0x0D else stop
            line = data[pos:end]
            if line.strip():
                try:
                    value = json.loads(line)
                except (ValueError, UnicodeDecodeError) as e:
                    raise BadDataset(f"{self.path}: line {lineno}: not valid JSON ({e})") from e
                if lengths is not None:
                    n = _length(value.get(key)) if isinstance(value, dict) else None
                    if n is None:
                        if need_lengths:
                            raise BadDataset(f"{self.path}: line {lineno}: no usable {key!r} "
                                             "(a whole number, list or string) to balance by")
                        lengths = None
                    else:
                        lengths.append(n)
                starts.append(pos)
                ends.append(end)
            pos = stop + 1
        if not starts:
            raise BadDataset(f"{self.path}: no JSON records in it")
        self._starts = np.asarray(starts, dtype=np.int64)
        self._ends = np.asarray(ends, dtype=np.int64)
        sizes = self._ends - self._starts + 1
        tokens = np.asarray(lengths, dtype=np.int64) if lengths is not None else None
        self.info = SourceInfo("jsonl", str(self.path), sizes, tokens=tokens)

    def read(self, first: int, stop: int) -> bytes:
        data = self._map
        if data is None:
            return b""
        return b"".join(data[a:b] + b"\n" for a, b in zip(self._starts[first:stop].tolist(),
                                                           self._ends[first:stop].tolist()))

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            self._map.close()  # type: ignore[union-attr]
            self._map = None
        if getattr(self, "_file", None) is not None:
            self._file.close()


def open_source(path: str | Path, length_key: str | None = None,
                need_lengths: bool = False) -> JsonlSource:
    """The ``jsonl`` row of :data:`ptcfs.data.formats.FORMATS`."""
    return JsonlSource(path, length_key or DEFAULT_LENGTH_KEY, need_lengths)
