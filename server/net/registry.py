"""The cluster's registry: which hosts exist and are up, who may change a
job now, and what was decided about a job's reconfiguration.

One interface, :class:`Registry`, two backends picked by the cluster file
(:func:`open_registry`); daemon and coordinator code never asks which:

- :class:`FileRegistry` (no ``registry =`` key): the file's hosts, in the
  file's order, up as far as the registry knows (``up`` is None: ask them).
  A job's lock is held on a *majority* of the file's hosts (``lock_job`` on
  each daemon, with a lease the coordinator renews): two coordinators can
  never both hold a majority, and a minority of hosts down does not block
  it. While half the hosts or more do not answer (a cluster that lost
  hosts, to be reconfigured or repaired without them), it is held on every
  host that answers: still exclusive between coordinators that reach a
  common host, not across a network split that leaves them none (use etcd
  for that). A daemon that restarts forgets the locks it granted, so the
  lock is sound while no majority restarts within a lock's lease. Decisions are
  not atomic here (``atomic`` is False): the coordinator sends its decision
  to every host (``decide``) before any commit, and a host that has it
  commits itself; no daemon aborts on its own.
- :class:`EtcdRegistry` (``registry = "etcd://HOST:PORT"``), keys under
  ``/ptcfs/``:

  ``hosts/NAME``      the host's spec (JSON), kept for good: the cluster's
                      host order is the order these keys were created in
  ``alive/NAME``      under the host's lease (``PTC_REGISTRY_TTL_S``),
                      renewed by its daemon: no key, the host is down
  ``locks/JOB``       the coordinator holding the job (``ptcctl pid N on
                      HOST``), under its lease (``PTC_LOCK_TTL_S``)
  ``decisions/JOB``   the last decision: job, old and new version, hosts,
                      the new version's record and ``"decision": "commit"``,
                      written in one transaction that also checks the writer
                      still holds the lock

The decision protocol (called by :mod:`ptcfs.client.control.coordinator`, served by
the daemons' reconciler in :mod:`ptcfs.server.ops.registry`):

1. the coordinator takes the job's lock (:meth:`Registry.lock`) and keeps
   it until it is done;
2. every host stages the new version; then the coordinator records the
   decision (:meth:`Registry.decide`), and only then any host commits;
3. a coordinator that dies after step 2 leaves a decision: every daemon
   with that version staging commits it itself, and the next command's
   :meth:`Coordinator.state` does the same for hosts that were down;
4. a coordinator that dies before step 2 leaves none: with an atomic
   registry, each daemon aborts its staging version once no one holds the
   lock; otherwise the next command aborts it (it always did).
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ptcfs import settings
from ptcfs.errors import JobBusy, NotAllowed, PeerError, PtcError, StoreError
from ptcfs.server.net.cluster import ClusterSpec, HostSpec, cluster_from_source
from ptcfs.server.net.keys import CurveKeys, load_keys
from ptcfs.server.net.peer import PeerClient, on_each

__all__ = ["Member", "JobLock", "Registry", "FileRegistry", "EtcdRegistry", "open_registry",
           "holder_name", "resolve", "load_decisions", "save_decisions"]

log = logging.getLogger("ptcfs.registry")

_PREFIX = "/ptcfs/"
#: Seconds one call to etcd (or to a daemon, for a file registry's lock) may take.
CALL_TIMEOUT_S = 3.0
_RETRY_S = (0.05, 0.25)


@dataclass(frozen=True)
class Member:
    """A host of the cluster and whether it is up (None: the registry does not know)."""

    host: HostSpec
    up: bool | None


def holder_name() -> str:
    """Who takes a lock: ``ptcctl pid N on HOST (lock TOKEN)``, the token
    new at each call, so that two coordinators of one process differ too."""
    return f"ptcctl pid {os.getpid()} on {socket.gethostname()} (lock {secrets.token_hex(3)})"


class JobLock:
    """A held lock of lease ``ttl_s``; renewed from a thread every third of
    it until :meth:`release`. ``lost`` is set when a renewal is refused,
    or when none has been answered and the lease may run out before the
    next try (the holder must not record a decision): one renewal that no
    host answers (a loaded machine, a daemon slow to answer) is tried
    again while the lease still holds."""

    def __init__(self, job: str, holder: str, renew: Any, release: Any, ttl_s: float):
        self.job, self.holder = job, holder
        self.lost = threading.Event()
        self._renew, self._release = renew, release
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._keep, args=(ttl_s,),
                                        name=f"lock-{job}", daemon=True)
        self._thread.start()

    def _keep(self, ttl_s: float) -> None:
        every_s = ttl_s / 3
        held_until = time.monotonic() + ttl_s
        while not self._done.wait(every_s):
            try:
                asked = time.monotonic()
                if not self._renew():
                    self.lost.set()
                    return
                held_until = asked + ttl_s
            except PtcError as e:
                log.warning("could not renew the lock of %s: %s", self.job, e)
                if time.monotonic() + every_s >= held_until:
                    self.lost.set()
                    return

    def release(self) -> None:
        self._done.set()
        self._thread.join()
        try:
            self._release()
        except PtcError as e:  # it expires on its own
            log.warning("could not release the lock of %s: %s", self.job, e)

    def __enter__(self) -> JobLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Registry(Protocol):
    """What daemons and coordinators ask of the cluster's registry."""

    #: decisions are recorded in one atomic step (daemons may abort undecided stages)
    atomic: bool

    def members(self) -> list[Member]:
        """Every host that ever joined (or the file's hosts), in cluster order."""
        ...

    def join(self, host: HostSpec) -> None:
        """Register this daemon's host and keep it up until :meth:`close`."""
        ...

    def lock(self, job: str, holder: str, wait_s: float | None = None) -> JobLock:
        """Take the job's lock, waiting at most ``wait_s`` (``PTC_LOCK_WAIT_S``);
        :class:`JobBusy` naming the holder if it stays taken."""
        ...

    def holder(self, job: str) -> str | None:
        """Who holds the job's lock now (None: no one)."""
        ...

    def decide(self, job: str, record: dict[str, Any], lock: JobLock) -> None:
        """Record the decision on a job (step 2 above); JobBusy if ``lock`` was lost."""
        ...

    def decision(self, job: str) -> dict[str, Any] | None:
        """The job's last recorded decision (None: none, or not kept here)."""
        ...

    def forget(self, job: str) -> None:
        """Drop the job's decision (the job is deleted)."""
        ...

    def close(self) -> None: ...


def open_registry(spec: ClusterSpec, keys: CurveKeys | None = None) -> Registry:
    """The registry a cluster file names (its hosts when it names none);
    ``keys``: what this process calls daemons with (default: its client key)."""
    if spec.registry is None:
        return FileRegistry(spec, keys)
    return EtcdRegistry(spec.registry)


def resolve(spec: ClusterSpec, registry: Registry) -> tuple[ClusterSpec, set[str]]:
    """``spec`` with the registry's hosts, and the names of those known down."""
    if spec.registry is None:
        return spec, set()
    members = registry.members()
    if not members:
        raise PeerError(f"no host has joined the registry {spec.registry} yet: start "
                        "ptcd with --host-id, --address, --store and --gpus")
    checked = cluster_from_source(_Hosts(tuple(m.host for m in members)), spec.replicas,
                                  spec.curve_dir, spec.path, spec.registry)
    return replace(checked, insecure=spec.insecure), {m.host.name for m in members
                                                      if m.up is False}


class _Hosts:
    def __init__(self, hosts: tuple[HostSpec, ...]):
        self._hosts = hosts

    def hosts(self) -> tuple[HostSpec, ...]:
        return self._hosts


def decisions_file(store: Path) -> Path:
    return Path(store) / "decisions.json"


def load_decisions(store: Path) -> dict[str, dict[str, Any]]:
    """This host's recorded decisions ({} when none or unreadable)."""
    try:
        data = json.loads(decisions_file(store).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_decisions(store: Path, decisions: dict[str, dict[str, Any]],
                   job: str | None = None) -> None:
    """Write this host's decisions (atomically: the old file stays whole on
    failure); StoreError naming ``job``'s decision if the file cannot be written."""
    f = decisions_file(store)
    tmp = f.with_name(f.name + ".tmp")
    try:
        tmp.write_text(json.dumps(decisions))
        tmp.replace(f)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        what = f"the decision of job {job!r}" if job else "decisions"
        raise StoreError(f"cannot record {what} in {f}: {e.strerror or e} (free room on "
                         "the store's filesystem)") from e


# --- the cluster file ---------------------------------------------------------------
class FileRegistry:
    """The file's hosts; job locks held on a majority of their daemons (or
    on every one that answers, while fewer than a majority do)."""

    atomic = False

    def __init__(self, spec: ClusterSpec, keys: CurveKeys | None = None):
        self.spec = spec
        self._keys = keys or (load_keys(spec.curve_dir) if spec.curve_dir else None)
        self._peers: dict[str, PeerClient] = {}

    def _peer(self, host: HostSpec) -> PeerClient:
        """A client that gives up on a host within a fifth of the lock's lease,
        so that a renewal never waits a lease out on a dead host."""
        if host.name not in self._peers:
            limit = min(CALL_TIMEOUT_S, float(settings.get("PTC_LOCK_TTL_S")) / 5)
            self._peers[host.name] = PeerClient(host.address, host_id="lock", curve=self._keys,
                                                timeout_s=limit, peer_name=host.name)
        return self._peers[host.name]

    def members(self) -> list[Member]:
        return [Member(h, None) for h in self.spec.hosts]

    def join(self, host: HostSpec) -> None:
        """Nothing to do: the file lists the host."""

    def _all(self, op: str, **args: Any) -> dict[str, Any]:
        """``op`` on every host; the answers of those that gave one."""
        out: dict[str, Any] = {}

        def one(h: HostSpec) -> None:
            try:
                out[h.name] = self._peer(h).call(op, **args)
            except NotAllowed:
                raise  # this caller's key may not change the job: say so at once
            except PtcError as e:
                log.info("%s on %s: %s", op, h.name, e)

        on_each(one, self.spec.hosts)
        return out

    def _granted(self, answers: dict[str, Any]) -> bool:
        """Held: granted by a majority of the file's hosts, or, while fewer
        than a majority answer at all, by every host that answers (see the
        module docstring for what that costs)."""
        granted = sum(1 for a in answers.values() if a["granted"])
        need = min(len(self.spec.hosts) // 2 + 1, len(answers))
        return bool(answers) and granted >= need

    def lock(self, job: str, holder: str, wait_s: float | None = None) -> JobLock:
        ttl = float(settings.get("PTC_LOCK_TTL_S"))
        deadline = time.monotonic() + float(settings.get("PTC_LOCK_WAIT_S", wait_s))
        while True:
            answers = self._all("lock_job", job=job, holder=holder, ttl_s=ttl)
            if self._granted(answers):
                return JobLock(job, holder, lambda: self._renew(job, holder, ttl),
                               lambda: self._all("unlock_job", job=job, holder=holder),
                               ttl)
            for h, a in answers.items():  # none half-held: another may get its majority
                if a["granted"]:
                    try:
                        self._peer(self.spec.host(h)).call("unlock_job", job=job,
                                                           holder=holder)
                    except PtcError:
                        pass  # it runs out with its lease
            others = sorted({a["holder"] for a in answers.values()
                             if a["holder"] and a["holder"] != holder})
            if time.monotonic() > deadline:
                if not answers:
                    raise PeerError(f"cannot lock job {job!r}: no host of "
                                    f"{self.spec.path or 'the cluster file'} answers")
                raise JobBusy(f"job {job!r} is being changed by {', '.join(others) or 'another'}"
                              " (its lock is held); try again when it is done")
            time.sleep(random.uniform(*_RETRY_S))

    def _renew(self, job: str, holder: str, ttl: float) -> bool:
        """Granted again, or refused; PeerError when no host answers (tried
        again while the lease holds: :class:`JobLock`)."""
        answers = self._all("lock_job", job=job, holder=holder, ttl_s=ttl)
        if not answers:
            raise PeerError(f"no host answered the renewal of job {job!r}'s lock")
        return self._granted(answers)

    def holder(self, job: str) -> str | None:
        holders = [a for a in self._all("lock_holder", job=job).values() if a]
        return holders[0] if holders else None

    def decide(self, job: str, record: dict[str, Any], lock: JobLock) -> None:
        """Nothing here: the coordinator's ``decide`` to the hosts is the record."""
        if lock.lost.is_set():
            raise JobBusy(f"lost the lock of job {job!r}; nothing was committed")

    def decision(self, job: str) -> dict[str, Any] | None:
        return None

    def forget(self, job: str) -> None:
        """Nothing here (each host forgets its own when the job is deleted)."""

    def close(self) -> None:
        for p in self._peers.values():
            p.close()
        self._peers.clear()


# --- etcd -----------------------------------------------------------------------------
class EtcdRegistry:
    """Hosts, locks and decisions in etcd (v3, through its JSON gateway)."""

    atomic = True

    def __init__(self, url: str):
        import etcd3gw  # type: ignore[import-untyped]

        hostport = url.removeprefix("etcd://")
        host, _, port = hostport.rpartition(":")
        self.url = url
        self._etcd = etcd3gw.client(host=host.strip("[]"), port=int(port),
                                    timeout=CALL_TIMEOUT_S, api_path="/v3/")
        self._errors: tuple[type[BaseException], ...] = (
            etcd3gw.exceptions.Etcd3Exception, OSError)
        self._join: tuple[threading.Event, threading.Thread] | None = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise PeerError(f"the registry {self.url} does not answer: "
                            f"{type(e).__name__}: {e}", timed_out=True) from None

    def _json(self, key: str) -> dict[str, Any] | None:
        got = self._call(self._etcd.get, _PREFIX + key)
        return json.loads(got[0]) if got else None

    def members(self) -> list[Member]:
        hosts = self._call(self._etcd.get_prefix, _PREFIX + "hosts/", sort_order="ascend",
                           sort_target="create")
        alive = {meta["key"].decode().rsplit("/", 1)[1]
                 for _, meta in self._call(self._etcd.get_prefix, _PREFIX + "alive/")}
        out = []
        for value, _ in hosts:
            h = json.loads(value)
            spec = HostSpec(h["name"], h["address"], Path(h["store"]), int(h["gpus"]))
            out.append(Member(spec, spec.name in alive))
        return out

    def join(self, host: HostSpec) -> None:
        """Write the host's spec (keeping its place if it joined before) and
        its ``alive`` key under a lease renewed from a thread every third of
        ``PTC_REGISTRY_TTL_S``; a renewal that finds the lease gone (etcd
        was away longer than that) takes a new one."""
        value = json.dumps({"name": host.name, "address": host.address,
                            "store": str(host.store), "gpus": host.gpus})
        if not self._call(self._etcd.create, _PREFIX + f"hosts/{host.name}", value):
            self._call(self._etcd.put, _PREFIX + f"hosts/{host.name}", value)
        ttl = max(2, round(float(settings.get("PTC_REGISTRY_TTL_S"))))
        alive = json.dumps({"pid": os.getpid(), "since": time.time()})

        def register() -> Any:
            lease = self._call(self._etcd.lease, ttl)
            self._call(self._etcd.put, _PREFIX + f"alive/{host.name}", alive, lease=lease)
            return lease

        lease = register()
        stop = threading.Event()

        def keep() -> None:
            nonlocal lease
            while not stop.wait(ttl / 3):
                try:
                    if self._call(lease.refresh) <= 0:
                        lease = register()
                except PtcError as e:
                    log.warning("could not renew this host's lease: %s", e)
            try:
                self._call(lease.revoke)
            except PtcError:
                pass  # it expires on its own

        t = threading.Thread(target=keep, name="registry-lease", daemon=True)
        t.start()
        self._join = (stop, t)

    def lock(self, job: str, holder: str, wait_s: float | None = None) -> JobLock:
        ttl = max(2, round(float(settings.get("PTC_LOCK_TTL_S"))))
        deadline = time.monotonic() + float(settings.get("PTC_LOCK_WAIT_S", wait_s))
        key = _PREFIX + f"locks/{job}"
        lease = self._call(self._etcd.lease, ttl)
        while True:
            if self._call(self._etcd.create, key, holder, lease=lease):
                return JobLock(job, holder, lambda: self._call(lease.refresh) > 0,
                               lambda: self._call(lease.revoke), ttl)
            if time.monotonic() > deadline:
                self._call(lease.revoke)
                other = self.holder(job) or "another coordinator that just finished"
                raise JobBusy(f"job {job!r} is being changed by {other} (its lock is held); "
                              "try again when it is done")
            self._call(lease.refresh)
            time.sleep(random.uniform(*_RETRY_S))

    def holder(self, job: str) -> str | None:
        got = self._call(self._etcd.get, _PREFIX + f"locks/{job}")
        return got[0].decode() if got else None

    def decide(self, job: str, record: dict[str, Any], lock: JobLock) -> None:
        """One transaction: if the lock's key still holds our name, write the
        decision; else JobBusy (and nothing is written)."""
        import base64

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        txn = {"compare": [{"key": b64(_PREFIX + f"locks/{job}"), "result": "EQUAL",
                            "target": "VALUE", "value": b64(lock.holder)}],
               "success": [{"request_put": {"key": b64(_PREFIX + f"decisions/{job}"),
                                            "value": b64(json.dumps(record))}}],
               "failure": []}
        if lock.lost.is_set() or not self._call(self._etcd.transaction, txn).get("succeeded"):
            raise JobBusy(f"lost the lock of job {job!r} before its decision was recorded; "
                          "nothing was committed")

    def decision(self, job: str) -> dict[str, Any] | None:
        return self._json(f"decisions/{job}")

    def forget(self, job: str) -> None:
        self._call(self._etcd.delete, _PREFIX + f"decisions/{job}")

    def close(self) -> None:
        if self._join is not None:
            stop, t = self._join
            stop.set()
            t.join()
            self._join = None
