"""What the mount has done, counted: opens, reads and their bytes, lookups.

One :class:`Tally` per mount, shared by the filesystem and its read
server; the warmer writes it into ``mount.json`` with its own state, from
where ``ptcd``'s metrics read it (:mod:`ptcfs.server.metrics`).
"""

from __future__ import annotations

import threading

__all__ = ["Tally"]


class Tally:
    """Named counts, added to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
