"""The launcher of a live job: it starts the workers and tells them of changes.

It is the rendezvous of the job: a ``torch.distributed.TCPStore`` (the
store torchrun's agents use too) that every worker reaches at
``PTC_LIVE_STORE``. A *generation* (:class:`~ptcfs.types.Generation`) is the
membership the launcher decides: it writes ``gen/<n>`` there (JSON), the
workers take it up at the first step boundary at or after its ``at_step``
(:mod:`ptcfs.client.live.worker`), and the first worker of the new
generation writes ``applied/<n>`` (the step) when they run on it.

Call order of the launcher (:class:`Launcher`):

1. :meth:`Launcher.spawn` starts the workers of the first generation and
   any standby ones (warm: they import torch and the script, connect to
   the store and wait, costing no training time);
2. :meth:`Launcher.post` writes generation 1, then each change (shrink:
   fewer of the current workers; grow: with standby ones; replace: one out,
   one in) once the one before it was applied (:meth:`Launcher.applied`);
3. a watcher thread sees a worker of the current generation exit with a
   failure and posts the next generation without it (``lost``); the
   survivors, whose collectives failed when it died, take it up;
4. :meth:`Launcher.finish` waits for the workers, then writes ``stop`` so
   that standby workers exit, and ends any process of its own still there.

Workers report their pid at each generation (``pid/<n>/<name>``), so
:meth:`Launcher.restarted` counts survivors that got a new process (0 by
construction, and measured).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ptcfs import settings
from ptcfs.client.live.group import await_key
from ptcfs.errors import LiveError
from ptcfs.types import Generation

__all__ = ["Launcher"]


class Launcher:
    """Steps 1–4 of the module docstring, for workers on this machine."""

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None,
                 logs: Path | None = None) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=settings.get("PTC_LIVE_TIMEOUT_S")))
        self.address = f"127.0.0.1:{self.store.port}"
        self.command, self.env, self.logs = list(command), dict(env or os.environ), logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.generations: list[Generation] = []
        self.losses: list[tuple[str, int, float]] = []  # (worker, exit status, time)
        self._lock = threading.Lock()
        self._closed = False

    # -- workers -----------------------------------------------------------
    def spawn(self, name: str) -> int:
        """Start worker ``name``; its pid."""
        env = dict(self.env, PTC_LIVE_STORE=self.address, PTC_LIVE_NAME=name)
        out = open(self.logs / f"{name}.log", "wb") if self.logs else subprocess.DEVNULL  # noqa: SIM115
        p = subprocess.Popen(self.command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = p
        threading.Thread(target=self._watch, args=(name, p), daemon=True).start()
        return p.pid

    def ready(self, names: Sequence[str], timeout: float = 120.0) -> None:
        """Wait until ``names`` have started and reached the store."""
        for n in names:
            try:
                await_key(self.store, f"ready/{n}", timeout,
                          lambda n=n: self.procs[n].poll() is not None)  # type: ignore[misc]
            except LiveError as e:
                raise LiveError(f"worker {n} did not start within {timeout:.0f} s") from e
            if not self.store.check([f"ready/{n}"]):
                raise LiveError(f"worker {n} exited with status {self.procs[n].poll()} "
                                "before it reached the store")
            running = self.generations[-1].workers if self.generations else ()
            if n not in running and self.procs[n].poll() is not None:  # a failed standby
                raise LiveError(f"worker {n} exited with status {self.procs[n].poll()} "
                                "while it waited to be called; see its log")

    def _watch(self, name: str, p: subprocess.Popen[bytes]) -> None:
        code = p.wait()
        with self._lock:
            current = self.generations[-1] if self.generations else None
            if code == 0 or self._closed or current is None or name not in current.workers:
                return
            self.losses.append((name, code, time.time()))
            self._post([w for w in current.workers if w != name], lost=(name,))

    # -- generations -------------------------------------------------------
    @property
    def current(self) -> Generation:
        if not self.generations:
            raise LiveError("no generation was posted yet")
        return self.generations[-1]

    def post(self, workers: Sequence[str], at_step: int = 0) -> Generation:
        """Write the next generation: ``workers`` in rank order."""
        with self._lock:
            return self._post(workers, at_step=at_step)

    def _post(self, workers: Sequence[str], at_step: int = 0,
              lost: tuple[str, ...] = ()) -> Generation:
        prev = self.generations[-1].workers if self.generations else ()
        gen = Generation(len(self.generations) + 1, tuple(workers), prev, lost, time.time(),
                         at_step)
        self.generations.append(gen)
        record = asdict(gen)
        self.store.set(f"gen/{gen.number}", json.dumps(record))
        self.store.add("gen", 1)
        return gen

    def applied(self, number: int, timeout: float = 120.0) -> int:
        """Wait until generation ``number`` runs; the step it took effect at."""
        gen = self.generations[number - 1]

        def all_exited() -> bool:
            return all(self.procs[w].poll() is not None for w in gen.workers if w in self.procs)

        if not await_key(self.store, f"applied/{number}", timeout, all_exited):
            raise LiveError(f"the workers of generation {number} all exited before it ran")
        return int(self.store.get(f"applied/{number}").decode())

    def pids(self, number: int) -> dict[str, int]:
        """The pid each worker of generation ``number`` reported there."""
        out = {}
        for w in self.generations[number - 1].workers:
            key = f"pid/{number}/{w}"
            if self.store.check([key]):
                out[w] = int(self.store.get(key).decode())
        return out

    def restarted(self) -> int:
        """Workers of two consecutive generations whose pid differs."""
        count = 0
        for n in range(2, len(self.generations) + 1):
            before, after = self.pids(n - 1), self.pids(n)
            count += sum(1 for w, pid in after.items() if w in before and before[w] != pid)
        return count

    # -- the end -----------------------------------------------------------
    def finish(self, timeout: float = 300.0) -> dict[str, int | None]:
        """Step 4: each worker's exit status (None: it was ended here)."""
        deadline = time.monotonic() + timeout
        last = self.generations[-1].workers if self.generations else ()
        for w in last:
            p = self.procs.get(w)
            if p is not None:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        with self._lock:
            self._closed = True
            self.store.set("stop", "1")
        out: dict[str, int | None] = {}
        for w, p in self.procs.items():
            try:
                out[w] = p.wait(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                out[w] = None
        return out

    def close(self) -> None:
        """End every worker this launcher started that still runs."""
        with self._lock:
            self._closed = True
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
