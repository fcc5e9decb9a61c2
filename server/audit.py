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
from every host by time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from ptcfs import settings
from ptcfs.data.settings import STORE_SUFFIX

__all__ = ["AuditLog", "QUIET"]

log = logging.getLogger("ptcd.audit")

#: Changing operations left out of the trail unless refused: a coordinator's
#: lock, renewed every few seconds while it works.
QUIET = frozenset({"lock_job", "unlock_job"})


class AuditLog:
    """One daemon's trail (module docstring)."""

    def __init__(self, host: str):
        self.host = host
        self._lock = threading.Lock()
        self._rings: dict[str, deque[dict[str, Any]]] = {}

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
        log.info("audit %s", json.dumps(entry, separators=(",", ":")))
        if job is None:
            return
        name = job.removesuffix(STORE_SUFFIX)
        keep = int(settings.get("PTC_AUDIT_KEEP"))
        with self._lock:
            ring = self._rings.get(name)
            if ring is None or ring.maxlen != keep:
                ring = self._rings[name] = deque(ring or (), maxlen=keep)
            ring.append(entry)

    def last(self, job: str, n: int) -> list[dict[str, Any]]:
        """The job's last ``n`` entries on this host, oldest first."""
        with self._lock:
            ring = list(self._rings.get(job.removesuffix(STORE_SUFFIX), ()))
        return ring[-n:] if n > 0 else []


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int(v: Any) -> int | None:
    return v if type(v) is int else None
