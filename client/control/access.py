"""Who owns a job and who may change it, from ``ptcctl``'s side.

A job's record says (:class:`~ptcfs.jobstate.JobState`): its ``owner``
(uid, gid) and ``mode``, which the mount shows and enforces on the job's
files, and its ``writers``, the client key names whose requests may
change it (the daemons enforce that; :mod:`ptcfs.server.auth`).

Call order: a job is made with :func:`created_by` (owner: ``--owner`` or
the caller, writers: the caller's client key); :func:`set_access`
(``ptcctl job chown/chmod/allow``) changes the record on every host
holding the job, under the job's lock, after :func:`check_owner`.
"""

from __future__ import annotations

import grp
import os
import pwd
from typing import Any

from ptcfs.errors import InvalidConfig, NotOwner
from ptcfs.jobstate import JobState

__all__ = ["parse_owner", "created_by", "check_owner", "describe_owner"]




def _uid(user: str) -> tuple[int, int]:
    """(uid, primary gid) of a user name or number."""
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        if user.isdigit():
            return int(user), int(user)
        raise InvalidConfig(f"no user {user!r} on this host (give a name or a uid)") from None


def _gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidConfig(f"no group {group!r} on this host (give a name or a gid)") from None


def parse_owner(text: str | None) -> tuple[int, int]:
    """``user[:group]`` (names or numbers) as (uid, gid); the group defaults
    to the user's primary group; None: the caller."""
    if text is None:
        return os.getuid(), os.getgid()
    user, _, group = text.partition(":")
    if not user:
        raise InvalidConfig(f"bad owner {text!r}: give user[:group]")
    uid, gid = _uid(user)
    return uid, (_gid(group) if group else gid)


def describe_owner(owner: tuple[int, int] | None) -> str:
    """``alice:staff`` (numbers where names are unknown); ``-`` for none."""
    if owner is None:
        return "-"
    uid, gid = owner
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return f"{user}:{group}"


def created_by(state: JobState, client_key: str | None) -> JobState:
    """``state`` with the defaults of a job this process makes: owned by the
    caller unless it names an owner, changed only by the caller's client
    key (``client_key``; None: a cluster without keys) unless it names
    writers."""
    changes: dict[str, Any] = {}
    if state.owner is None:
        changes["owner"] = (os.getuid(), os.getgid())
    if not state.writers and client_key is not None:
        changes["writers"] = (client_key,)
    return state.with_(**changes) if changes else state


def check_owner(state: JobState) -> None:
    """NotOwner unless the caller owns the job (or is root)."""
    uid = os.getuid()
    if uid != 0 and state.owner is not None and state.owner[0] != uid:
        raise NotOwner(f"job {state.job!r} is owned by {describe_owner(state.owner)}; only its "
                       "owner or root may change who owns it or may change it")

