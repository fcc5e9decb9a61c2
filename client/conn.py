"""Connections from ``ptcctl`` to every host of a cluster.

:class:`Cluster` wraps the cluster file, its registry (the file's hosts, or
those that joined etcd: :mod:`ptcfs.server.registry`) and one
:class:`PeerClient` per host, and runs a call on many hosts at once, telling apart the hosts that
answered, the ones that failed and the ones that did not answer at all.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.errors import PeerError, PtcError
from ptcfs.server.cluster import ClusterSpec, load_cluster
from ptcfs.server.keys import load_keys
from ptcfs.server.peer import PeerClient
from ptcfs.server.registry import Registry, open_registry, resolve
from ptcfs.types import Box

__all__ = ["Cluster", "PING_TIMEOUT_S", "CALL_TIMEOUT_S"]

PING_TIMEOUT_S = 3.0
CALL_TIMEOUT_S = 120.0
#: Operations that answer at once: a host that does not answer them within
#: PING_TIMEOUT_S counts as down.
QUICK_OPS = frozenset({"ping", "health", "stage_status", "versions", "jobs", "counters"})


class Cluster:
    """The hosts of a cluster file, reachable from this process."""

    def __init__(self, spec: ClusterSpec, caller: str = "ctl",
                 registry: Registry | None = None):
        #: hosts, locks and decisions (:mod:`ptcfs.server.registry`)
        self.registry = registry or open_registry(spec)
        spec, known_down = resolve(spec, self.registry)
        self.spec = spec
        self.caller = caller
        self.hosts: list[str] = [h.name for h in spec.hosts]
        self.replicas = spec.replicas
        self._keys = load_keys(spec.curve_dir) if spec.curve_dir else None
        self._clients: dict[tuple[str, float | None], PeerClient] = {}
        # hosts that timed out or the registry says are down; skipped until they answer a ping
        self.down: set[str] = set(known_down)
        #: host → whether its registry lease is live (None: the file's hosts, no lease)
        self.leased: dict[str, bool | None] = {
            h.name: (h.name not in known_down if spec.registry else None) for h in spec.hosts}

    @classmethod
    def load(cls, path: str | Path | None) -> Cluster:
        return cls(load_cluster(path))

    def addresses(self) -> dict[str, str]:
        return {h.name: h.address for h in self.spec.hosts}

    def client(self, host: str, timeout_s: float | None = CALL_TIMEOUT_S) -> Conn:
        if host not in self.hosts:
            raise PeerError(f"host {host!r} is not in the cluster file")
        key = (host, timeout_s)
        if key not in self._clients:
            self._clients[key] = PeerClient(
                self.addresses()[host], host_id=self.caller, curve=self._keys,
                timeout_s=timeout_s, peer_name=host)
        return Conn(self._clients[key])

    def call_all(self, op: str, hosts: list[str] | None = None, timeout_s: float | None = None,
                 **args: Any) -> tuple[dict[str, Any], list[str]]:
        """``op`` on every host (or ``hosts``): answers, and hosts that did not answer.

        A host that answers with an error raises (through HostFailures)."""
        targets = hosts if hosts is not None else self.hosts
        answers: dict[str, Any] = {}
        down: list[str] = [] if op == "ping" else [h for h in targets if h in self.down]
        errors: dict[str, str] = {}
        targets = [h for h in targets if h not in down]

        def one(h: str) -> None:
            try:
                limit = timeout_s or (PING_TIMEOUT_S if op in QUICK_OPS else CALL_TIMEOUT_S)
                answers[h] = self.client(h, limit).call(op, **args)
            except PeerError as e:
                if e.timed_out:
                    down.append(h)
                    self.down.add(h)
                else:
                    errors[h] = str(e)
            except PtcError as e:
                errors[h] = f"{type(e).__name__}: {e}"

        self._parallel(one, targets)
        if op == "ping":
            self.down.difference_update(answers)
        if errors:
            from ptcfs.client.coordinator import HostFailures
            raise HostFailures(op, errors)
        return answers, sorted(down)

    def call_hosts(self, hosts: list[str], op: str, quiet: bool = False,
                   per_host: Any = None, timeout_s: float = CALL_TIMEOUT_S, **args: Any) -> None:
        """``op`` on each of ``hosts``; any failure raises unless ``quiet``.
        ``per_host(host)`` may add arguments that differ between hosts: they
        are made here, host by host in order, and each host's call goes out
        as soon as its arguments are ready (a large reconfiguration's first
        hosts start staging while the last ones' requests are still made)."""
        errors: dict[str, str] = {}

        def one(h: str, extra: dict[str, Any]) -> None:
            try:
                self.client(h, timeout_s).call(op, **args, **extra)
            except PtcError as e:
                errors[h] = str(e)

        if hosts:
            with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
                calls = []
                for h in hosts:
                    try:
                        extra = per_host(h) if per_host is not None else {}
                    except PtcError as e:
                        errors[h] = str(e)
                        continue
                    calls.append(pool.submit(one, h, extra))
                for f in calls:
                    f.result()
        if errors and not quiet:
            from ptcfs.client.coordinator import HostFailures
            raise HostFailures(op, errors)

    @staticmethod
    def _parallel(fn: Any, hosts: list[str]) -> None:
        if not hosts:
            return
        with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            for f in [pool.submit(fn, h) for h in hosts]:
                f.result()

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
