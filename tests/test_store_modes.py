"""A store is its daemon user's only: folders 0700, files 0600, whatever
the umask. Another user (uid 65534, through setpriv) cannot read the store's
files, and the training client then reads through the daemon instead."""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.torch.localread import LocalStore, source_for
from ptcfs.fuse.writing import WriteSession
from ptcfs.server.net.peer import PeerClient
from tests.daemons import client, running

NOBODY = 65534
pytestmark = pytest.mark.multihost


@functools.cache
def _setpriv() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to run a command as another user"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed (util-linux)"
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        sys.executable, "-c", "pass"], capture_output=True, text=True,
                       timeout=60, cwd="/")
    if r.returncode != 0:
        return f"uid {NOBODY} cannot run {sys.executable}: {r.stderr.strip()[:160]}"
    return None


def as_nobody(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd="/")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every user may enter (pytest's own is root's only)."""
    d = Path(tempfile.mkdtemp(prefix="ptc-modes-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_spool_is_the_owners_only(tmp_path):
    old = os.umask(0o022)
    try:
        WriteSession(tmp_path / "spool", "j", 0, None, [])
    finally:
        os.umask(old)
    assert mode(tmp_path / "spool") == 0o700


@pytest.mark.skipif(_setpriv() is not None, reason=str(_setpriv()))
def test_other_users_cannot_read_a_store_and_the_client_falls_back(open_dir):
    with running(open_dir, 1, keys=False) as lc:  # uid 65534 may not read the keys
        c = client(lc)
        a = np.arange(4096, dtype=np.float32)
        c.call("begin_at", job="j", version=1)
        c.put("j", 1, "w", "full", a)
        c.call("commit", job="j", version=1)
        c.close()
        store = lc.dir / "h0"
        assert mode(store) == 0o700
        assert mode(store / "data.mdb") == 0o600 and mode(store / "lock.mdb") == 0o600
        # the owner reads the store directly
        cluster = Cluster.load(lc.cluster_file)
        src = source_for(cluster, "h0")
        assert isinstance(src, LocalStore)
        assert bytes(src.read_into("j", 1, "w", "full")) == a.tobytes()
        # another user: the files are refused, the client goes through the daemon
        store.chmod(0o755)  # even where the folder is opened up by hand
        code = f"""
import errno, json
from pathlib import Path
from ptcfs.client.control.conn import Cluster
from ptcfs.client.torch.localread import source_for
refused = []
for name in ("data.mdb", "lock.mdb"):
    try:
        open(Path({str(store)!r}) / name, "rb").read(1)
    except PermissionError as e:
        refused.append(e.errno == errno.EACCES)
src = source_for(Cluster.load({str(lc.cluster_file)!r}), "h0")
data = bytes(src.read_into("j", 1, "w", "full"))
print(json.dumps({{"refused": refused, "source": type(src).__name__, "n": len(data),
                  "sum": sum(data)}}))
"""
        out = as_nobody(code, {"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["refused"] == [True, True]
        assert got["source"] == PeerClient.__name__
        assert got["n"] == a.nbytes and got["sum"] == sum(a.tobytes())
        store.chmod(0o700)
