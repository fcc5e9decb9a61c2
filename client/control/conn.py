"""Connections from ``ptcctl`` to every host of a cluster.

:class:`Cluster` wraps the cluster file, its registry (the file's hosts, or
those that joined etcd: :mod:`ptcfs.server.net.registry`) and one
:class:`PeerClient` per host, and runs a call on many hosts at once, telling apart the hosts that
answered, the ones that failed and the ones that did not answer at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs import settings
from ptcfs.errors import PeerError, PtcError
from ptcfs.server.net.cluster import ClusterSpec, load_cluster
from ptcfs.server.net.keys import load_keys
from ptcfs.server.net.peer import PeerClient, came_back, on_each
from ptcfs.server.net.registry import Registry, open_registry, resolve
from ptcfs.types import Box

__all__ = ["Cluster", "call_timeout", "ping_timeout"]



def call_timeout() -> float:
    """The longest a call waits for a host that answers liveness pings
    (``PTC_CALL_TIMEOUT_S``; a host that stops answering them is given up
    on within ``PTC_PEER_SILENCE_S + PTC_PING_TIMEOUT_S``)."""
    return float(settings.get("PTC_CALL_TIMEOUT_S"))


def ping_timeout() -> float:
    """The longest a ``ping`` waits (``PTC_PING_TIMEOUT_S``)."""
    return float(settings.get("PTC_PING_TIMEOUT_S"))


class Cluster:
    """The hosts of a cluster file, reachable from this process."""

    def __init__(self, spec: ClusterSpec, caller: str = "ctl",
                 registry: Registry | None = None):
        #: hosts, locks and decisions (:mod:`ptcfs.server.net.registry`)
        self._keys = load_keys(spec.curve_dir) if spec.curve_dir else None
        self.registry = registry or open_registry(spec, self._keys)
        spec, known_down = resolve(spec, self.registry)
        self.spec = spec
        self.caller = caller
        self.hosts: list[str] = [h.name for h in spec.hosts]
        self.replicas = spec.replicas
        #: the client key this process presents (None: a cluster without keys)
        self.key_name: str | None = self._keys.name if self._keys else None
        self._clients: dict[tuple[str, float | None], PeerClient] = {}
        #: host → when it last did not answer (time.monotonic()); see :meth:`is_down`
        self.down: dict[str, float] = {}
        #: host → whether its registry lease is live (None: the file's hosts, no lease)
        self.leased: dict[str, bool | None] = {
            h.name: (h.name not in known_down if spec.registry else None) for h in spec.hosts}

    @classmethod
    def load(cls, path: str | Path | None) -> Cluster:
        return cls(load_cluster(path))

    def addresses(self) -> dict[str, str]:
        return {h.name: h.address for h in self.spec.hosts}

    def client(self, host: str, timeout_s: float | None = None) -> Conn:
        """The connection to ``host`` whose calls wait at most ``timeout_s``
        (default :func:`call_timeout`)."""
        timeout_s = call_timeout() if timeout_s is None else timeout_s
        if host not in self.hosts:
            raise PeerError(f"host {host!r} is not in the cluster file")
        key = (host, timeout_s)
        if key not in self._clients:
            self._clients[key] = PeerClient(
                self.addresses()[host], host_id=self.caller, curve=self._keys,
                timeout_s=timeout_s, peer_name=host)
        return Conn(self._clients[key])

    def is_down(self, host: str) -> bool:
        """Whether ``host`` did not answer a call within the last
        ``PTC_PEER_SILENCE_S + PTC_PING_TIMEOUT_S`` seconds: calls skip it
        until then instead of waiting for it again (a host that comes back
        is asked again after that, or at once where nothing listened at its
        address and something does again). A host whose registry lease ran
        out is down until this Cluster is made anew."""
        if self.leased.get(host) is False:
            return True  # its registry lease ran out
        when = self.down.get(host)
        window = ping_timeout() + float(settings.get("PTC_PEER_SILENCE_S"))
        if when is None or time.monotonic() - when >= window:
            return False
        if came_back(self.addresses()[host], when):
            del self.down[host]
            return False
        return True

    def call_all(self, op: str, hosts: list[str] | None = None, timeout_s: float | None = None,
                 **args: Any) -> tuple[dict[str, Any], list[str]]:
        """``op`` on every host (or ``hosts``), all at once: answers, and hosts
        that did not answer (within ``timeout_s``, by default
        :func:`call_timeout`, or a liveness ping within PTC_PING_TIMEOUT_S:
        a dead host is known in a few seconds, a busy one is waited for).

        A host that answers with an error raises (through HostFailures)."""
        targets = hosts if hosts is not None else self.hosts
        answers: dict[str, Any] = {}
        down: list[str] = [h for h in targets if self.is_down(h)]
        errors: dict[str, str] = {}
        targets = [h for h in targets if h not in down]

        def one(h: str) -> None:
            try:
                limit = timeout_s or (ping_timeout() if op == "ping" else call_timeout())
                answers[h] = self.client(h, limit).call(op, **args)
            except PeerError as e:
                if e.timed_out:
                    down.append(h)
                    self.down[h] = time.monotonic()
                else:
                    errors[h] = str(e)
            except PtcError as e:
                errors[h] = f"{type(e).__name__}: {e}"

        self.each(one, targets)
        for h in answers:
            self.down.pop(h, None)
        if errors:
            from ptcfs.errors import HostFailures
            raise HostFailures(op, errors)
        return answers, sorted(down)

    def call_hosts(self, hosts: list[str], op: str, quiet: bool = False,
                   per_host: Any = None, timeout_s: float | None = None,
                   **args: Any) -> dict[str, str]:
        """``op`` on each of ``hosts``, in parallel; any failure raises
        unless ``quiet``, which returns them (host → message) instead.
        ``per_host(host)`` may add arguments that differ between hosts: they
        are made here, host by host in order, and each host's call goes out
        as soon as its arguments are ready (a large reconfiguration's first
        hosts start staging while the last ones' requests are still made).
        A host that does not answer is marked down, as by :meth:`call_all`."""
        errors: dict[str, str] = {}

        def one(h: str, extra: dict[str, Any]) -> None:
            try:
                self.client(h, timeout_s).call(op, **args, **extra)
            except PeerError as e:
                if e.timed_out:
                    self.down[h] = time.monotonic()
                errors[h] = str(e)
            except PtcError as e:
                errors[h] = str(e)

        def ready(h: str) -> dict[str, Any] | None:
            try:
                return per_host(h) if per_host is not None else {}
            except PtcError as e:
                errors[h] = str(e)
                return None

        if len(hosts) == 1:  # no thread to start for one host (a small save's calls)
            extra = ready(hosts[0])
            if extra is not None:
                one(hosts[0], extra)
        elif hosts:
            with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
                calls = []
                for h in hosts:
                    extra = ready(h)
                    if extra is not None:
                        calls.append(pool.submit(one, h, extra))
                for f in calls:
                    f.result()
        if errors and not quiet:
            from ptcfs.errors import HostFailures
            raise HostFailures(op, errors)
        return errors

    @staticmethod
    def each(fn: Callable[[str], None], hosts: list[str]) -> None:
        """``fn(host)`` for each of ``hosts``, all at once (one host: in this
        thread); the first error raises."""
        on_each(fn, hosts)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        self.registry.close()


class Conn:
    """One host's daemon, with the calls ``ptcctl`` needs."""

    def __init__(self, peer: PeerClient):
        self.peer = peer

    def call(self, op: str, **args: Any) -> Any:
        return self.peer.call(op, **args)

    def put(self, job: str, version: int, tensor: str, part: str, array: np.ndarray,
            dtype: str) -> None:
        self.peer.put(job, version, tensor, part, array, dtype)

    def read_box(self, job: str, version: int, tensor: str, part: str, box: Box
                 ) -> memoryview:
        return self.peer.read_box(job, version, tensor, part, box)
