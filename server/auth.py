"""Who sent a request, and whether it may change the job it names.

Authentication: the daemon's ZAP handler (:class:`KeyAuthenticator`, a
pyzmq ``ThreadAuthenticator``) admits a CurveZMQ handshake when the
caller's public key is the daemons' own (:data:`~ptcfs.server.net.keys.DAEMON`)
or one of ``DIR/public/NAME.key``, read again at every handshake (so a key
added counts from the next connection on), and names the connection by the
key's name and fingerprint (``NAME/FP``, the z85 key's first characters):
ZeroMQ gives that with every message of the connection as its ``User-Id``
property. A key rotated or removed stops working at once, on connections
already open too: each request's fingerprint is checked against the key
``DIR/public`` holds now (re-read when that folder changes).

Authorisation (:class:`Authorizer`, called by the daemon for each request
before its handler): reads are open to every admitted key; a request that
changes a job (:data:`CHANGES`) is accepted from the daemons, and from a
client key the job's record lists as a writer (its newest version on this
host; ``writers`` empty: every admitted key, as for jobs recorded before
writers were; a job with only a dataset: its dataset's record). A job this
host has no version of may be made by any admitted key. ``<job>@data`` (a
job's dataset) goes by ``<job>``'s record.
Refused requests raise :class:`~ptcfs.errors.NotAllowed`, one line.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ptcfs.data.names import STORE_SUFFIX
from ptcfs.errors import NotAllowed
from ptcfs.server.net.keys import DAEMON, CurveKeys, client_keys
from ptcfs.store.base import TensorStore

__all__ = ["CHANGES", "DAEMON_ONLY", "Authorizer", "KeyAuthenticator", "caller_key",
           "fingerprint", "job_of"]

log = logging.getLogger("ptcd.auth")

#: Operations that change the job their ``job`` argument (or ``record.job``) names.
CHANGES = frozenset({"put", "put_many", "begin_at", "commit", "abort", "delete_version",
                     "delete_job", "stage", "open_save", "repair", "repair_stage", "decide",
                     "forget_decision", "lock_job", "unlock_job", "set_access"})
#: Operations only daemons (and their mounts) may send.
DAEMON_ONLY = frozenset({"pins"})


class KeyAuthenticator(ThreadAuthenticator):
    """The ZAP handler: admits the daemons' key and ``public/*.key``, read
    at each handshake, and names each connection by its key's name."""

    def __init__(self, context: zmq.Context[Any], keys: CurveKeys):
        super().__init__(context, log=log)
        self.keys = keys
        self._names: dict[bytes, str] = {}

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Credentials provider of ``configure_curve_callback`` (z85 key)."""
        names = {v: k for k, v in client_keys(self.keys.public_dir.parent).items()}
        names[self.keys.server_public] = DAEMON  # z85, as load_certificate gives it
        self._names = names
        if client_key not in names:
            log.warning("refused a connection with an unknown key %s",
                        client_key.decode(errors="replace")[:8])
            return False
        return True

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        return f"{self._names.get(key, '?')}/{fingerprint(key)}"

    def begin(self) -> None:
        self.start()
        self.configure_curve_callback(domain="*", credentials_provider=self)


def fingerprint(key: bytes) -> str:
    """A public key's (z85) first characters: tells a rotated key from its successor."""
    return key[:10].decode(errors="replace")


def caller_key(header: Any) -> tuple[str | None, str]:
    """The key name and fingerprint ZeroMQ gives with a request's header
    frame (None and "": no CURVE)."""
    try:
        name, _, fp = str(header.get("User-Id")).partition("/")
    except (zmq.ZMQError, AttributeError):
        return None, ""
    return name, fp


class Authorizer:
    """Checks requests against the jobs' ``writers`` (module docstring)."""

    def __init__(self, store: TensorStore, keys_dir: Path):
        self.store = store
        self.keys_dir = keys_dir
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int | None, tuple[str, ...]]] = {}
        self._current: tuple[float, dict[str, str]] = (-1.0, {})

    def check(self, op: str, args: dict[str, Any], key: str | None, fp: str = "") -> None:
        """NotAllowed unless ``key`` (its fingerprint ``fp``) may send ``op``."""
        if key is None or key == DAEMON:
            return
        if fp and self.fingerprints().get(key) != fp:
            raise NotAllowed(f"client key {key!r} was rotated or removed; connect again with "
                             "its new key")
        if op in DAEMON_ONLY:
            raise NotAllowed(f"{op} is for the cluster's daemons, not client key {key!r}")
        if op not in CHANGES:
            return
        job = job_of(args)
        if job is None:
            if op == "repair":
                return  # restores lost copies of every job: no job's state changes
            raise NotAllowed(f"{op} without a job is for the cluster's daemons, not client "
                             f"key {key!r}")
        writers = self.writers(job)
        if writers and key not in writers:
            name = job.removesuffix(STORE_SUFFIX)
            how = (f"; its owner can run: ptcctl job allow {name} {key}"
                   if self.store.versions(name) else " (a job with only a dataset)")
            raise NotAllowed(f"client key {key!r} may not change job {name!r} (its writers: "
                             f"{', '.join(writers)}){how}")

    def fingerprints(self) -> dict[str, str]:
        """Client key name → the fingerprint of its key in ``public/`` now
        (read again when the folder's mtime changes)."""
        try:
            mtime = (self.keys_dir / "public").stat().st_mtime
        except OSError:
            mtime = -1.0
        with self._lock:
            if mtime == self._current[0]:
                return self._current[1]
        now = {k: fingerprint(v) for k, v in client_keys(self.keys_dir).items()}
        with self._lock:
            self._current = (mtime, now)
        return now

    def writers(self, job: str) -> tuple[str, ...]:
        """The client keys that may change ``job`` (empty: any admitted key)."""
        name = job.removesuffix(STORE_SUFFIX)
        try:
            current = self.store.current(name)
        except Exception:  # a bad name: the handler refuses it
            return ()
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == current and current is not None:
                return hit[1]
        # a job with only a dataset: the dataset's record says (ptcfs.data.record)
        versions = self.store.versions(name) or self.store.versions(name + STORE_SUFFIX)
        committed = [v for v in versions if v.state == "committed"]
        newest = committed or versions
        writers = tuple(str(w) for w in newest[-1].meta.get("writers", ())) if newest else ()
        with self._lock:
            self._cache[name] = (current, writers)
        return writers

    def changed(self, job: str | None) -> None:
        """Forget what is known of ``job`` (after a request changed its record)."""
        if job is not None:
            with self._lock:
                self._cache.pop(job.removesuffix(STORE_SUFFIX), None)


def job_of(args: dict[str, Any]) -> str | None:
    """The job a request's arguments name (``job``, or ``record.job``)."""
    job = args.get("job")
    if job is None and isinstance(args.get("record"), dict):
        job = args["record"].get("job")
    return job if isinstance(job, str) else None
