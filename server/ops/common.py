"""What every request handler shares: the table of operations and background
tasks, the argument check, and stopping a stage.

A handler module registers its functions with :func:`daemon_op` (one per
operation name) and :func:`daemon_task` (a thread each while the daemon
serves); the daemon imports the modules that :data:`OP_MODULES` names when
it is made, and dispatches by :data:`OPS`. Handlers take the daemon and the
request and return ``(msgpack result, payload buffers)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ptcfs.errors import InvalidRequest
from ptcfs.server.net.wire import Request

__all__ = ["OPS", "OP_MODULES", "TASKS", "Handler", "Reply", "abort_version", "arg",
           "cancel_stage", "daemon_op", "daemon_task"]

log = logging.getLogger("ptcd.ops")

#: A handler's answer: the msgpack result and the payload buffers.
Reply = tuple[Any, list[Any]]
#: ``handler(daemon, request)`` (the daemon is a :class:`ptcfs.server.daemon.Daemon`)
Handler = Callable[[Any, Request], Reply]
#: Every registered operation, by name.
OPS: dict[str, Handler] = {}
#: Background tasks every daemon runs, each in its own thread.
TASKS: list[Callable[[Any], None]] = []
#: The handler modules every daemon serves, one per family of operations.
OP_MODULES = ("ptcfs.server.ops.store", "ptcfs.server.ops.reconfig", "ptcfs.server.ops.save",
              "ptcfs.server.ops.repair", "ptcfs.server.ops.registry", "ptcfs.server.ops.access")
#: Seconds a cancelled stage may take to stop before we log and go on.
JOIN_S = 1.0


def daemon_task(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """Register ``fn(daemon)`` to run in a thread while the daemon serves."""
    if fn not in TASKS:
        TASKS.append(fn)
    return fn


def daemon_op(name: str) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the handler of operation ``name`` (one per name)."""

    def wrap(fn: Handler) -> Handler:
        if name in OPS and OPS[name] is not fn:
            raise ValueError(f"daemon operation {name!r} is registered twice "
                             f"({OPS[name].__module__} and {fn.__module__})")
        OPS[name] = fn
        return fn

    return wrap


def arg(req: Request, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Argument ``name`` of a request, checked to be of ``kind`` (a bool is
    not an int); ``default`` when absent, else InvalidRequest."""
    if name not in req.args:
        if default is ...:
            raise InvalidRequest(f"{req.op}: missing argument {name!r}")
        return default
    value = req.args[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise InvalidRequest(f"{req.op}: argument {name!r} must be {want}, "
                             f"not {type(value).__name__}")
    return value


def cancel_stage(d: Any, job: str, version: int) -> None:
    """Stop a stage of (job, version) and forget it (called by ``abort``
    and ``delete_job``): on return none of its puts runs or will run."""
    sj = d.stages.pop((job, version), None)
    if sj is None:
        return
    sj.cancel.cancel()
    if not sj.ended.wait(JOIN_S):
        log.warning("the cancelled stage of %s version %d is still stopping", job, version)


def abort_version(d: Any, job: str, version: int) -> None:
    """Drop a staging version, cancelling a stage of it that still runs."""
    cancel_stage(d, job, version)
    d.store.abort(job, version)
