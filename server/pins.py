"""Versions that readers on this host's mount hold open.

A file opened (or memory-mapped) through the mount keeps reading the
version it opened. The mount tells its host's daemon which versions its
open files belong to (the ``pins`` operation, the whole set: at once when
an open needs a version the daemon does not hold for it, else batched,
ptcfs/fuse/pinning.py); the daemon then keeps those versions:

- ``versions`` reports each version's readers on this host, and the
  coordinator's prune leaves a version that any host reports read;
- ``delete_version`` of a version read here is deferred: the version is
  marked and deleted when its last reader closes (the next ``pins``
  update that leaves it unread), so every caller (prune, dataset
  advances, repair) keeps working unchanged.

A mount is known by its process id; the pins of a mount that is gone
(killed, unmounted) stop counting at the next look. Pins live in the
daemon's memory: a restarted daemon knows the pins of a mount that lived
on (``ptcctl mount``) from its next update, which comes within the
mount's renewal (``RENEW_S``) while it has files open.
"""

from __future__ import annotations

import os
import threading

__all__ = ["Pins"]

Key = tuple[str, int]  # (store job, version)


class Pins:
    """The versions open on this host's mounts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_owner: dict[int, dict[Key, int]] = {}
        self._doomed: set[Key] = set()

    def set(self, owner: int, pins: dict[Key, int]) -> list[Key]:
        """Owner ``owner`` (a mount's pid) holds ``pins`` (version → open
        files); returns the deferred deletions that no reader holds now."""
        with self._lock:
            if pins:
                self._by_owner[owner] = dict(pins)
            else:
                self._by_owner.pop(owner, None)
            return self._released()

    def readers(self, job: str, version: int) -> int:
        """Open files of ``job``'s ``version`` on this host's live mounts."""
        with self._lock:
            self._drop_gone()
            return sum(p.get((job, version), 0) for p in self._by_owner.values())

    def defer(self, job: str, version: int) -> bool:
        """True (and the deletion deferred) if ``version`` has readers here."""
        with self._lock:
            self._drop_gone()
            if any(p.get((job, version), 0) for p in self._by_owner.values()):
                self._doomed.add((job, version))
                return True
            return False

    def doomed(self, job: str, version: int) -> bool:
        with self._lock:
            return (job, version) in self._doomed

    def released(self) -> list[Key]:
        """Deferred deletions whose readers are gone (their mounts died)."""
        with self._lock:
            self._drop_gone()
            return self._released()

    def forget(self, key: Key) -> None:
        with self._lock:
            self._doomed.discard(key)

    def _released(self) -> list[Key]:
        held = {k for p in self._by_owner.values() for k, n in p.items() if n}
        return sorted(self._doomed - held)

    def _drop_gone(self) -> None:
        for owner in [o for o in self._by_owner if not _alive(o)]:
            del self._by_owner[owner]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
