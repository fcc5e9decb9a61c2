"""A single-member etcd on loopback, for local clusters and tests.

``LocalEtcd(DIR).start()`` runs Debian's ``etcd`` (package ``etcd-server``)
with its data in ``DIR/etcd``, client and peer ports picked free on
127.0.0.1, its log in ``DIR/etcd.log`` and its pid in ``DIR/etcd.pid``,
and returns once ``/health`` says so; :attr:`url` is what a cluster file's
``registry =`` takes. ``stop()`` (or leaving the ``with`` block) ends it:
SIGTERM, then SIGKILL; :func:`stop_recorded` ends one that another process
started. A network-namespace cluster runs it on its own address inside its
own namespace (``host``, ``prefix``: the command that enters it, ``ports``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ptcfs.errors import PtcError
from ptcfs.server.testing.localcluster import free_port

__all__ = ["LocalEtcd", "etcd_binary", "stop_recorded"]

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


def etcd_binary() -> str | None:
    """The ``etcd`` on PATH (None: not installed; deploy/setup.sh installs it)."""
    return shutil.which("etcd")


class LocalEtcd:
    def __init__(self, directory: str | Path, host: str = "127.0.0.1",
                 prefix: Sequence[str] = (), ports: tuple[int, int] | None = None):
        self.dir = Path(directory).resolve()
        self.host, self.prefix, self.ports = host, list(prefix), ports
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def start(self) -> LocalEtcd:
        exe = etcd_binary()
        if exe is None:
            raise PtcError("etcd is not installed: apt-get install etcd-server "
                           "(deploy/setup.sh does)")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port, peer = self.ports or (free_port(), free_port())
        client, peer_url = f"http://{self.host}:{self.port}", f"http://{self.host}:{peer}"
        with open(self.dir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, exe, "--name", "registry", "--data-dir", str(self.dir / "etcd"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"registry={peer_url}"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        (self.dir / "etcd.pid").write_text(f"{self.proc.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy(client):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.dir / "etcd.log").read_text(errors="replace")[-2000:]
                raise PtcError(f"etcd did not start on {client}:\n{tail}")
            time.sleep(0.05)
        return self

    @staticmethod
    def _healthy(client: str) -> bool:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        (self.dir / "etcd.pid").unlink(missing_ok=True)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_recorded(directory: str | Path) -> None:
    """Stop the etcd that a :class:`LocalEtcd` of ``directory`` started in
    another process (its pid file names it; nothing if it is gone)."""
    pid_file = Path(directory) / "etcd.pid"
    try:
        pid = int(pid_file.read_text())
        if b"etcd" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            raise ProcessLookupError
    except (OSError, ValueError, ProcessLookupError):
        pid_file.unlink(missing_ok=True)
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
