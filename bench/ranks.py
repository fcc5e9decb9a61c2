"""Rank processes for benchmarks that need several training ranks.

:class:`Ranks` spawns ``world`` processes joined in one gloo process group
(with torchrun's environment variables set: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
builds one ``factory(rank, world, *args)`` object in each, and then runs
the same method on every rank per :meth:`Ranks.call`, returning one reply
per rank. A failure on any rank raises with every rank's traceback.
:func:`timed` measures a piece of work from a barrier before it to a
barrier after it: the time until the slowest rank is done.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ptcfs.server.testing.localcluster import free_port

__all__ = ["Ranks", "timed"]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds from a barrier before ``fn`` to one after it, its result)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _serve(rank: int, world: int, port: int, factory: Any, args: tuple[Any, ...],
           conn: Connection) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        me = factory(rank, world, *args)
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        cmd, cargs = conn.recv()
        if cmd == "quit":
            close = getattr(me, "close", None)
            if close is not None:
                close()
            dist.destroy_process_group()
            return
        try:
            conn.send(("ok", getattr(me, cmd)(*cargs)))
        except BaseException:  # noqa: BLE001 - the parent reports it
            conn.send(("error", traceback.format_exc()))


class Ranks:
    """``world`` rank processes, commanded all at once from the parent."""

    def __init__(self, world: int, factory: Any, *args: Any):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, world, port, factory, args, child),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        try:
            self._gather("start")
        except BaseException:
            self.close()
            raise

    def _gather(self, what: str) -> list[Any]:
        out, errors = [], []
        for rank, c in enumerate(self.conns):
            try:
                status, value = c.recv()
            except EOFError:
                status, value = "error", "the process died"
            if status != "ok":
                errors.append(f"rank {rank}: {value}")
            out.append(value)
        if errors:
            raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
        return out

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """Run method ``cmd`` on every rank; the replies, by rank."""
        for c in self.conns:
            c.send((cmd, args))
        return self._gather(cmd)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("quit", ()))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
