"""The cluster file: one TOML file that every host and ``ptcctl`` read.

```toml
[cluster]
replicas = 2                 # copies of every committed sub-tensor
curve_secret_dir = "keys"    # optional: CurveZMQ authentication + encryption
[hosts.h0]
address = "tcp://127.0.0.1:7100"
store = "/var/lib/ptc/h0"    # relative paths are relative to this file
gpus = 4
```

The file is found from ``--cluster FILE``, else ``PTC_CLUSTER``. A cluster
that outgrows a hand-written file can take its hosts from elsewhere (for
example torchrun's rendezvous) through a :class:`HostSource`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ptcfs.errors import InvalidConfig

__all__ = ["ClusterSpec", "HostSpec", "HostSource", "load_cluster", "write_cluster"]


@dataclass(frozen=True)
class HostSpec:
    name: str
    address: str
    store: Path
    gpus: int


@dataclass(frozen=True)
class ClusterSpec:
    replicas: int
    hosts: tuple[HostSpec, ...]
    curve_dir: Path | None = None
    path: Path | None = None

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InvalidConfig(f"host {name!r} is not in the cluster file "
                            f"(hosts: {', '.join(h.name for h in self.hosts)})")


class HostSource(Protocol):
    """Where a cluster's host list comes from (a file today; a rendezvous later)."""

    def hosts(self) -> tuple[HostSpec, ...]: ...


def load_cluster(path: str | Path | None = None) -> ClusterSpec:
    """Read and check a cluster file (``path``, else ``$PTC_CLUSTER``)."""
    where = path or os.environ.get("PTC_CLUSTER")
    if not where:
        raise InvalidConfig("no cluster file: pass --cluster FILE or set PTC_CLUSTER")
    p = Path(where)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidConfig(f"cluster file {p} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidConfig(f"cannot read cluster file {p}: {e}") from None
    base = p.parent
    cl = data.get("cluster", {})
    replicas = cl.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidConfig(f"{p}: cluster.replicas must be a whole number >= 1")
    hosts = []
    table = data.get("hosts")
    if not isinstance(table, dict) or not table:
        raise InvalidConfig(f"{p}: no [hosts.NAME] tables")
    for name, h in table.items():
        if not isinstance(h, dict):
            raise InvalidConfig(f"{p}: hosts.{name} must be a table")
        for key in ("address", "store"):
            if not isinstance(h.get(key), str):
                raise InvalidConfig(f"{p}: hosts.{name}.{key} is missing or not text")
        gpus = h.get("gpus", 1)
        if not isinstance(gpus, int) or gpus < 1:
            raise InvalidConfig(f"{p}: hosts.{name}.gpus must be a whole number >= 1")
        if not h["address"].startswith(("tcp://", "ipc://")):
            raise InvalidConfig(f"{p}: hosts.{name}.address must start with tcp:// or ipc://")
        hosts.append(HostSpec(name, h["address"], base / h["store"], gpus))
    if replicas > len(hosts):
        raise InvalidConfig(f"{p}: replicas={replicas} but only {len(hosts)} hosts")
    curve = cl.get("curve_secret_dir")
    return ClusterSpec(replicas, tuple(hosts), base / curve if curve else None, p)


def write_cluster(path: str | Path, spec: ClusterSpec) -> None:
    """Write a cluster file (paths as given)."""
    lines = ["[cluster]", f"replicas = {spec.replicas}"]
    if spec.curve_dir:
        lines.append(f'curve_secret_dir = "{spec.curve_dir}"')
    for h in spec.hosts:
        lines += ["", f"[hosts.{h.name}]", f'address = "{h.address}"', f'store = "{h.store}"',
                  f"gpus = {h.gpus}"]
    Path(path).write_text("\n".join(lines) + "\n")
