"""The errors ptcfs raises, and the one place that maps them to errno.

Every error subclasses :class:`PtcError` and a builtin, so callers that
know nothing of ptcfs still catch them sensibly (``except KeyError``).
The exit statuses of ``ptcctl`` and ``ptcd`` are here too (:data:`EXIT_CODES`).
"""

from __future__ import annotations

import errno

__all__ = [
    "BadDataset",
    "DatasetExists",
    "NotOwner",
    "IncompleteSave",
    "TorchMissing",
    "WorkerError",
    "NoSession",
    "CheckpointError",
    "HostFailures",
    "PtcError",
    "InvalidConfig",
    "InvalidRequest",
    "NotAllowed",
    "JobNotFound",
    "VersionNotFound",
    "VersionNotCommitted",
    "TensorNotFound",
    "VersionImmutable",
    "StoreError",
    "PeerError",
    "Overloaded",
    "StateLost",
    "Cancelled",
    "BadInput",
    "to_errno",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_CODES",
    "exit_code",
]


class PtcError(Exception):
    """Base of every error ptcfs raises on purpose."""


class InvalidConfig(PtcError, ValueError):
    """A parallel configuration, model or host list that cannot work."""


class InvalidRequest(PtcError, ValueError):
    """A malformed request: a bad path, slice, argument or wire message."""


class BadInput(InvalidRequest):
    """What the command line gives cannot work, whatever the cluster holds: a
    value checked at the door (a slice, a flag that contradicts another), or an
    input file that is not valid (a dataset, a checkpoint). Exit status 2."""


class JobNotFound(PtcError, FileNotFoundError):
    """No job of that name."""


class VersionNotFound(PtcError, FileNotFoundError):
    """The job has no such version (or it is not committed)."""


class VersionNotCommitted(VersionNotFound):
    """The version is staging on that host: a stage, a roll-forward or a
    save under way. Its bytes are not the version's until it is committed."""


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


class NotAllowed(PtcError, PermissionError):
    """The caller's key may not do this: change a job whose writers it is not
    among, or send an operation only daemons send."""



class HostFailures(PtcError, RuntimeError):
    """Some hosts failed their part; ``failures`` maps host → message."""

    def __init__(self, what: str, failures: dict[str, str]):
        self.failures = failures
        lines = "; ".join(f"{h}: {m}" for h, m in sorted(failures.items()))
        super().__init__(f"{what} failed on {len(failures)} host(s): {lines}")


class BadDataset(BadInput):
    """The input is not a valid dataset of its format; the message names the
    file and the offending record (``ptcctl`` exits 2)."""


class DatasetExists(PtcError, FileExistsError):
    """The job has a dataset already."""


class NotOwner(InvalidConfig, PermissionError):
    """The caller neither owns the job nor is root."""


class IncompleteSave(PtcError, ValueError):
    """Some sub-tensors of the configuration were not written."""


class TorchMissing(PtcError, ImportError):
    """torch is not installed."""


class WorkerError(PtcError, RuntimeError):
    """A collective ptcfs step failed on one worker (named in the message)."""


class NoSession(PeerError):
    """The daemon does not know the session (it restarted): open another."""


class CheckpointError(BadInput):
    """A checkpoint that cannot be read or does not fit the model (``ptcctl``
    exits 2: the input is bad, whatever the cluster holds)."""


#: Exit statuses of ``ptcctl`` and ``ptcd`` (``docs/cluster.md``'s "Exit codes" lists the same).
EXIT_OK = 0
#: The command was well formed but the work failed: a host down or failing, a
#: store full, no such job, version or tensor, a lock held, a refusal because of
#: what the cluster holds; also ``verify`` finding problems and ``suggest``
#: finding no mesh that fits.
EXIT_FAILED = 1
#: The command line cannot work and nothing was done: an unknown command or
#: option, a missing or bad argument, a value that cannot work (mesh, model,
#: hosts, job name, slice, size, cluster file, a ``PTC_*`` setting), an input
#: file that is not valid (:class:`InvalidConfig`, :class:`BadInput`).
EXIT_USAGE = 2
#: Stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done (a reconfiguration whose commit is done, with warnings, included)",
    EXIT_FAILED: "the work failed: a host, the store, or what the cluster holds",
    EXIT_USAGE: "the command line cannot work: a bad argument, value or input file",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_code(exc: BaseException) -> int:
    """The exit status for an error that ended a command."""
    if isinstance(exc, (InvalidConfig, BadInput)):
        return EXIT_USAGE
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_FAILED


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
