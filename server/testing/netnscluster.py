"""A multi-host cluster on one machine: each ``ptcd`` in its own network
namespace, every host's link shaped with ``tc``, for tests and benchmarks
that need real links between hosts (``deploy/netns-cluster.sh`` wraps it).

``python -m ptcfs.server.testing.netnscluster up N DIR [--rate 1gbit] [--delay 0] [--etcd]``
builds this network (``P`` is ``ptc`` and 6 hex digits of the hash of
DIR's path, so two clusters in two folders never share a name; ``X`` is a
free ``10.77.X.0/24`` subnet, picked from the same hash)::

    namespace P-br   bridge br0 with one veth per node: hK, st, co
    namespace P-hK   eth0 = 10.77.X.(10+K): ptcd of host hK, port 7100
    namespace P-st   eth0 = 10.77.X.2: the shared storage, an HTTP server
                     (ptcfs.server.testing.httpstore) of DIR/storage/files on port 8080
    namespace P-reg  eth0 = 10.77.X.3: the registry, etcd on port 2379 (with
                     --etcd: the hosts join it; hosts added later get
                     namespaces of their own, ``NetnsCluster.add_host``)
    root namespace   Pc = 10.77.X.1: the caller's own link into the bridge

Each host's and the storage's link is shaped in both directions: on the
node's ``eth0`` (what it sends) and on the bridge's side of its veth (what it
receives), with ``tbf`` at ``--rate``, or ``netem`` with ``--delay`` (one way,
per direction: host to host sees twice the delay). The root namespace's link
is not shaped: it carries ``ptcctl``'s calls, which are not what is measured.

Why a link from the root namespace, rather than a namespace for the
coordinator: ``ptcctl``, tests and benchmarks then run from the caller's
shell unchanged (``PTC_CLUSTER=DIR/cluster.toml ptcctl status``), and the
daemons' FUSE mounts (``DIR/mnt/hK``) are visible there, since daemons enter
only their host's *network* namespace (``nsenter --net``), never a mount
namespace of their own. Traffic stays on the bridge: the subnet is routed
to ``Pc`` only, and no namespace has a default route.

The rest is :class:`~ptcfs.server.testing.localcluster.LocalCluster`'s: the cluster
file, CurveZMQ keys, stores, ready files, pids and logs in DIR. The network
is recorded in ``DIR/netns.json`` before anything is made, so ``down DIR``
removes every process, namespace and link even after an ``up`` that was
interrupted half-way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ptcfs.errors import InvalidConfig, PtcError, exit_code
from ptcfs.server.net.cluster import ClusterSpec, HostSpec
from ptcfs.server.testing.localcluster import START_TIMEOUT_S, STOP_GRACE_S, LocalCluster
from ptcfs.server.testing.localetcd import LocalEtcd, stop_recorded

__all__ = ["NetnsCluster", "Net", "netns_problem", "parse_rate", "parse_delay", "main"]

PORT = 7100
STORAGE_PORT = 8080
#: etcd's client port in the registry's namespace (its peer port is the next)
ETCD_PORT = 2379
MAX_HOSTS = 200
_POLL_S = 0.02
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3,
          "mbps": 8e6, "gbps": 8e9}


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {pkg})"
    return None


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate (``1gbit``, ``200mbit``, ``12.5mbps``)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise InvalidConfig(f"rate {text!r}: give a number and one of {', '.join(_UNITS)} "
                            "(e.g. 1gbit)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_delay(text: str) -> float:
    """Seconds of a tc delay (``0.2ms``, ``100us``, ``0``)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us|)\s*", text.lower())
    if not m:
        raise InvalidConfig(f"delay {text!r}: give a number and s, ms or us (e.g. 0.2ms)")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "": 1.0}[m.group(2)]


@dataclass(frozen=True)
class Net:
    """The names and addresses of one cluster's network (DIR/netns.json)."""

    prefix: str
    subnet: int
    rate: str
    delay: str
    storage_rate: str

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def ip(self, node: str) -> str:
        fixed = {"co": 1, "st": 2, "reg": 3}
        last = fixed[node] if node in fixed else 10 + int(node[1:])
        return f"10.77.{self.subnet}.{last}"

    @property
    def root_link(self) -> str:
        return f"{self.prefix}c"


class NetnsCluster(LocalCluster):
    """Hosts ``h0..h{N-1}`` of one directory, each in its own network
    namespace on a shaped bridge (see the module docstring)::

        with NetnsCluster(tmp, rate="200mbit") as nc:   # down() on exit
            spec = nc.up(4)
            subprocess.run(nc.enter("h1") + ["ip", "addr"])
    """

    def __init__(self, directory: str | Path, ptcd: str | None = None, rate: str = "1gbit",
                 delay: str = "0", storage_rate: str | None = None):
        super().__init__(directory, ptcd)
        for r in (rate, storage_rate or rate):
            parse_rate(r)
        parse_delay(delay)
        self.rate, self.delay, self.storage_rate = rate, delay, storage_rate or rate
        self.storage_proc: subprocess.Popen[bytes] | None = None
        self.etcd: LocalEtcd | None = None
        self.net: Net | None = self._recorded()

    # --- names -----------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return "ptc" + hashlib.sha1(str(self.dir).encode()).hexdigest()[:6]

    @property
    def rate_bps(self) -> float:
        return parse_rate(self.rate)

    @property
    def storage_rate_bps(self) -> float:
        return parse_rate(self.storage_rate)

    @property
    def storage_dir(self) -> Path:
        """The files the storage namespace serves."""
        return self.dir / "storage" / "files"

    @property
    def storage_url(self) -> str:
        return f"http://{self._net().ip('st')}:{STORAGE_PORT}"

    def enter(self, node: str) -> list[str]:
        """The command prefix that runs a program in ``node``'s network
        namespace (``h0``, ``st``), keeping the caller's mounts and files."""
        return ["nsenter", f"--net=/run/netns/{self._net().ns(node)}"]

    def host_address(self, index: int) -> str:
        return f"tcp://{self._net().ip(f'h{index}')}:{PORT}"

    def host_command(self, host: str) -> list[str]:
        return self.enter(host) + self.command

    def add_host(self, name: str, gpus: int = 2, mount: bool = False,
                 address: str | None = None) -> HostSpec:
        """A new host ``hK`` in a namespace of its own that joins the
        registry (``up(..., etcd=True)``)."""
        self._node(name, self.rate)
        return super().add_host(name, gpus, mount,
                                address or f"tcp://{self._net().ip(name)}:{PORT}")

    # --- up ----------------------------------------------------------------------
    def up(self, n: int, gpus: int = 2, replicas: int | None = None,
           curve_dir: str | None = None, mount: bool = False, keys: bool = True,
           registry: str | None = None, storage: bool = True,
           etcd: bool = False) -> ClusterSpec:
        """Build the network for ``n`` hosts (and the storage node with
        ``storage``), then start every daemon as ``LocalCluster.up`` does;
        on any failure take everything down again and raise. With ``etcd``
        the cluster's registry runs in a namespace of its own (``reg``,
        behind its own shaped link) and the hosts join it; ``registry``
        names one that runs elsewhere instead."""
        problem = netns_problem()
        if problem:
            raise InvalidConfig(f"cannot make a netns cluster here: {problem}")
        if not 1 <= n <= MAX_HOSTS:
            raise InvalidConfig(f"a netns cluster has 1 to {MAX_HOSTS} hosts, not {n}")
        if self._namespaces():
            raise InvalidConfig(f"{self.dir} has a netns cluster up already "
                                f"(namespaces {self.prefix}-*); run 'down {self.dir}' first")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.net = Net(self.prefix, self._free_subnet(), self.rate, self.delay, self.storage_rate)
        (self.dir / "netns.json").write_text(json.dumps(asdict(self.net)) + "\n")
        try:
            self._bridge()
            for i in range(n):
                self._node(f"h{i}", self.rate)
            if storage:
                self._node("st", self.storage_rate)
            if etcd:
                self._node("reg", self.rate)
                self.etcd = LocalEtcd(self.dir / "registry", self.net.ip("reg"),
                                      self.enter("reg"), (ETCD_PORT, ETCD_PORT + 1)).start()
                registry = self.etcd.url
            spec = super().up(n, gpus, replicas, curve_dir, mount, keys, registry)
            if storage:
                self._start_storage()
        except BaseException:
            self.down()
            raise
        return spec

    def _bridge(self) -> None:
        net = self._net()
        br = net.ns("br")
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        _ip("link", "add", "name", net.root_link, "type", "veth", "peer", "name", "co",
            "netns", br)
        _ip("-n", br, "link", "set", "co", "master", "br0", "up")
        _ip("addr", "add", f"{net.ip('co')}/24", "dev", net.root_link)
        _ip("link", "set", net.root_link, "up")

    def _node(self, node: str, rate: str) -> None:
        """A namespace with ``eth0`` on the bridge, shaped both ways at ``rate``.
        (A registry namespace, ``reg``, is made the same way.)"""
        net = self._net()
        ns, br = net.ns(node), net.ns("br")
        _ip("netns", "add", ns)
        _ip("-n", br, "link", "add", "name", node, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", br, "link", "set", node, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{net.ip(node)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _shape(ns, "eth0", rate, self.delay)
        _shape(br, node, rate, self.delay)

    def _start_storage(self) -> None:
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        ready = self.dir / "storage" / "ready"
        ready.unlink(missing_ok=True)
        net = self._net()
        with open(self.dir / "storage" / "http.log", "ab") as log:
            proc = subprocess.Popen(
                self.enter("st") + [sys.executable, "-m", "ptcfs.server.testing.httpstore",
                                    str(self.storage_dir), "--bind", net.ip("st"),
                                    "--port", str(STORAGE_PORT), "--ready-file", str(ready)],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self.storage_proc = proc
        (self.dir / "storage" / "http.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log_text = (self.dir / "storage" / "http.log").read_text(errors="replace")
                raise PtcError(f"the storage server did not start: {log_text[-500:]}")
            time.sleep(_POLL_S)

    # --- down --------------------------------------------------------------------
    def down(self) -> None:
        """Stop the daemons and the storage server, delete every namespace
        and link of this directory (also after an interrupted ``up``)."""
        try:
            super().down()
        finally:
            self._stop_storage()
            if self.etcd is not None:
                self.etcd.stop()
                self.etcd = None
            stop_recorded(self.dir / "registry")
            net = self.net or self._recorded()
            prefix = net.prefix if net else self.prefix
            for ns in self._namespaces(prefix):
                _ip("netns", "del", ns, check=False)
            link = f"{prefix}c"
            if _run(["ip", "link", "show", link], check=False).returncode == 0:
                _ip("link", "del", link, check=False)
            (self.dir / "netns.json").unlink(missing_ok=True)
            self.net = None

    def _stop_storage(self) -> None:
        pid_file = self.dir / "storage" / "http.pid"
        proc, self.storage_proc = self.storage_proc, None
        pid = proc.pid if proc is not None else _pid_of(pid_file, b"ptcfs.server.testing.httpstore")
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if proc is not None:
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        pid_file.unlink(missing_ok=True)

    # --- helpers -----------------------------------------------------------------
    def _net(self) -> Net:
        if self.net is None:
            raise PtcError(f"{self.dir} has no netns cluster up")
        return self.net

    def _recorded(self) -> Net | None:
        try:
            return Net(**json.loads((self.dir / "netns.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _namespaces(self, prefix: str | None = None) -> list[str]:
        out = _run(["ip", "netns", "list"], check=False).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return [n for n in names if n.startswith((prefix or self.prefix) + "-")]

    def _free_subnet(self) -> int:
        """The first X (from the hash of DIR on) whose 10.77.X.0/24 no
        address or route of the root namespace uses."""
        used = _run(["ip", "-o", "addr"], check=False).stdout + \
            _run(["ip", "route"], check=False).stdout
        start = int(self.prefix[3:], 16) % 250
        for k in range(250):
            x = (start + k) % 250 + 1
            if f"10.77.{x}." not in used:
                return x
        raise PtcError("no free 10.77.X.0/24 subnet for a netns cluster")


def _shape(ns: str, dev: str, rate: str, delay: str) -> None:
    """What ``dev`` sends, at ``rate`` (and ``delay`` later, with netem)."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
    if parse_delay(delay) > 0:
        r = _run(tc + ["netem", "rate", rate, "delay", delay, "limit", "10000"], check=False)
        if r.returncode != 0:
            raise InvalidConfig(f"cannot delay links here (tc netem: {r.stderr.strip()}): "
                                "this kernel may lack sch_netem; use --delay 0")
        return
    burst = max(128 << 10, int(parse_rate(rate) / 8 / 200))  # 5 ms of traffic, ≥ 2 GSO packets
    _run(tc + ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"])


def _ip(*args: str, check: bool = True) -> None:
    _run(["ip", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise PtcError(f"{' '.join(cmd)} failed: {r.stderr.strip() or r.returncode}")
    return r


def _pid_of(pid_file: Path, marker: bytes) -> int | None:
    """The pid in ``pid_file`` if that process's command line has ``marker``."""
    try:
        pid = int(pid_file.read_text())
        return pid if marker in Path(f"/proc/{pid}/cmdline").read_bytes() else None
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netns-cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--ptcd", help="the ptcd executable (default: see ptcd_command)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start N hosts h0..h{N-1}, each in its own namespace")
    u.add_argument("n", type=int)
    u.add_argument("dir")
    u.add_argument("--rate", default="1gbit", help="each host's link, both ways (tc rate)")
    u.add_argument("--delay", default="0", help="one-way delay per direction of each link "
                   "(tc netem, e.g. 0.2ms; needs sch_netem)")
    u.add_argument("--storage-rate", help="the storage node's link (default: --rate)")
    u.add_argument("--no-storage", action="store_true", help="no storage node")
    u.add_argument("--etcd", action="store_true",
                   help="run the registry (etcd) in a namespace of its own; the hosts join it")
    u.add_argument("--gpus", type=int, default=2)
    u.add_argument("--replicas", type=int)
    u.add_argument("--curve-dir", help="CURVE keys (default: DIR/keys, made if missing)")
    u.add_argument("--no-keys", action="store_true", help="no CURVE keys (insecure)")
    u.add_argument("--no-mount", action="store_true",
                   help="do not mount the hosts' filesystems at DIR/mnt/hK")
    d = sub.add_parser("down", help="stop everything of DIR and delete its namespaces")
    d.add_argument("dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            nc = NetnsCluster(args.dir, args.ptcd, args.rate, args.delay, args.storage_rate)
            mount = not args.no_mount and os.path.exists("/dev/fuse")
            spec = nc.up(args.n, args.gpus, args.replicas, args.curve_dir, mount=mount,
                         keys=not args.no_keys, storage=not args.no_storage,
                         etcd=args.etcd)
            net = nc._net()
            print(f"{len(spec.hosts)} hosts up in namespaces {net.prefix}-h0.."
                  f"{net.prefix}-h{len(spec.hosts) - 1} (10.77.{net.subnet}.0/24, links "
                  f"{args.rate}, delay {args.delay}); cluster file {nc.cluster_file}"
                  + (f"; storage {nc.storage_url}/ serves {nc.storage_dir}"
                     if not args.no_storage else "")
                  + (f"; registry {nc.etcd.url}" if nc.etcd else "")
                  + (f"; mounted at {nc.dir / 'mnt'}/h0..h{len(spec.hosts) - 1}" if mount
                     else ""))
        else:
            nc = NetnsCluster(args.dir, args.ptcd)
            nc.down()
            print(f"stopped the daemons of {nc.dir} and removed its namespaces")
    except PtcError as e:
        print(f"netns-cluster: error: {e}", file=sys.stderr)
        return exit_code(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
