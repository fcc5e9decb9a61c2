"""The workers of a job as one gang: who is who, and a step that one rank (or
every rank) takes and all learn the outcome of.

The gang is torch.distributed's default process group; a process without
one (a notebook, a single-GPU script) is a gang of one, rank 0. A ptcfs
error on a rank becomes one :class:`~ptcfs.client.torch.elastic.WorkerError` on
every rank, naming the rank, so no worker trains on while another has
failed; errors other than ptcfs's propagate on the rank that met them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ptcfs.errors import PtcError, WorkerError

__all__ = ["rank_world", "on_rank0", "on_every", "gather", "barrier"]

T = TypeVar("T")


def _live() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    return (dist.get_rank(), dist.get_world_size()) if _live() else (0, 1)


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank."""
    if not _live():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if _live():
        dist.barrier()


def on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0; its result on every rank, or its ptcfs error
    raised on every rank as a WorkerError."""
    box: list[Any] = [None]
    if rank_world()[0] == 0:
        try:
            box[0] = ("ok", fn())
        except PtcError as e:
            box[0] = ("error", f"{type(e).__name__}: {e}")
    if _live():
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise WorkerError(f"rank 0: {value}")
    return value  # type: ignore[no-any-return]


def on_every(fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it fails on any with a ptcfs error, every
    rank raises one WorkerError naming each rank that failed and why."""
    err: str | None = None
    value: Any = None
    try:
        value = fn()
    except PtcError as e:
        err = f"rank {rank_world()[0]}: {type(e).__name__}: {e}"
    failed = [e for e in gather(err) if e]
    if failed:
        raise WorkerError("; ".join(failed))
    return value  # type: ignore[no-any-return]
