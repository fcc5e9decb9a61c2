"""A local N-host cluster on loopback, for demos, tests and benchmarks.

``python -m ptcfs.server.localcluster up N DIR`` starts hosts ``h0..h{N-1}``
(own ports, own stores under ``DIR``, ``replicas = 2`` when N ≥ 2), writes
``DIR/cluster.toml`` and returns once every daemon answers; ``down DIR``
stops them (SIGTERM, then SIGKILL after a grace period).
``deploy/local-cluster.sh`` wraps this.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ptcfs.errors import PeerError, PtcError
from ptcfs.server.cluster import ClusterSpec, HostSpec, load_cluster, write_cluster
from ptcfs.server.keys import load_keys
from ptcfs.server.peer import PeerClient

__all__ = ["LocalCluster", "free_port", "main"]

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """Daemons of one cluster directory, started and stopped by this process."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory).resolve()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def cluster_file(self) -> Path:
        return self.dir / "cluster.toml"

    def write(self, n: int, gpus: int = 2, replicas: int | None = None,
              curve_dir: str | None = None) -> ClusterSpec:
        self.dir.mkdir(parents=True, exist_ok=True)
        hosts = tuple(HostSpec(f"h{i}", f"tcp://127.0.0.1:{free_port()}", Path(f"h{i}"), gpus)
                      for i in range(n))
        reps = replicas if replicas is not None else (2 if n >= 2 else 1)
        spec = ClusterSpec(reps, hosts, Path(curve_dir) if curve_dir else None)
        write_cluster(self.cluster_file, spec)
        return load_cluster(self.cluster_file)

    def start(self, host: str) -> None:
        """Start one host's daemon and wait until it answers a ping."""
        log = open(self.dir / f"{host}.log", "ab")
        ready = self.dir / f"{host}.ready"
        ready.unlink(missing_ok=True)
        exe = Path(sys.executable).with_name("ptcd")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ptcfs.server.daemon"]
        proc = subprocess.Popen(cmd + ["--cluster", str(self.cluster_file), "--host-id", host,
                                       "--ready-file", str(ready)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.procs[host] = proc
        (self.dir / f"{host}.pid").write_text(f"{proc.pid}\n")
        self.wait_ready(host, proc)

    def wait_ready(self, host: str, proc: subprocess.Popen[bytes] | None = None) -> None:
        spec = load_cluster(self.cluster_file)
        keys = load_keys(spec.curve_dir) if spec.curve_dir else None
        client = PeerClient(spec.host(host).address, curve=keys, timeout_s=1.0, peer_name=host)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if proc is not None and proc.poll() is not None:
                    tail = (self.dir / f"{host}.log").read_text()[-2000:]
                    raise PtcError(f"ptcd {host} exited with {proc.returncode}:\n{tail}")
                try:
                    client.call("ping")
                    return
                except PeerError:
                    if time.monotonic() > deadline:
                        raise
        finally:
            client.close()

    def up(self, n: int, gpus: int = 2, replicas: int | None = None,
           curve_dir: str | None = None) -> ClusterSpec:
        spec = self.write(n, gpus, replicas, curve_dir)
        try:
            for h in spec.hosts:
                self.start(h.name)
        except BaseException:
            self.down()
            raise
        return spec

    def kill(self, host: str, sig: int = signal.SIGKILL) -> None:
        pid = self._pid(host)
        if pid is None:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        proc = self.procs.pop(host, None)
        if proc is not None:
            proc.wait()
        (self.dir / f"{host}.pid").unlink(missing_ok=True)

    def _pid(self, host: str) -> int | None:
        if host in self.procs:
            return self.procs[host].pid
        f = self.dir / f"{host}.pid"
        return int(f.read_text()) if f.exists() else None

    def down(self) -> None:
        """Stop every daemon of the directory (SIGTERM, then SIGKILL)."""
        hosts = {p.stem for p in self.dir.glob("*.pid")} | set(self.procs)
        for h in hosts:
            pid = self._pid(h)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for h in hosts:
            pid = self._pid(h)
            if pid is None:
                continue
            proc = self.procs.get(h)
            while _alive(pid, proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid, proc):
                self.kill(h)
            if proc is not None:
                proc.wait()
            self.procs.pop(h, None)
            (self.dir / f"{h}.pid").unlink(missing_ok=True)


def _alive(pid: int, proc: subprocess.Popen[bytes] | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="local-cluster", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("n", type=int)
    u.add_argument("dir")
    u.add_argument("--gpus", type=int, default=2)
    u.add_argument("--replicas", type=int)
    u.add_argument("--curve-dir")
    d = sub.add_parser("down")
    d.add_argument("dir")
    args = ap.parse_args(argv)
    lc = LocalCluster(args.dir)
    try:
        if args.cmd == "up":
            if args.n < 1:
                raise PtcError("N must be at least 1")
            spec = lc.up(args.n, args.gpus, args.replicas, args.curve_dir)
            print(f"{len(spec.hosts)} hosts up; cluster file {lc.cluster_file}")
        else:
            lc.down()
            print(f"stopped the daemons of {lc.dir}")
    except PtcError as e:
        print(f"local-cluster: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
