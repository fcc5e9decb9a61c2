"""The versions this mount's open files read, told to the host's daemon
(the ``pins`` operation, the whole set each time: server/pins.py).

The daemon must hear of a version before an open of one of its files
returns, else it could delete the version under the reader; that is the
only update sent at once, and only when the daemon does not hold the
version for this mount already. Everything else (the count of open files
of a version held, a version whose last file closed) goes out batched, by
a thread of its own, :data:`FLUSH_S` after the first change: a loader that
opens and closes the files of one version one after another sends no
request per file, and a version whose last file closed is let go a moment
later. Every update carries the whole set, so the daemon's view is the
mount's as it was when the update left.

While files are open the set is also sent again every :data:`RENEW_S`,
changed or not: a daemon restarted under a mount that lives on (``ptcctl
mount``) knows its readers again within that, with no open or close needed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ptcfs.errors import PtcError

__all__ = ["FLUSH_S", "RENEW_S", "Key", "OpenVersions", "Pin"]

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (store job, version)
#: Sends the whole set ``{(store job, version): open files}`` to the daemon.
Pin = Callable[[dict[Key, int]], None]
#: Seconds an update that protects nothing new waits for the changes after it.
FLUSH_S = 0.1
#: Seconds between two updates while files are open and nothing changes.
RENEW_S = 1.0


class OpenVersions:
    """Open files per version, and the set the daemon holds for them."""

    def __init__(self, tell: Pin, flush_s: float = FLUSH_S, renew_s: float = RENEW_S):
        self._tell = tell
        self._flush_s = flush_s
        self._renew_s = renew_s
        self._lock = threading.Lock()  # the counts
        self._counts: dict[Key, int] = {}
        self._send = threading.Lock()  # updates go out one at a time, in order
        self._told: frozenset[Key] = frozenset()  # what the daemon holds (under _send)
        self._failing = False  # the last update failed (warned once until one goes out)
        self._dirty = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._flusher, name="mount-pins", daemon=True)
        self._thread.start()

    def opened(self, key: Key) -> None:
        """A file of ``key`` was opened: returns once the daemon holds ``key``."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
        with self._send:
            if key not in self._told:
                self._flush()
                return
        self._dirty.set()

    def closed(self, key: Key) -> None:
        """A file of ``key`` was closed (told with the next batch)."""
        with self._lock:
            n = self._counts.get(key, 0) - 1
            if n > 0:
                self._counts[key] = n
            else:
                self._counts.pop(key, None)
        self._dirty.set()

    def counts(self) -> dict[Key, int]:
        with self._lock:
            return dict(self._counts)

    def stop(self) -> None:
        self._stopping.set()
        self._dirty.set()
        self._thread.join(5.0)

    def _flusher(self) -> None:
        while True:
            if not self._dirty.wait(self._renew_s):
                if self.counts():  # idle with files open: again, for a restarted daemon
                    with self._send:
                        self._flush()
                continue
            if self._stopping.wait(self._flush_s):
                return
            self._dirty.clear()
            with self._send:
                self._flush()

    def _flush(self) -> None:
        """Send the whole set (under ``_send``, so that no open checks what
        the daemon holds while an update that may drop it is on its way)."""
        held = self.counts()
        try:
            self._tell(held)
        except PtcError as e:
            if not self._failing:
                log.warning("could not tell the daemon which versions are open: %s", e)
            self._failing = True
            self._dirty.set()  # tried again with the next batch
            return
        self._failing = False
        self._told = frozenset(held)
