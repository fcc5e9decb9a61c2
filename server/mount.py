"""The mount process: one host's ``/ptc`` filesystem.

Started by ``ptcd --mount DIR`` (as its child, which dies with it) or by
``ptcctl mount DIR --host-id H``. It runs apart from the daemon so that
nothing done through the filesystem can stop the daemon, and:

- reads the host's LMDB store directly, read-only and zero-copy (LMDB
  serves several processes);
- fetches remote pieces from the peer daemons over ZeroMQ;
- puts written state through the local daemon (``open_save`` then ``put``);
- reads each job's current version into the page cache in the background
  (:mod:`ptcfs.fuse.warming`), and writes how far it got to
  ``<store>/mount.json``, which the daemon's health reports.

Call order: :func:`clear_stale` (a mount left by a crash is unmounted),
then ``FUSE(...)`` until SIGTERM/SIGINT or ``fusermount3 -u``; the ready
file is written once the kernel has sent FUSE's INIT.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs import settings
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import (
    EXIT_FAILED,
    InvalidConfig,
    JobNotFound,
    PeerError,
    PtcError,
    StoreError,
    TensorNotFound,
    VersionNotCommitted,
    VersionNotFound,
    exit_code,
)
from ptcfs.fuse.dcpwrite import DcpSaves
from ptcfs.fuse.fs import PtcFS, PtcFuse
from ptcfs.fuse.hfwrite import HfSaves
from ptcfs.fuse.reading import ReadServer
from ptcfs.fuse.tally import Tally
from ptcfs.fuse.tree import Catalog
from ptcfs.fuse.warming import Warmer, status_path, warm_budget, watch_commits
from ptcfs.server.mountsave import MountSaver
from ptcfs.server.net.cluster import ClusterSpec, load_cluster
from ptcfs.server.net.keys import CurveKeys, load_keys
from ptcfs.server.net.peer import PeerClient
from ptcfs.server.net.registry import open_registry, resolve
from ptcfs.store.lmdb_store import LmdbStore
from ptcfs.types import Box

__all__ = ["main", "clear_stale", "is_mounted", "unmount", "PeerRemote", "MountChild"]

log = logging.getLogger("ptcfs.mount")

#: Seconds ``ptcd --mount`` waits for the mount to stop (how long it waits
#: for it to start, a peer's answer and the read-ahead are settings:
#: PTC_MOUNT_START_TIMEOUT_S, PTC_MOUNT_PEER_TIMEOUT_S, PTC_MOUNT_READAHEAD_KB).
STOP_TIMEOUT_S = 10.0


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point (per /proc/self/mounts; no request
    to the mount itself, which may be dead)."""
    target = os.path.abspath(path)
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == target for line in f if len(line.split()) > 1)
    except OSError:
        return False


def _device(path: Path) -> str:
    """``major:minor`` of the filesystem mounted at ``path`` (mount table)."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == target:
                return fields[2]
    raise FileNotFoundError(errno.ENOENT, f"{path} is not mounted")


def _abort_connection(dev: str) -> None:
    """Abort a FUSE connection whose server hangs or is gone (fusectl), so
    that every process waiting on it gets an error instead of waiting."""
    conns = Path("/sys/fs/fuse/connections")
    if not (conns / "0").exists() and not any(conns.glob("*")):
        subprocess.run(["mount", "-t", "fusectl", "none", str(conns)], capture_output=True)
    try:
        (conns / dev.split(":")[1] / "abort").write_text("1")
    except OSError:
        pass


def unmount(path: Path) -> None:
    """Unmount ``path`` now (lazily if busy), live or dead, aborting its
    connection so that nothing waits on it."""
    try:
        dev: str | None = _device(path)
    except OSError:
        dev = None
    if dev is not None:
        _abort_connection(dev)
    tool = shutil.which("fusermount3") or "fusermount3"
    r = subprocess.run([tool, "-u", "-z", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def clear_stale(path: Path) -> bool:
    """Unmount ``path`` if a crashed mount left it dead ("Transport endpoint
    is not connected"); True if it did. A live mount is an error."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            raise
        unmount(path)
        log.warning("cleared a stale mount left at %s", path)
        return True
    if is_mounted(path):
        raise StoreError(f"{path} is mounted already; unmount it first (fusermount3 -u {path})")
    return False


class PeerRemote:
    """Reads from the cluster's daemons, trying each holder in turn."""

    def __init__(self, cluster: ClusterSpec, host_id: str, keys: CurveKeys | None):
        self.cluster = cluster
        self.host_id = host_id
        self.keys = keys
        self._lock = threading.Lock()
        self._peers: dict[str, PeerClient] = {}

    def peer(self, host: str) -> PeerClient:
        with self._lock:
            if host not in self._peers:
                if host not in self.cluster.names and self.cluster.registry is not None:
                    self.cluster = registry_cluster(self.cluster)  # a host that joined since
                self._peers[host] = PeerClient(
                    self.cluster.host(host).address, host_id=f"{self.host_id}-mount",
                    curve=self.keys, timeout_s=settings.get("PTC_MOUNT_PEER_TIMEOUT_S"),
                    peer_name=host)
            return self._peers[host]

    def _each(self, hosts: tuple[str, ...], what: str, fn: Any) -> None:
        """``fn`` on the first holder that answers. A holder that has the
        version staging (it is rolling forward to it, say) is skipped, and
        where none has it committed yet, all are asked again, with backoff,
        for up to PTC_MOUNT_PEER_TIMEOUT_S: a reader waits a moment rather
        than being given bytes that are not the version's."""
        deadline = time.monotonic() + settings.get("PTC_MOUNT_PEER_TIMEOUT_S")
        pause = 0.02
        while True:
            errors, staging = [], False
            for h in hosts:
                try:
                    fn(self.peer(h))
                    return
                except VersionNotCommitted as e:
                    staging = True
                    errors.append(f"{h}: {e}")
                except (PeerError, TensorNotFound, VersionNotFound, JobNotFound) as e:
                    errors.append(f"{h}: {e}")  # down, or lost its copy: the next holder
            if not staging or time.monotonic() + pause > deadline:
                raise PeerError(f"{what}: no holder answered "
                                f"({'; '.join(errors) or 'no holders'})")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def read_range(self, hosts: tuple[str, ...], job: str, version: int, tensor: str,
                   part: str, offset: int, length: int, out: memoryview) -> None:
        self._each(hosts, f"{tensor} [{part}]",
                   lambda p: p.read_into(job, version, tensor, part, offset, length, out))

    def read_box(self, hosts: tuple[str, ...], job: str, version: int, tensor: str, part: str,
                 box: Box, itemsize: int, out: memoryview) -> None:
        self._each(hosts, f"{tensor} [{part}]",
                   lambda p: p.read_box(job, version, tensor, part, box, itemsize, out))

    def put(self, job: str, tensor: str, part: str, data: memoryview, shape: tuple[int, ...],
            dtype: str, **about: Any) -> None:
        """Into the job's open save version on this host (opened if needed);
        ``about``: the writer's ``uid`` and ``rank``, for the audit trail."""
        local = self.peer(self.host_id)
        version = int(local.call("open_save", job=job, **about)["version"])
        arr = np.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape)
        local.put(job, version, tensor, part, arr, dtype, saving=True, **about)

    def pin(self, held: dict[tuple[str, int], int]) -> None:
        """Tell this host's daemon which versions this mount's files read."""
        self.peer(self.host_id).call("pins", owner=os.getpid(),
                                     pins=[[j, v, n] for (j, v), n in sorted(held.items())])

    def close(self) -> None:
        with self._lock:
            for p in self._peers.values():
                p.close()


def registry_cluster(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` with its registry's hosts (itself without a registry)."""
    if spec.registry is None:
        return spec
    registry = open_registry(spec)
    try:
        return resolve(spec, registry)[0]
    finally:
        registry.close()


def run(cluster: ClusterSpec, host_id: str, mount: Path, ready_file: Path | None,
        debug: bool = False) -> None:
    """Mount and serve until unmounted or signalled (see the module docstring)."""

    clear_stale(mount)
    mount.mkdir(parents=True, exist_ok=True)
    host = cluster.host(host_id)
    store = LmdbStore(host.store, readonly=True)
    keys = _keys(cluster.curve_dir) if cluster.curve_dir else None
    remote = PeerRemote(cluster, host_id, keys)
    spool = Path(host.store) / "spool"

    mounted = threading.Event()
    catalog = Catalog(store)
    tally = Tally()
    warmer = Warmer(mount.resolve(), status_path(host.store), tally.snapshot)
    stop_watch = threading.Event()
    watch = threading.Thread(target=watch_commits, name="mount-watch", daemon=True,
                             args=(catalog, host_id, warmer, warm_budget(),
                                   settings.get("PTC_MOUNT_WARM_MIN_BYTES"), stop_watch))

    def ready() -> None:
        mounted.set()
        _raise_readahead(mount)
        watch.start()
        if ready_file is not None:
            tmp = ready_file.with_name(ready_file.name + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "host": host_id,
                                       "mount": str(mount)}) + "\n")
            tmp.replace(ready_file)
        log.info("mounted %s for host %s", mount, host_id)

    saver = MountSaver(cluster, host_id)
    fs = PtcFS(catalog, ReadServer(store, host_id, remote, tally), remote.put, spool, ready, warmer,
               remote.pin, DcpSaves(spool, remote.put, saver.commit), saver.drop,
               HfSaves(spool, remote.put, saver.commit))
    # the kernel checks each caller against the owner and mode the job's record
    # gives its files (PtcFS.getattr); writes also check the caller's uid
    options: dict[str, Any] = {"fsname": f"ptcfs-{host_id}", "subtype": "ptcfs",
                               "default_permissions": True}
    if os.geteuid() == 0:
        options["allow_other"] = True
    if fs.max_read is not None:
        options["max_read"] = fs.max_read
    try:
        PtcFuse(fs, str(mount), raw_fi=True, foreground=True, nothreads=False,
                debug=debug, **options)
    except RuntimeError:
        if not mounted.is_set():
            raise
        # libfuse reports an exit by SIGTERM/SIGINT as an error; it unmounted cleanly
    finally:
        stop_watch.set()
        if watch.is_alive():
            watch.join(10)  # before the store closes under it
        fs.stop()
        fs.server.close()
        saver.close()
        remote.close()
        store.close()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)


def _keys(directory: Path) -> CurveKeys:
    """The daemons' keys where this process may read them (``ptcd --mount``),
    else its client key (``ptcctl mount`` run by a user: saves through it
    are then that key's, and only a job's writers may make them)."""
    try:
        return load_keys(directory, daemon=True)
    except InvalidConfig:
        return load_keys(directory)


class MountChild:
    """The mount process of ``ptcd --mount DIR``: started once the daemon is
    bound, waited for (its ready file), stopped with the daemon."""

    def __init__(self, cluster_file: str | None, host_id: str, mount: Path, log_level: str):
        self.cluster_file = cluster_file
        self.host_id = host_id
        self.mount = mount
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float | None = None) -> None:
        import tempfile

        ready = Path(tempfile.gettempdir()) / f"ptcfs-mount-{os.getpid()}.ready"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "ptcfs.server.mount", "--host-id", self.host_id,
               "--mount", str(self.mount), "--ready-file", str(ready), "--with-parent",
               "--log-level", self.log_level]
        if self.cluster_file:
            cmd += ["--cluster", self.cluster_file]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + settings.get("PTC_MOUNT_START_TIMEOUT_S", timeout_s)
        while not ready.exists():
            if self.proc.poll() is not None:
                raise StoreError(f"mounting {self.mount} failed (status {self.proc.returncode}; "
                                 "see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise StoreError(f"mounting {self.mount} took more than {timeout_s:.0f} s")
            time.sleep(0.02)
        ready.unlink(missing_ok=True)

    def stop(self) -> None:
        """SIGTERM the mount process (it unmounts), then make sure it is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        try:
            clear_stale(self.mount)
        except StoreError:  # still mounted: the process died before unmounting
            unmount(self.mount)


def _raise_readahead(mount: Path) -> None:
    """Let the kernel read ahead PTC_MOUNT_READAHEAD_KB on this mount (128 KiB by
    default, which makes FUSE requests small); needs root, else skipped."""
    try:
        dev = _device(mount)  # from the mount table: never a request to our own mount
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(settings.get("PTC_MOUNT_READAHEAD_KB")))
    except OSError as e:
        log.info("read-ahead of %s left as it is (%s)", mount, e)


def _die_with_parent() -> None:
    """Ask the kernel to send SIGTERM when the parent (ptcd) dies."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m ptcfs.server.mount --cluster F --host-id H --mount DIR``."""
    ap = argparse.ArgumentParser(prog="ptcfs-mount", description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    ap.add_argument("--host-id", required=True)
    ap.add_argument("--mount", required=True, type=Path)
    ap.add_argument("--ready-file", type=Path)
    ap.add_argument("--with-parent", action="store_true", help="exit when the parent exits")
    ap.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="default: $PTC_LOG_LEVEL, else INFO")
    args = ap.parse_args(argv)
    try:
        settings.check_all()
    except PtcError as e:
        print(f"ptcfs-mount: error: {e}", file=sys.stderr)
        return exit_code(e)
    args.log_level = args.log_level or str(settings.get("PTC_LOG_LEVEL")).upper()
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s ptcfs-mount[{args.host_id}] %(levelname)s "
                               "%(message)s")
    if args.with_parent:
        _die_with_parent()
    try:
        run(registry_cluster(load_cluster(args.cluster)), args.host_id, args.mount,
            args.ready_file)
    except (PtcError, OSError) as e:  # a bad cluster file or host id: 2; the rest: 1
        print(f"ptcfs-mount: error: {e}", file=sys.stderr)
        return exit_code(e)
    except RuntimeError as e:  # mfusepy: the mount failed
        print(f"ptcfs-mount: error: cannot mount {args.mount}: {e} (is /dev/fuse there, and "
              "fusermount3 installed?)", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
