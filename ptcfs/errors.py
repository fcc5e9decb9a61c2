"""The errors ptcfs raises, and the one place that maps them to errno.

Every error subclasses :class:`PtcError` and a builtin, so callers that
know nothing of ptcfs still catch them sensibly (``except KeyError``).
"""

from __future__ import annotations

import errno

__all__ = [
    "PtcError",
    "InvalidConfig",
    "InvalidRequest",
    "JobNotFound",
    "VersionNotFound",
    "TensorNotFound",
    "VersionImmutable",
    "StoreError",
    "PeerError",
    "Overloaded",
    "StateLost",
    "Cancelled",
    "to_errno",
]


class PtcError(Exception):
    """Base of every error ptcfs raises on purpose."""


class InvalidConfig(PtcError, ValueError):
    """A parallel configuration, model or host list that cannot work."""


class InvalidRequest(PtcError, ValueError):
    """A malformed request: a bad path, slice, argument or wire message."""


class JobNotFound(PtcError, FileNotFoundError):
    """No job of that name."""


class VersionNotFound(PtcError, FileNotFoundError):
    """The job has no such version (or it is not committed)."""


class TensorNotFound(PtcError, FileNotFoundError):
    """No sub-tensor under that (job, version, tensor, slice)."""


class VersionImmutable(PtcError, PermissionError):
    """A committed version cannot be written to."""


class StoreError(PtcError, OSError):
    """The store failed (full, corrupt, locked)."""


class StateLost(PtcError, RuntimeError):
    """Some state has no surviving copy: every host that held it is gone."""


class PeerError(PtcError, ConnectionError):
    """A peer daemon did not answer (``timed_out``), or answered with an error."""

    def __init__(self, message: str = "", timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class JobBusy(PtcError, BlockingIOError):
    """Another coordinator holds the job's lock (the message names it), or
    this one lost it: nothing was changed by this one. Also a save's write
    into a version a reconfiguration took over (EAGAIN at the mount)."""


class Cancelled(PtcError, InterruptedError):
    """Work stopped half-way because it was cancelled (a stage that an ``abort`` ended)."""


class Overloaded(PtcError, BlockingIOError):
    """A daemon holds as many request bytes as it may (``PTC_DAEMON_INFLIGHT_BYTES``,
    ``PTC_DAEMON_PEER_INFLIGHT_BYTES``) and refused this one: try again later."""


_ERRNO: tuple[tuple[type[BaseException], int], ...] = (
    (InvalidConfig, errno.EINVAL),
    (InvalidRequest, errno.EINVAL),
    (FileNotFoundError, errno.ENOENT),
    (PermissionError, errno.EACCES),
    (PeerError, errno.EIO),
    (Overloaded, errno.EAGAIN),
    (JobBusy, errno.EAGAIN),  # a save a reconfiguration dropped: write it again
    (StoreError, errno.EIO),
    (ValueError, errno.EINVAL),
    (KeyError, errno.ENOENT),
)


def to_errno(exc: BaseException) -> int:
    """The errno a filesystem reports for ``exc`` (EIO when unknown)."""
    if isinstance(exc, OSError) and exc.errno and not isinstance(exc, PtcError):
        return exc.errno
    for kind, code in _ERRNO:
        if isinstance(exc, kind):
            return code
    return errno.EIO
