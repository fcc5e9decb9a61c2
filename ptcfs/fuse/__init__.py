"""The ``/ptc`` filesystem: paths, files, reads and writes (mfusepy on libfuse3).

mfusepy picks libfuse2 unless told otherwise, and libfuse2 caps requests at
128 KiB: ``FUSE_LIBRARY_NAME=fuse3`` is set before mfusepy is imported
(an explicit setting in the environment wins).
"""

from __future__ import annotations

import os

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

__all__: list[str] = []
