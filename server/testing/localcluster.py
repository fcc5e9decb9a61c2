"""A local N-host cluster on loopback, for demos, tests and benchmarks.

``python -m ptcfs.server.testing.localcluster up N DIR`` starts hosts ``h0..h{N-1}``
(free ports, stores ``DIR/hK``, ``replicas = 2`` when N ≥ 2), writes
``DIR/cluster.toml`` (with CurveZMQ keys made in ``DIR/keys`` unless
``--no-keys``) and returns once every daemon has written its ready
file ``DIR/hK.ready``; pids go to ``DIR/hK.pid``, logs to ``DIR/hK.log``.
``down DIR`` stops them: SIGTERM, then SIGKILL after ``STOP_GRACE_S``.
``deploy/local-cluster.sh`` wraps this.

From Python (tests use it through the ``local_cluster`` fixture)::

    with LocalCluster(tmp) as lc:      # down() on exit, whatever happened
        spec = lc.up(3)
        ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from ptcfs import settings
from ptcfs.errors import PtcError, exit_code
from ptcfs.server.net.cluster import ClusterSpec, HostSpec, load_cluster, write_cluster
from ptcfs.server.net.keys import generate_keys

__all__ = ["LocalCluster", "free_port", "ptcd_command", "main"]

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
_POLL_S = 0.02


#: ports :func:`free_port` handed out in this process: none is handed out twice
_GIVEN: set[int] = set()
_GIVEN_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that this process has
    not handed out before, below the range the OS hands to outgoing
    connections (``ip_local_port_range``): a port the OS picked from that
    range could go to any process's next connection before its taker binds
    it (a daemon restarted on its address, or on its metrics port, was
    refused so). Picked at random, so that processes picking at once (test
    workers) seldom pick alike; :meth:`LocalCluster.start` picks a metrics
    port again when one was taken all the same."""
    lo, hi = _FIXED_PORTS[0], min(_FIXED_PORTS[1], _ephemeral_ports()[0])
    with _GIVEN_LOCK:
        for _ in range(256):  # where the window is too small: the OS picks (port 0)
            port = _PICK.randrange(lo, hi) if hi - lo >= 1024 else 0
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                port = int(s.getsockname()[1])
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise PtcError("no free TCP port on 127.0.0.1 that this process has not handed out already")


#: where :func:`free_port` picks, below the outgoing connections' ports
_FIXED_PORTS = (10000, 32768)
_PICK = random.Random(os.getpid() ^ time.time_ns())


def _ephemeral_ports() -> tuple[int, int]:
    """The OS's range for outgoing connections (Linux's default if unknown)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def ptcd_command(ptcd: str | None = None) -> list[str]:
    """How to run ptcd: ``ptcd`` if given, else ``$PTC_PTCD``, else the
    ``ptcd`` next to this Python, else ``ptcd`` on PATH, else ``python -m``."""
    exe = settings.get("PTC_PTCD", ptcd)
    if exe:
        return [exe]
    sibling = Path(sys.executable).with_name("ptcd")
    if sibling.exists():
        return [str(sibling)]
    found = shutil.which("ptcd")
    return [found] if found else [sys.executable, "-m", "ptcfs.server.daemon"]


class LocalCluster:
    """Daemons of one cluster directory, started and stopped by this process
    (``down`` also stops daemons another process started there)."""

    def __init__(self, directory: str | Path, ptcd: str | None = None):
        self.dir = Path(directory).resolve()
        self.command = ptcd_command(ptcd)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.mounted: dict[str, bool] = {}  # host → started with --mount
        #: hosts that join a registry: started with --address/--store/--gpus
        self.joining: dict[str, HostSpec] = {}
        #: host → the port its daemon serves Prometheus metrics on (``metrics=True``)
        self.metrics_ports: dict[str, int] = {}

    @property
    def cluster_file(self) -> Path:
        return self.dir / "cluster.toml"

    def write(self, n: int, gpus: int = 2, replicas: int | None = None,
              curve_dir: str | None = None, keys: bool = True,
              registry: str | None = None) -> ClusterSpec:
        """Write ``DIR/cluster.toml`` for ``n`` hosts on free loopback ports,
        with CurveZMQ keys: ``curve_dir``, else ``DIR/keys`` (made if
        missing). ``keys=False`` writes none (and ``insecure = true``).
        With ``registry`` (``etcd://HOST:PORT``) the file names it and no
        hosts: each joins with flags (:meth:`add_host`)."""
        if n < 1:
            raise PtcError(f"a cluster needs at least 1 host, not {n}")
        self.dir.mkdir(parents=True, exist_ok=True)
        hosts = tuple(HostSpec(f"h{i}", self.host_address(i), Path(f"h{i}"), gpus)
                      for i in range(n))
        reps = replicas if replicas is not None else (2 if n >= 2 else 1)
        curve = Path(curve_dir).resolve() if curve_dir else None
        if curve is None and keys:
            curve = self.dir / "keys"
            if not (curve / "server.key_secret").exists():
                generate_keys(curve)
        if registry:
            write_cluster(self.cluster_file, ClusterSpec(reps, (), curve, insecure=curve is None,
                                                         registry=registry))
            self.joining.update({h.name: replace(h, store=self.dir / h.store) for h in hosts})
            return replace(load_cluster(self.cluster_file),
                           hosts=tuple(self.joining[h.name] for h in hosts))
        write_cluster(self.cluster_file, ClusterSpec(reps, hosts, curve,
                                                     insecure=curve is None))
        return load_cluster(self.cluster_file)

    def host_address(self, index: int) -> str:
        """The address of host ``h{index}``: a free loopback port."""
        return f"tcp://127.0.0.1:{free_port()}"

    def host_command(self, host: str) -> list[str]:
        """How to run ``host``'s daemon (a subclass may wrap it, e.g. to enter
        the host's network namespace)."""
        return self.command

    def add_host(self, name: str, gpus: int = 2, mount: bool = False,
                 address: str | None = None) -> HostSpec:
        """Start a new host that joins the registry of ``DIR/cluster.toml``
        (mounting its filesystem at :meth:`mount_dir` with ``mount``), at
        ``address`` (default: a free loopback port)."""
        spec = HostSpec(name, address or f"tcp://127.0.0.1:{free_port()}", self.dir / name, gpus)
        self.joining[name] = spec
        self.start(name, mount=mount)
        return spec

    def mount_dir(self, host: str) -> Path:
        """Where ``up(..., mount=True)`` mounts a host's filesystem."""
        return self.dir / "mnt" / host

    def metrics_url(self, host: str) -> str:
        """Where ``host``'s daemon serves its metrics (started with ``metrics``)."""
        return f"http://127.0.0.1:{self.metrics_ports[host]}/metrics"

    def start(self, host: str, env: dict[str, str] | None = None,
              mount: bool | None = None, metrics: bool | None = None,
              flags: tuple[str, ...] = ()) -> None:
        """Start one host's daemon (and its mount, with ``mount``, or if it was
        started with one before; and its metrics on a free port, with
        ``metrics``, or on the same port as before; ``flags``: more of ptcd's,
        this start only) and wait until it is serving."""
        self._serving(host, self._launch(host, env, mount, metrics, flags), env, flags)

    def _serving(self, host: str, proc: subprocess.Popen[bytes],
                 env: dict[str, str] | None = None, flags: tuple[str, ...] = ()) -> None:
        """:meth:`wait_ready`, starting the daemon again on another metrics
        port when its own was taken between :func:`free_port` and the bind
        (by another process that picked it too, or bound it itself), at most
        3 times."""
        for again in (3, 2, 1, 0):
            try:
                self.wait_ready(host, proc)
                return
            except PtcError:
                last = (self._tail(host).splitlines() or [""])[-1]
                if not again or proc.poll() is None or host not in self.metrics_ports or \
                        "cannot serve metrics" not in last or "in use" not in last:
                    raise
            self.metrics_ports[host] = free_port()
            proc = self._launch(host, env, flags=flags)

    def _launch(self, host: str, env: dict[str, str] | None = None,
                mount: bool | None = None, metrics: bool | None = None,
                flags: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        """Start one host's daemon as :meth:`start` does, without waiting."""
        ready = self.dir / f"{host}.ready"
        ready.unlink(missing_ok=True)
        if mount is not None:
            self.mounted[host] = mount
        if metrics and host not in self.metrics_ports:
            self.metrics_ports[host] = free_port()
        elif metrics is False:
            self.metrics_ports.pop(host, None)
        extra = ["--mount", str(self.mount_dir(host))] if self.mounted.get(host) else []
        if host in self.metrics_ports:
            extra += ["--metrics-port", str(self.metrics_ports[host])]
        if host in self.joining:
            h = self.joining[host]
            extra += ["--address", h.address, "--store", str(h.store), "--gpus", str(h.gpus)]
        with open(self.dir / f"{host}.log", "ab") as log:
            proc = subprocess.Popen(
                self.host_command(host) + ["--cluster", str(self.cluster_file), "--host-id", host,
                                "--ready-file", str(ready), *extra, *flags],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                env={**os.environ, **env} if env else None)
        self.procs[host] = proc
        (self.dir / f"{host}.pid").write_text(f"{proc.pid}\n")
        return proc

    def wait_ready(self, host: str, proc: subprocess.Popen[bytes] | None = None,
                   timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait (polling, at most ``timeout_s``) until ``host`` writes its
        ready file; PtcError with the end of its log if it exits or hangs."""
        ready = self.dir / f"{host}.ready"
        proc = proc or self.procs.get(host)
        deadline = time.monotonic() + timeout_s
        while True:
            if ready.exists():
                try:
                    pid = json.loads(ready.read_text())["pid"]
                except (ValueError, KeyError):
                    pid = None  # a ready file of an older format: good enough
                if proc is None or pid in (None, proc.pid):
                    return
            if proc is not None and proc.poll() is not None:
                raise PtcError(f"ptcd {host} exited with status {proc.returncode}:\n"
                               f"{self._tail(host)}")
            if time.monotonic() > deadline:
                raise PtcError(f"ptcd {host} was not ready after {timeout_s:.0f} s:\n"
                               f"{self._tail(host)}")
            time.sleep(_POLL_S)

    def up(self, n: int, gpus: int = 2, replicas: int | None = None,
           curve_dir: str | None = None, mount: bool = False,
           keys: bool = True, registry: str | None = None,
           metrics: bool = False) -> ClusterSpec:
        """Write the cluster file and start every host (each mounting its
        filesystem at :meth:`mount_dir` with ``mount``, and serving metrics
        at :meth:`metrics_url` with ``metrics``); on any failure stop the
        ones started and raise. The hosts start all at once, or one after
        another with ``registry`` (they join it in the order of their names)."""
        spec = self.write(n, gpus, replicas, curve_dir, keys, registry)
        try:
            if registry:
                for h in spec.hosts:
                    self.start(h.name, mount=mount, metrics=metrics)
            else:
                procs = {h.name: self._launch(h.name, mount=mount, metrics=metrics)
                         for h in spec.hosts}
                for name, proc in procs.items():
                    self._serving(name, proc)
        except BaseException:
            self.down()
            raise
        return spec

    def kill(self, host: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a host's daemon and wait for it to exit."""
        pid = self._pid(host)
        if pid is None:
            return
        _signal(pid, sig)
        proc = self.procs.pop(host, None)
        if proc is not None:
            proc.wait()
        else:
            _wait_gone(pid, STOP_GRACE_S)
        (self.dir / f"{host}.pid").unlink(missing_ok=True)

    def down(self) -> None:
        """Stop every daemon of the directory: SIGTERM, wait, then SIGKILL."""
        hosts = {p.stem for p in self.dir.glob("*.pid")} | set(self.procs)
        pids = {h: pid for h in hosts if (pid := self._pid(h)) is not None}
        for pid in pids.values():
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for h, pid in pids.items():
            proc = self.procs.pop(h, None)
            if proc is not None:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            elif not _wait_gone(pid, max(0.0, deadline - time.monotonic())):
                _signal(pid, signal.SIGKILL)
                _wait_gone(pid, STOP_GRACE_S)
        for h in hosts:  # stale files of daemons that were gone already too
            (self.dir / f"{h}.pid").unlink(missing_ok=True)
            (self.dir / f"{h}.ready").unlink(missing_ok=True)
        self.unmount_all()

    def unmount_all(self) -> None:
        """Unmount what is still mounted under DIR/mnt (a killed daemon's
        mount process unmounts on its own, a moment later: wait for it).
        Without mounts it needs no libfuse."""
        root = self.dir / "mnt"
        if not root.is_dir():
            return
        from ptcfs.server.mount import is_mounted, unmount

        for m in sorted(root.iterdir()):
            deadline = time.monotonic() + STOP_GRACE_S
            while is_mounted(m) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if is_mounted(m):
                unmount(m)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _pid(self, host: str) -> int | None:
        """The daemon's pid: our child's, else the pid file's if that process
        is still a ptcd (a stale file's pid may belong to anything now)."""
        if host in self.procs:
            return self.procs[host].pid
        f = self.dir / f"{host}.pid"
        try:
            pid = int(f.read_text())
        except (OSError, ValueError):
            return None
        return pid if _is_ptcd(pid) else None

    def _tail(self, host: str) -> str:
        try:
            return (self.dir / f"{host}.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _is_ptcd(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: trust the pid file
        return True
    return b"ptcd" in cmdline or b"ptcfs.server.daemon" in cmdline


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until a process that is not our child has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="local-cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--ptcd", help="the ptcd executable (default: see ptcd_command)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start N hosts h0..h{N-1} with their stores under DIR")
    u.add_argument("n", type=int)
    u.add_argument("dir")
    u.add_argument("--gpus", type=int, default=2)
    u.add_argument("--replicas", type=int)
    u.add_argument("--curve-dir", help="CURVE keys (ptcctl keys generate DIR; default: "
                   "DIR/keys, made if missing)")
    u.add_argument("--no-keys", action="store_true", help="no CURVE keys: the daemons take "
                   "requests from anyone who can connect (the cluster file says insecure)")
    u.add_argument("--registry", metavar="etcd://HOST:PORT", help="the hosts join this etcd "
                   "registry (the cluster file names it and lists no hosts)")
    u.add_argument("--no-mount", action="store_true",
                   help="do not mount the hosts' filesystems at DIR/mnt/hK (the default "
                   "when /dev/fuse exists)")
    d = sub.add_parser("down", help="stop the daemons of DIR")
    d.add_argument("dir")
    args = ap.parse_args(argv)
    lc = LocalCluster(args.dir, args.ptcd)
    try:
        if args.cmd == "up":
            mount = not args.no_mount and os.path.exists("/dev/fuse")
            spec = lc.up(args.n, args.gpus, args.replicas, args.curve_dir, mount=mount,
                         keys=not args.no_keys, registry=args.registry)
            print(f"{len(spec.hosts)} hosts up; cluster file {lc.cluster_file}"
                  + (f"; mounted at {lc.dir / 'mnt'}/h0..h{len(spec.hosts) - 1}" if mount
                     else ""))
        else:
            lc.down()
            print(f"stopped the daemons of {lc.dir}")
    except PtcError as e:
        print(f"local-cluster: error: {e}", file=sys.stderr)
        return exit_code(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
