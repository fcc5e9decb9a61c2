"""Real ``ptcd`` daemons for tests, on loopback.

``running(dir, n)`` starts ``n`` daemons from a fresh cluster file (free
ports, stores under ``dir``), waits for their ready files, and on exit
stops them (SIGTERM, wait, SIGKILL if needed) whatever happened in the
block. Inside a test, the ``local_cluster`` fixture of conftest.py does the
same per test; use ``running`` for module-scoped fixtures::

    @pytest.fixture(scope="module")
    def pair(tmp_path_factory):
        with running(tmp_path_factory.mktemp("pair"), 2) as lc:
            yield lc
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

from ptcfs.server.net.cluster import load_cluster
from ptcfs.server.net.keys import CurveKeys, load_keys
from ptcfs.server.net.peer import PeerClient
from ptcfs.server.testing.localcluster import LocalCluster

__all__ = ["address", "client", "coordinated", "mounted_for_all", "paused", "raw_socket",
           "running"]


@contextmanager
def running(directory: str | Path, n: int, env: dict[str, str] | None = None,
            **kw: Any) -> Iterator[LocalCluster]:
    """``n`` daemons h0..h{n-1} serving until the block ends (``kw`` go to
    :meth:`LocalCluster.write`: gpus, replicas, curve_dir; ``env`` is added
    to the daemons' environment)."""
    lc = LocalCluster(directory)
    try:
        spec = lc.write(n, **kw)
        for h in spec.hosts:
            lc.start(h.name, env=env)
        yield lc
    finally:
        lc.down()


@contextmanager
def coordinated(directory: str | Path, n: int, **kw: Any) -> Iterator[tuple[Path, Any]]:
    """:func:`running`, with the client's view of it: (cluster file,
    :class:`~ptcfs.client.control.coordinator.Coordinator`), whose
    connections close when the block ends."""
    from ptcfs.client.control.conn import Cluster
    from ptcfs.client.control.coordinator import Coordinator

    with running(directory, n, **kw) as lc:
        c = Cluster.load(lc.cluster_file)
        try:
            yield lc.cluster_file, Coordinator(c)
        finally:
            c.close()


@contextmanager
def mounted_pair(directory: str | Path) -> Iterator[tuple[LocalCluster, Any]]:
    """Two hosts, one copy of everything, each mounted (h0's mount reads
    h1's pieces from h1): the cluster and a
    :class:`~ptcfs.client.control.coordinator.Coordinator` of it."""
    from ptcfs.client.control.conn import Cluster
    from ptcfs.client.control.coordinator import Coordinator

    lc = LocalCluster(directory)
    try:
        lc.up(2, gpus=2, replicas=1, mount=True)
        co = Coordinator(Cluster.load(lc.cluster_file))
        try:
            yield lc, co
        finally:
            co.cluster.close()
    finally:
        lc.down()


@contextmanager
def mounted_for_all(prefix: str, n: int, gpus: int = 2) -> Iterator[LocalCluster]:
    """``n`` daemons with their mounts, in a folder under /tmp that every
    user may enter (for tests that act as another user); removed after."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    lc = LocalCluster(d)
    try:
        lc.up(n, gpus=gpus, replicas=1, mount=True)
        (d / "mnt").chmod(0o755)
        yield lc
    finally:
        lc.down()
        shutil.rmtree(d, ignore_errors=True)


def address(lc: LocalCluster, host: str = "h0") -> str:
    return load_cluster(lc.cluster_file).host(host).address


def client(lc: LocalCluster, host: str = "h0", *, keys: CurveKeys | None = None,
           host_id: str = "ctl", timeout_s: float = 10.0) -> PeerClient:
    """A client of one daemon, with the cluster's keys unless ``keys`` is given."""
    spec = load_cluster(lc.cluster_file)
    if keys is None and spec.curve_dir:
        keys = load_keys(spec.curve_dir)
    return PeerClient(spec.host(host).address, host_id=host_id, curve=keys,
                      timeout_s=timeout_s, peer_name=host)


def raw_socket(lc: LocalCluster, host: str = "h0") -> zmq.Socket[Any]:
    """A bare DEALER connected to a daemon, for sending arbitrary frames."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address(lc, host))
    return s


@contextmanager
def paused(cluster: Path, point: str, *args: str,
           env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """``ptcctl args`` stopped at ``point`` of its protocol
    (``PTC_TEST_PAUSE_AT``): the block runs while it waits there, holding
    what it holds; it is killed (``kill -9``) when the block ends."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("ptcctl")), *args], stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True,
        env=dict(os.environ, PTC_CLUSTER=str(cluster), PTC_TEST_PAUSE_AT=point, **(env or {})))
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == f"paused at {point}"
        yield proc
    finally:
        proc.kill()
        proc.wait()
