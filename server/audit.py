"""The audit trail: every request that changes a job, as one JSON line.

The daemon calls :meth:`AuditLog.record` once per request of
:data:`~ptcfs.server.auth.CHANGES` (granted locks aside), after it was
answered or refused. The entry says when (``t``, Unix seconds), where
(``host``), who (``key``: the CurveZMQ key's name, ``@daemon`` for the
daemons and their mounts, None without keys; ``caller``: the host id the
request gives; ``uid`` and ``rank``: the local user and rank of a save
through a mount), what (``op``, ``job``, ``version``, ``tensor``, ``part``,
``bytes`` of payload) and how it went (``error``: None, or why it was
refused or failed). It goes to the daemon's log as ``audit {json}`` (logger
``ptcd.audit``) and into a ring of the last ``PTC_AUDIT_KEEP`` entries per
job, which the ``audit`` operation answers and ``ptcctl audit JOB`` merges
from every host by time. The entries are also appended to ``audit.jsonl``
in the store's folder (mode 0600), from which a restarted daemon fills its
rings again; at start the file is cut down to what the rings keep once it
holds more than twice that.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from ptcfs import settings
from ptcfs.data.names import STORE_SUFFIX

__all__ = ["AuditLog", "QUIET"]

log = logging.getLogger("ptcd.audit")

#: Changing operations left out of the trail unless refused: a coordinator's
#: lock, renewed every few seconds while it works.
QUIET = frozenset({"lock_job", "unlock_job"})


class AuditLog:
    """One daemon's trail (module docstring)."""

    def __init__(self, host: str, path: Path | None = None):
        self.host = host
        self._lock = threading.Lock()
        self._rings: dict[str, deque[dict[str, Any]]] = {}
        self._file: IO[str] | None = None
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        """Fill the rings from ``path``, cut it down if it grew, and append to it."""
        keep = int(settings.get("PTC_AUDIT_KEEP"))
        lines = 0
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    lines += 1
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by a crash
                    if isinstance(entry, dict) and isinstance(entry.get("job"), str):
                        self._ring(entry["job"].removesuffix(STORE_SUFFIX), keep).append(entry)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not read the audit trail %s: %s", path, e)
        kept = sum(len(r) for r in self._rings.values())
        try:
            if lines > 2 * kept:
                tmp = path.with_name(path.name + ".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as out:
                    for entry in sorted((e for r in self._rings.values() for e in r),
                                        key=lambda e: e.get("t", 0)):
                        out.write(json.dumps(entry, separators=(",", ":")) + "\n")
                tmp.replace(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "a", buffering=1)  # a line at a time
        except OSError as e:
            log.warning("the audit trail is kept in memory only: %s", e)

    def _ring(self, name: str, keep: int) -> deque[dict[str, Any]]:
        ring = self._rings.get(name)
        if ring is None or ring.maxlen != keep:
            ring = self._rings[name] = deque(ring or (), maxlen=keep)
        return ring

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def record(self, op: str, args: dict[str, Any], job: str | None, key: str | None,
               caller: str, nbytes: int, error: str | None) -> None:
        if op in QUIET and error is None:
            return
        version = args.get("version", args.get("new_version"))
        entry = {"t": round(time.time(), 6), "host": self.host, "key": key, "caller": caller,
                 "op": op, "job": job, "version": version if type(version) is int else None,
                 "tensor": _text(args.get("tensor")), "part": _text(args.get("part")),
                 "uid": _int(args.get("uid")), "rank": _int(args.get("rank")),
                 "bytes": nbytes, "error": error}
        line = json.dumps(entry, separators=(",", ":"))
        log.info("audit %s", line)
        if job is None:
            return
        name = job.removesuffix(STORE_SUFFIX)
        keep = int(settings.get("PTC_AUDIT_KEEP"))
        with self._lock:
            self._ring(name, keep).append(entry)
            if self._file is not None:
                try:
                    self._file.write(line + "\n")
                except OSError as e:
                    log.warning("could not append to the audit trail: %s", e)

    def last(self, job: str, n: int) -> list[dict[str, Any]]:
        """The job's last ``n`` entries on this host, oldest first."""
        with self._lock:
            ring = list(self._rings.get(job.removesuffix(STORE_SUFFIX), ()))
        return ring[-n:] if n > 0 else []


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int(v: Any) -> int | None:
    return v if type(v) is int else None
