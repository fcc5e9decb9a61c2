"""``files``: a directory tree of files, one sample each (ImageFolder's
``<class>/<name>`` layout: the class is the first folder of the path).

Samples are the regular files under the root in sorted path order; a
sample's stored bytes are the file's bytes, and its relative path is kept
in the index (``names``), from which views rebuild the class and name.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np

from ptcfs.data.source import Source, SourceInfo
from ptcfs.errors import BadDataset

__all__ = ["FilesSource", "class_of", "encode_names", "decode_names"]


def class_of(relpath: str) -> str:
    """The class of a sample: the first folder of its path, or ``""``."""
    head, sep, _ = relpath.partition("/")
    return head if sep else ""


def encode_names(names: list[str]) -> np.ndarray:
    return np.frombuffer(json.dumps(names).encode(), dtype=np.uint8)


def decode_names(raw: bytes) -> list[str]:
    names: list[str] = json.loads(raw.decode())
    return names


class FilesSource(Source):
    """The regular files under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise BadDataset(f"{self.root}: not a directory (--format files ingests a tree "
                             "of files such as <class>/<name>.jpg)")
        names: list[str] = []
        sizes: list[int] = []
        for dirpath, dirs, files in os.walk(self.root, onerror=self._walk_error):
            dirs.sort()
            for f in sorted(files):
                full = Path(dirpath) / f
                rel = full.relative_to(self.root).as_posix()
                try:
                    st = full.stat()
                except OSError as e:
                    raise BadDataset(f"{full}: cannot read it: {e.strerror or e}") from e
                if not stat.S_ISREG(st.st_mode):
                    raise BadDataset(f"{full}: not a regular file; remove it from the tree")
                if any(c in rel for c in "\t\n\r"):
                    raise BadDataset(f"{full}: a tab or line break in the name; rename it")
                if not os.access(full, os.R_OK):
                    raise BadDataset(f"{full}: not readable (permission denied)")
                names.append(rel)
                sizes.append(st.st_size)
        if not names:
            raise BadDataset(f"{self.root}: no files under it")
        self.names = names
        self.info = SourceInfo("files", str(self.root), np.asarray(sizes, dtype=np.int64),
                               extra={"names": encode_names(names)})

    @staticmethod
    def _walk_error(e: OSError) -> None:
        raise BadDataset(f"{e.filename}: cannot list it: {e.strerror or e}") from e

    def read(self, first: int, stop: int) -> bytes:
        out = bytearray()
        for i in range(first, stop):
            path = self.root / self.names[i]
            try:
                data = path.read_bytes()
            except OSError as e:
                raise BadDataset(f"{path}: cannot read it: {e.strerror or e}") from e
            if len(data) != int(self.info.sizes[i]):
                raise BadDataset(f"{path}: changed while being ingested ({len(data)} bytes, "
                                 f"{int(self.info.sizes[i])} when listed)")
            out += data
        return bytes(out)


def open_source(path: str | Path, length_key: str | None = None,
                need_lengths: bool = False) -> FilesSource:
    """The ``files`` row of :data:`ptcfs.data.formats.FORMATS`."""
    return FilesSource(path)
