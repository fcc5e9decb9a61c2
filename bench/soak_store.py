"""The soak's faults at rest and of a frozen daemon (a mixin of ``soak.Soak``).

- ``flip_bytes``: a daemon killed, bytes of a random entry of the job's
  current version flipped where they lie in its ``data.mdb``, the daemon
  started again; ``ptcctl verify --deep`` must quarantine the entry, and
  ``ptcctl repair --wait`` restore it from the copy;
- ``truncate_store``: a daemon killed and its ``data.mdb`` cut to half the
  pages it uses; ``ptcd`` must refuse to start naming the damage, start
  with ``--fresh-store``, and ``repair`` (no ``--lost``) restore its copies;
- ``wipe_store``: a daemon killed, its store's files deleted, started
  empty; ``repair`` restores its copies;
- ``freeze_daemon``: a daemon stopped with SIGSTOP for a moment, then
  SIGCONT (callers must see it as slow or dead and carry on).

A heal is tried until it is done (a save or reconfiguration staging makes a
repair refuse: it is tried again), at most HEAL_S; one that does not end is
a failure. A heal that never began (the damaged host's daemon did not start
again, on a loaded machine) or that the soak's end cut short is done at
the end, once every host is up. The end of the soak checks (``verify``
clean) that every fault healed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ptcfs.errors import PtcError
from ptcfs.store.lmdb_store import LmdbStore

__all__ = ["StoreFaults", "STORE_FAULTS"]

#: fault → weight, added to the soak's FAULTS
STORE_FAULTS = {"flip_bytes": 1, "truncate_store": 1, "wipe_store": 1, "freeze_daemon": 1}
#: Seconds a heal may take, retries included.
HEAL_S = 120.0


class StoreFaults:
    """Faults at rest; needs the soak's ``lc``, ``rng``, ``n``, ``faults``,
    ``failures``, ``stop``, ``killed``, ``ctl`` and ``JOB``."""

    lc: Any
    rng: Any
    n: int
    faults: Any
    failures: list[str]
    stop: Any
    killed: dict[str, list[tuple[float, float]]]
    job: str
    #: (fault, deep) whose heal is owed: under way, cut short by the soak's
    #: end, or never begun (the damaged daemon's start failed)
    unhealed: tuple[str, bool] | None = None

    def ctl(self, op: str, *args: str, env: dict[str, str] | None = None
            ) -> tuple[bool, str]:
        raise NotImplementedError

    def _down(self, host: str) -> float:
        down = time.monotonic()
        self.lc.kill(host, signal.SIGKILL)
        return down

    def _up(self, host: str, down: float, flags: tuple[str, ...] = ()) -> None:
        try:
            self.lc.start(host, flags=flags)
        finally:
            self.killed.setdefault(host, []).append((down, time.monotonic()))

    def heal(self, what: str, deep: bool = False, finishing: bool = False) -> bool:
        """``verify --deep`` (with ``deep``), then ``repair --wait`` until it
        is done or finds nothing to do, at most HEAL_S; then ``verify``. A
        heal the soak's end cuts short is left in :attr:`unhealed`, for the
        end to finish (``finishing``) before its checks."""
        deadline = time.monotonic() + HEAL_S
        if deep:
            self.ctl("verify_deep", "verify", self.job, "--deep", "--json")
        while time.monotonic() < deadline and (finishing or not self.stop.is_set()):
            ok, out = self.ctl("repair", "repair", self.job, "--wait", "--json")
            if ok and json.loads(out)["state"] in ("done", "nothing"):
                ok, out = self.ctl("verify", "verify", self.job, "--json")
                if ok and json.loads(out)["ok"]:
                    self.faults[f"{what} healed"] += 1
                    self.unhealed = None
                    return True
            pause = self.rng.uniform(0.5, 2.0)
            if finishing:
                time.sleep(pause)
            else:
                self.stop.wait(pause)
        if finishing or not self.stop.is_set():
            self.failures.append(f"{what} was not healed within {HEAL_S:.0f} s")
            self.unhealed = None
        else:
            self.unhealed = (what, deep)
        return False

    def flip_bytes(self) -> None:
        host = f"h{self.rng.randrange(self.n)}"
        down = self._down(host)
        flipped = False
        try:
            flipped = self._flip(self.lc.dir / host)
            if flipped:
                self.unhealed = ("flip_bytes", True)  # owed, even if the start fails
        finally:
            self._up(host, down)
        self.faults["flip_bytes" if flipped else "flip_bytes (nothing held)"] += 1
        if flipped:
            self.heal("flip_bytes", deep=True)

    def _flip(self, store_dir: Path) -> bool:
        store = LmdbStore(store_dir, readonly=True)
        try:
            version = store.current(self.job)
            if version is None:
                return False
            entries = [e for e in store.entries(self.job, version) if e.nbytes >= 8]
            if not entries:
                return False
            e = self.rng.choice(entries)
            at = self.rng.randrange(e.nbytes - 7)
            with store.reader() as r:
                view = next(r.ranges(self.job, version, e.tensor, e.part, at, 1))
                where = r.file_range(view)
        finally:
            store.close()
        if where is None:
            return False
        fd = os.open(store_dir / "data.mdb", os.O_RDWR)
        try:
            old = os.pread(fd, 8, where[1])
            os.pwrite(fd, bytes(b ^ 0xA5 for b in old), where[1])
        finally:
            os.close(fd)
        return True

    def truncate_store(self) -> None:
        host = f"h{self.rng.randrange(self.n)}"
        down = self._down(host)
        data = self.lc.dir / host / "data.mdb"
        started = False
        try:
            store = LmdbStore(self.lc.dir / host, readonly=True)
            try:
                used = store.stats()["bytes_used"]
            finally:
                store.close()
            os.truncate(data, used // 2)
            self.unhealed = ("truncate_store", False)
            try:
                self.lc.start(host)
                started = True
                self.failures.append(f"ptcd {host} started on a data file cut to half")
            except PtcError as e:
                if "cut short" not in str(e) or "--fresh-store" not in str(e):
                    self.failures.append(f"ptcd {host} refused a cut data file without "
                                         f"saying so: {str(e)[-300:]}")
        finally:
            if started:
                self.killed.setdefault(host, []).append((down, time.monotonic()))
            else:
                self._up(host, down, ("--fresh-store",))
        self.faults["truncate_store"] += 1
        self.heal("truncate_store")

    def wipe_store(self) -> None:
        host = f"h{self.rng.randrange(self.n)}"
        down = self._down(host)
        try:
            for name in ("data.mdb", "lock.mdb"):
                (self.lc.dir / host / name).unlink(missing_ok=True)
            self.unhealed = ("wipe_store", False)
        finally:
            self._up(host, down)
        self.faults["wipe_store"] += 1
        self.heal("wipe_store")

    def freeze_daemon(self) -> None:
        host = f"h{self.rng.randrange(self.n)}"
        proc = self.lc.procs.get(host)
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            self.stop.wait(self.rng.uniform(1.0, 6.0))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        self.faults["freeze_daemon"] += 1
