"""The cluster file: one TOML file that every host and ``ptcctl`` read.

```toml
[cluster]
replicas = 2                 # copies of every committed sub-tensor
curve_secret_dir = "keys"    # CurveZMQ authentication + encryption (ptcctl keys generate)
# insecure = true            # 2+ hosts without keys: ptcd refuses to start unless this
# registry = "etcd://127.0.0.1:2379"   # hosts join in etcd (server/net/registry.py); then
#                                      # the [hosts.*] tables are optional
[hosts.h0]
address = "tcp://127.0.0.1:7100"
store = "/var/lib/ptc/h0"    # relative paths are relative to this file
gpus = 4
```

Which file: ``--cluster FILE`` (the ``path`` argument) wins over the
``PTC_CLUSTER`` environment variable; there is no default file.

With ``registry = "etcd://HOST:PORT"`` the file carries the cluster-wide
settings (replicas, keys) and the hosts are those that joined the registry
(:mod:`ptcfs.server.net.registry`), in the order they first joined; a
``[hosts.NAME]`` table then only gives that host's defaults for ``ptcd``.

The order of the ``[hosts.*]`` tables is the cluster's host order (ranks
fill hosts in that order, replicas go to the next hosts of it).

A seam for other host lists. A cluster that outgrows a hand-written file
(torchrun's rendezvous, a Kubernetes node list) supplies its hosts through a
:class:`HostSource`; :func:`cluster_from_source` checks them with the same
rules as the file and builds the :class:`ClusterSpec` the daemon and
``ptcctl`` use. :class:`FileHostSource` is the file's own source.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ptcfs import settings
from ptcfs.errors import InvalidConfig
from ptcfs.tomlout import toml_key, toml_str

__all__ = [
    "ClusterSpec",
    "FileHostSource",
    "HostSource",
    "HostSpec",
    "cluster_from_source",
    "cluster_path",
    "load_cluster",
    "write_cluster",
]

_CLUSTER_KEYS = {"replicas", "curve_secret_dir", "insecure", "registry"}
_REGISTRY = re.compile(r"^etcd://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_HOST_KEYS = {"address", "store", "gpus"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_ADDRESS = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$|^ipc://.+$")


@dataclass(frozen=True)
class HostSpec:
    """One host: its name (``--host-id``), ZeroMQ address, store directory
    and GPU (rank slot) count."""

    name: str
    address: str
    store: Path
    gpus: int


@dataclass(frozen=True)
class ClusterSpec:
    """A checked cluster: replicas, hosts in order, CURVE key directory
    (None: no encryption), the file it came from (None: not from a file),
    whether it may run several hosts without keys (``insecure``), and the
    registry its hosts join (None: the file's hosts are the cluster)."""

    replicas: int
    hosts: tuple[HostSpec, ...]
    curve_dir: Path | None = None
    path: Path | None = None
    insecure: bool = False
    registry: str | None = None

    def check_secure(self) -> None:
        """InvalidConfig if the daemons of several hosts would talk in the
        clear: ``ptcd`` calls it at start."""
        several = len(self.hosts) >= 2 or self.registry is not None
        if several and self.curve_dir is None and not self.insecure:
            where = self.path or "the cluster"
            count = "a registry" if self.registry else f"{len(self.hosts)} hosts"
            raise InvalidConfig(f"{where}: {count} and no curve_secret_dir: "
                                "anyone who can connect could read and change every job's "
                                "state; make keys (ptcctl keys generate DIR) and set "
                                "curve_secret_dir = \"DIR\" under [cluster], or set "
                                "insecure = true there to run without them")

    def host(self, name: str) -> HostSpec:
        """The host called ``name``; InvalidConfig naming the known hosts if none."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise InvalidConfig(f"host {name!r} is not in the cluster "
                            f"(hosts: {', '.join(h.name for h in self.hosts)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hosts)


class HostSource(Protocol):
    """Where a cluster's host list comes from: a file today; torchrun's
    rendezvous (every agent publishes ``HostSpec`` fields under its node's
    key in the rendezvous store) later. ``hosts()`` returns them in cluster
    order; :func:`cluster_from_source` checks them."""

    def hosts(self) -> tuple[HostSpec, ...]: ...


class FileHostSource:
    """The ``[hosts.*]`` tables of a cluster file, as a :class:`HostSource`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def hosts(self) -> tuple[HostSpec, ...]:
        return load_cluster(self.path).hosts


def cluster_path(path: str | Path | None = None) -> Path:
    """The cluster file to use: ``path`` (``--cluster``), else ``$PTC_CLUSTER``."""
    where = settings.get("PTC_CLUSTER", path)
    if not where:
        raise InvalidConfig("no cluster file: pass --cluster FILE or set PTC_CLUSTER")
    return Path(where)


def load_cluster(path: str | Path | None = None) -> ClusterSpec:
    """Read and check a cluster file (``path``, else ``$PTC_CLUSTER``).

    Relative ``store`` and ``curve_secret_dir`` paths are taken relative to
    the file's directory. Every mistake raises InvalidConfig naming the file
    and the key (``hosts.h0.gpus``)."""
    p = cluster_path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidConfig(f"cluster file {p} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InvalidConfig(f"cannot read cluster file {p}: {e}") from None
    base = p.resolve().parent
    _unknown(p, "", data, {"cluster", "hosts"})
    cl = data.get("cluster", {})
    if not isinstance(cl, dict):
        raise InvalidConfig(f"{p}: 'cluster' must be a table ([cluster])")
    _unknown(p, "cluster.", cl, _CLUSTER_KEYS)
    replicas = cl.get("replicas", 1)
    if not _whole(replicas):
        raise InvalidConfig(f"{p}: cluster.replicas must be a whole number >= 1, "
                            f"not {replicas!r}")
    insecure = cl.get("insecure", False)
    if not isinstance(insecure, bool):
        raise InvalidConfig(f"{p}: cluster.insecure must be true or false, not {insecure!r}")
    curve = cl.get("curve_secret_dir")
    if curve is not None and (not isinstance(curve, str) or not curve):
        raise InvalidConfig(f"{p}: cluster.curve_secret_dir must be a directory path (text)")
    registry = cl.get("registry")
    if registry is not None and (not isinstance(registry, str) or not _REGISTRY.match(registry)):
        raise InvalidConfig(f"{p}: cluster.registry must be \"etcd://HOST:PORT\", "
                            f"not {registry!r}")
    table = data.get("hosts", {} if registry else None)
    if not isinstance(table, dict) or (not table and not registry):
        raise InvalidConfig(f"{p}: no hosts: add a [hosts.NAME] table per host")
    hosts = []
    for name, h in table.items():
        where = f"{p}: hosts.{name}"
        if not isinstance(h, dict):
            raise InvalidConfig(f"{where} must be a table ([hosts.{name}])")
        _unknown(p, f"hosts.{name}.", h, _HOST_KEYS)
        for key in ("address", "store"):
            if not isinstance(h.get(key), str) or not h[key]:
                raise InvalidConfig(f"{where}.{key} is missing or not text")
        gpus = h.get("gpus", 1)
        if not _whole(gpus):
            raise InvalidConfig(f"{where}.gpus must be a whole number >= 1, not {gpus!r}")
        hosts.append(HostSpec(name, h["address"], base / h["store"], gpus))
    curve_dir = base / curve if curve else None
    if registry:  # the hosts are the registry's; the file's only give defaults
        return ClusterSpec(replicas, tuple(hosts), curve_dir, p, insecure, registry)
    try:
        spec = cluster_from_source(_Fixed(tuple(hosts)), replicas, curve_dir, p)
    except InvalidConfig as e:
        raise InvalidConfig(f"{p}: {e}") from None
    return replace(spec, insecure=insecure)


def cluster_from_source(source: HostSource, replicas: int, curve_dir: Path | None = None,
                        path: Path | None = None, registry: str | None = None
                        ) -> ClusterSpec:
    """Check the hosts of ``source`` and build a :class:`ClusterSpec`: names
    usable as host ids, addresses peers can connect to, no name or address
    twice, and at least ``replicas`` hosts. (Two hosts may name the same
    store path: they are different machines.)"""
    hosts = tuple(source.hosts())
    if not hosts:
        raise InvalidConfig("the cluster has no hosts")
    if not _whole(replicas):
        raise InvalidConfig(f"replicas must be a whole number >= 1, not {replicas!r}")
    seen: dict[str, dict[str, str]] = {"name": {}, "address": {}}
    for h in hosts:
        if not _NAME.match(h.name):
            raise InvalidConfig(f"host name {h.name!r} must be 1-63 letters, digits, '.', "
                                "'_' or '-', starting with a letter or digit")
        m = _ADDRESS.match(h.address)
        if not m or (m.group(2) is not None and not 0 < int(m.group(2)) < 65536):
            raise InvalidConfig(f"hosts.{h.name}.address {h.address!r} must be "
                                "tcp://HOST:PORT (port 1-65535) or ipc://PATH")
        if not _whole(h.gpus):
            raise InvalidConfig(f"hosts.{h.name}.gpus must be a whole number >= 1")
        for key, value in (("name", h.name), ("address", h.address)):
            if value in seen[key]:
                raise InvalidConfig(f"hosts.{h.name} has the same {key} as "
                                    f"hosts.{seen[key][value]} ({value})")
            seen[key][value] = h.name
    if replicas > len(hosts) and registry is None:
        raise InvalidConfig(f"replicas={replicas} but only {len(hosts)} hosts; "
                            "lower cluster.replicas or add hosts")
    return ClusterSpec(replicas, hosts, curve_dir, path, registry=registry)


def write_cluster(path: str | Path, spec: ClusterSpec) -> None:
    """Write ``spec`` as a cluster file at ``path`` (paths written as given,
    so relative ones stay relative to the file's directory)."""
    lines = ["[cluster]", f"replicas = {spec.replicas}"]
    if spec.curve_dir:
        lines.append(f"curve_secret_dir = {toml_str(str(spec.curve_dir))}")
    if spec.insecure:
        lines.append("insecure = true")
    if spec.registry:
        lines.append(f"registry = {toml_str(spec.registry)}")
    for h in spec.hosts:
        key = toml_key(h.name)
        lines += ["", f"[hosts.{key}]", f"address = {toml_str(h.address)}",
                  f"store = {toml_str(str(h.store))}", f"gpus = {h.gpus}"]
    Path(path).write_text("\n".join(lines) + "\n")


class _Fixed:
    def __init__(self, hosts: tuple[HostSpec, ...]):
        self._hosts = hosts

    def hosts(self) -> tuple[HostSpec, ...]:
        return self._hosts


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _unknown(p: Path, prefix: str, table: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise InvalidConfig(f"{p}: unknown key {prefix}{extra[0]} "
                            f"(known: {', '.join(prefix + k for k in sorted(known))})")

