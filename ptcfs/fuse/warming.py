"""Reading committed files into the page cache in the background.

Committed files never change, so the kernel keeps their pages from open to
open (see :mod:`ptcfs.fuse.fs`). A :class:`Warmer` fills that cache before
anyone asks: a separate process (``cat``) reads queued files through the
mount, one batch at a time, and is paused (SIGSTOP) while any other process
has a file open through the mount, so that it never slows a reader down.
A thread of the mount process reading its own mount could hold the mount
up forever if that process stopped; a child process cannot.

:func:`watch_commits` queues the ``tensors/`` files of each job's current
version that are at least ``PTC_MOUNT_WARM_MIN_BYTES`` big (8 MiB; smaller
ones fill the cache at their first read anyway) and whose bytes are all in
this host's store, largest first, when the mount starts and whenever a new
version is committed, within ``PTC_MOUNT_WARM_BYTES`` bytes for all jobs
together (a quarter of the host's memory by default; 0 turns it off). Files
with pieces on other hosts are left alone: reading them would pull the
state across the network. The warmer writes its state to
``<store>/mount.json``, which ``ptcd``'s health reports, so that scripts
and tests can wait for a version to be warm, with the mount's counts of
opens and reads (rewritten at most every WATCH_S while they change), which
``ptcd``'s metrics report.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ptcfs import settings
from ptcfs.errors import PtcError
from ptcfs.fuse.paths import NPY
from ptcfs.fuse.tree import Catalog, File, JobView, local_to

__all__ = ["Warmer", "watch_commits", "warm_budget", "read_status", "status_path"]

log = logging.getLogger("ptcfs.mount")

#: Files per warming process (its command line holds their paths).
BATCH_FILES = 256
#: How often the store is checked for new versions, in seconds.
WATCH_S = 1.0


def warm_budget() -> int:
    """Bytes of current versions to read into the page cache at commit
    (``PTC_MOUNT_WARM_BYTES``)."""
    return int(settings.get("PTC_MOUNT_WARM_BYTES"))


def status_path(store: str | Path) -> Path:
    """Where the mount of the host whose store is at ``store`` writes its state."""
    return Path(store) / "mount.json"


def read_status(store: str | Path) -> dict[str, Any] | None:
    """The warming state of a running mount of the host whose store is at
    ``store``, else None."""
    try:
        doc = json.loads(status_path(store).read_text())
        os.kill(int(doc["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return doc if isinstance(doc, dict) else None


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        p.send_signal(sig)
    except OSError:  # gone meanwhile
        pass


class Warmer:
    """Reads queued files of ``mount`` into the page cache, one process at a
    time, only while no other process has a file open through the mount."""

    def __init__(self, mount: Path, status: Path | None = None,
                 counts: Callable[[], dict[str, int]] | None = None):
        self.mount = mount
        self.status_file = status
        #: what the mount counts (its Tally), written into the status too
        self.counts = counts
        self._published: dict[str, int] | None = None
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, int]] = deque()
        self._queued: set[str] = set()
        self._done: set[str] = set()
        self._read: set[str] = set()  # queued by a reader's close
        self._done_bytes = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._batch: list[tuple[str, int]] = []
        self._foreground = 0
        self._stopped = False
        self._versions: dict[str, int] = {}  # job -> the version queued last
        self._thread = threading.Thread(target=self._run, name="mount-warm", daemon=True)
        self._thread.start()
        self._write_status()

    # --- for the filesystem ------------------------------------------------------
    def use_cache(self, path: str) -> bool:
        """True once ``path`` has been read into the page cache, or read by
        a reader (whose close queued it): later opens read through the
        cache, as a reader that opens a file twice (to map it) expects."""
        with self._cond:
            return path in self._done or path in self._read

    def want(self, files: list[tuple[str, int]], read: bool = False,
             version: tuple[str, int] | None = None) -> None:
        """Queue ``files`` (``(path, size)``) but those cached or queued
        already; ``read``: a reader has just read them; ``version``: they
        are those of ``(job, version)`` (for the status)."""
        with self._cond:
            if version is not None:
                self._versions[version[0]] = version[1]
            for path, size in files:
                if read:
                    self._read.add(path)
                if self._stopped or path in self._done or path in self._queued:
                    continue
                self._queued.add(path)
                self._queue.append((path, size))
                if self._foreground:
                    log.info("will fill the cache with %s once no file is open", path)
            self._cond.notify_all()
        self._write_status()

    def version(self, job: str) -> int | None:
        """The version of ``job`` queued last."""
        with self._cond:
            return self._versions.get(job)

    def is_warmer(self, pid: int) -> bool:
        with self._cond:
            return self._proc is not None and self._proc.pid == pid

    def opened(self) -> None:
        """Another process opened a file: the first such open pauses the warmer."""
        with self._cond:
            self._foreground += 1
            if self._foreground == 1 and self._proc is not None:
                _signal(self._proc, signal.SIGSTOP)

    def closed(self) -> None:
        """The last other open file closed: resume."""
        with self._cond:
            self._foreground -= 1
            if self._foreground == 0:
                if self._proc is not None:
                    _signal(self._proc, signal.SIGCONT)
                self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._cond:
            pending = [*self._batch, *self._queue]
            return {"pid": os.getpid(), "warming": bool(pending),
                    "paused": bool(pending) and self._foreground > 0,
                    "pending_files": len(pending), "pending_bytes": sum(s for _, s in pending),
                    "cached_files": len(self._done), "cached_bytes": self._done_bytes,
                    "versions": dict(self._versions),
                    "counters": self.counts() if self.counts is not None else {}}

    def publish(self) -> None:
        """Write the status again if the mount's counts changed since."""
        if self.counts is not None and self.counts() != self._published:
            self._write_status()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._queue.clear()
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
            self._cond.notify_all()
        self._thread.join(10)
        if self.status_file is not None:
            self.status_file.unlink(missing_ok=True)

    # --- the warming thread --------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._queue or self._foreground):
                    self._cond.wait()
                if self._stopped:
                    return
                batch = [self._queue.popleft()
                         for _ in range(min(BATCH_FILES, len(self._queue)))]
                log.info("filling the cache with %s", ", ".join(p for p, _ in batch))
                try:
                    proc = subprocess.Popen(
                        ["cat", "--", *(f"{self.mount}{p}" for p, _ in batch)],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
                except OSError as e:
                    log.warning("not filling the cache: %s", e)
                    self._finish(batch)
                    continue
                self._proc, self._batch = proc, batch
            rc = proc.wait()
            if rc and not self._stopped:
                log.info("filling the cache ended with status %d", rc)
            with self._cond:
                self._proc, self._batch = None, []
                self._finish(batch)  # a file that could not be read is not retried
            self._write_status()

    def _finish(self, batch: list[tuple[str, int]]) -> None:
        for p, size in batch:
            self._queued.discard(p)
            self._done.add(p)
            self._done_bytes += size

    def _write_status(self) -> None:
        if self.status_file is None:
            return
        tmp = self.status_file.with_name(self.status_file.name + ".tmp")
        status = self.status()
        self._published = status["counters"]
        try:
            tmp.write_text(json.dumps(status) + "\n")
            tmp.replace(self.status_file)
        except OSError as e:
            log.debug("cannot write %s: %s", self.status_file, e)


def local_files(jv: JobView, host: str, min_bytes: int = 0) -> list[tuple[str, int]]:
    """The ``tensors/`` files of a job's version of at least ``min_bytes``
    whose bytes are all in ``host``'s store, as ``(path, size)``, largest
    first."""
    job, v = jv.state.job, jv.state.version
    out = []
    for name in jv.specs:
        item: File = jv.tensor_file(name, None)
        if item.size >= min_bytes and local_to(item, host):
            out.append((f"/{job}/versions/{v}/tensors/{name}{NPY}", item.size))
    return sorted(out, key=lambda f: (-f[1], f[0]))


def watch_commits(catalog: Catalog, host: str, warmer: Warmer, budget: int, min_bytes: int,
                  stop: threading.Event) -> None:
    """Queue each job's current version for warming when first seen (see the
    module docstring): its local files of at least ``min_bytes`` (smaller
    ones fill the cache at their first read anyway); returns when ``stop``
    is set."""
    held: dict[str, int] = {}  # job -> bytes queued for its current version
    while True:
        try:
            jobs = catalog.jobs()
        except PtcError as e:
            log.warning("cannot list the store's jobs: %s", e)
            jobs = []
        for job in jobs:
            try:
                jv = catalog.view(job, None)
                if warmer.version(job) == jv.state.version:
                    continue
                files = local_files(jv, host, min_bytes)
            except PtcError:  # a dataset-only job, or deleted meanwhile
                continue
            room = budget - sum(b for j, b in held.items() if j != job)
            chosen = []
            for path, size in files:
                if size <= room:
                    chosen.append((path, size))
                    room -= size
            held[job] = sum(size for _, size in chosen)
            warmer.want(chosen, version=(job, jv.state.version))
        warmer.publish()
        if stop.wait(WATCH_S):
            return
