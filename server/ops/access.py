"""Daemon operation ``set_access``: who owns a job and who may change it.

``set_access`` (job, changes) merges ``changes`` — any of ``owner``
(``[uid, gid]``), ``mode`` (permission bits) and ``writers`` (client key
names) — into the record of every version of the job on this host, staging
ones too, so that a save or a reconfiguration under way keeps them. The
mount reads them at each lookup (:meth:`ptcfs.fuse.tree.Catalog.access`).
``ptcctl job chown/chmod/allow`` call it on every host
(:meth:`ptcfs.client.control.coordinator.Coordinator.set_access`).

``audit`` (job, last) answers this host's last ``last`` entries of the job's
audit trail (:mod:`ptcfs.server.audit`), oldest first.
"""

from __future__ import annotations

from typing import Any

from ptcfs.errors import InvalidRequest
from ptcfs.jobstate import ACCESS_KEYS, check_mode
from ptcfs.server.daemon import Daemon
from ptcfs.server.net.wire import Request
from ptcfs.server.ops.common import arg, daemon_op

__all__ = ["check_access"]


def check_access(changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` if every key is one of ACCESS_KEYS with a valid value,
    else InvalidRequest."""
    unknown = sorted(set(changes) - set(ACCESS_KEYS))
    if unknown:
        raise InvalidRequest(f"set_access: unknown keys {', '.join(unknown)} "
                             f"(known: {', '.join(ACCESS_KEYS)})")
    owner = changes.get("owner")
    if "owner" in changes and not (isinstance(owner, list) and len(owner) == 2 and
                                   all(type(n) is int and n >= 0 for n in owner)):
        raise InvalidRequest("set_access: owner must be [uid, gid]")
    if "mode" in changes:
        check_mode(changes["mode"])
    writers = changes.get("writers", [])
    if not (isinstance(writers, list) and all(isinstance(w, str) and w for w in writers)):
        raise InvalidRequest("set_access: writers must be a list of client key names")
    return changes


@daemon_op("set_access")
def set_access(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    job = arg(req, "job", str)
    changes = check_access(arg(req, "changes", dict))
    return {"versions": d.store.update_meta(job, changes)}, []


@daemon_op("audit")
def audit(d: Daemon, req: Request) -> tuple[Any, list[Any]]:
    last = arg(req, "last", int, 100)
    if last < 0:
        raise InvalidRequest(f"audit: last must be >= 0, not {last}")
    return d.audit.last(arg(req, "job", str), last), []
