"""Device-to-device moves of a live job's state, on ptcfs's plan.

The planner (:func:`ptcfs.plan.planner.plan`) is the one contract for stores and
devices. For a live change every worker is its own "host" with one slot
(:func:`worker_config`), so the plan's local transfers are what a worker
keeps of its own memory and its cross-host transfers are exactly the
regions one worker sends another; a lost worker is a lost host, and the
planner takes its regions from the replicas that survive.

Call order (every worker of :attr:`ptcfs.types.Generation.movers`, over a
process group of exactly those workers, in that order):

1. :func:`device_plan` (cached per (model, old, new, lost): a hot switch
   between two meshes computes each direction once);
2. :func:`move`: allocate the new rank's sub-tensors first (zeros where
   they hold padding), copy what this worker keeps, then post the plan's
   cross transfers in the plan's order, in rounds of at most
   ``PTC_LIVE_INFLIGHT_BYTES`` (rounds are cut from the whole plan, so every
   pair of workers posts matching sends and receives; each transfer's tag
   is its place in the plan), each round a ``batch_isend_irecv`` waited
   for before the next. A leaving worker (no new rank) only sends.

A peer that dies during the move raises :class:`~ptcfs.errors.LiveError`
on the workers that talk to it; the launcher then starts the next
generation with it lost.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.distributed as dist

from ptcfs import settings
from ptcfs.boxes import box_index
from ptcfs.client.torch.state import TORCH_DTYPES
from ptcfs.errors import LiveError
from ptcfs.plan.planner import plan
from ptcfs.sharding import rank_tensors
from ptcfs.types import Host, ModelSpec, ParallelConfig, Plan, Slice, TensorSpec, Transfer

__all__ = ["MoveStats", "device_plan", "move", "planned_bytes_in", "worker_config"]


def worker_config(cfg: ParallelConfig, workers: Sequence[str]) -> ParallelConfig:
    """``cfg`` on one host per worker (one slot each), in rank order."""
    if len(workers) != cfg.world:
        raise LiveError(f"{len(workers)} workers for a mesh of {cfg.world} ranks")
    return replace(cfg, hosts=tuple(Host(w, 1) for w in workers))


@lru_cache(maxsize=64)
def device_plan(model: ModelSpec, old: ParallelConfig, new: ParallelConfig,
                lost: frozenset[str] = frozenset()) -> Plan:
    """The plan between two worker layouts (see :func:`worker_config`)."""
    return plan(model, old, new, lost=lost)


def planned_bytes_in(p: Plan, worker: str) -> int:
    """The bytes ``worker`` receives from other workers under ``p``."""
    return sum(t.nbytes for t in p.transfers if t.dst.host == worker and t.src.host != worker)


@dataclass
class MoveStats:
    """What one worker's move did."""

    bytes_kept: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_planned_in: int = 0
    rounds: int = 0
    seconds: float = 0.0


def _allocate(model: ModelSpec, cfg: ParallelConfig, rank: int, fills: set[tuple[str, str]],
              device: torch.device, given: Mapping[str, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor], dict[str, Slice], dict[str, TensorSpec]]:
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, Slice] = {}
    specs: dict[str, TensorSpec] = {}
    for spec, sl in rank_tensors(model, cfg, rank):
        shape, dtype = sl.local_shape(spec.shape), TORCH_DTYPES[spec.dtype]
        zero = (spec.name, sl.key()) in fills
        t = given.get(spec.name)
        if t is not None:
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise LiveError(f"{spec.name}: the tensor to fill is {tuple(t.shape)} "
                                f"{t.dtype}, the plan's sub-tensor {shape} {dtype}")
            if zero:
                t.zero_()
        else:
            t = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
        tensors[spec.name] = t
        slices[spec.name], specs[spec.name] = sl, spec
    return tensors, slices, specs


def _rounds(cross: Sequence[tuple[int, Transfer]], limit: int) -> list[list[tuple[int, Transfer]]]:
    out: list[list[tuple[int, Transfer]]] = [[]]
    used = 0
    for item in cross:
        if out[-1] and used + item[1].nbytes > limit:
            out.append([])
            used = 0
        out[-1].append(item)
        used += item[1].nbytes
    return [r for r in out if r]


def move(p: Plan, me: str, held: Mapping[str, torch.Tensor], model: ModelSpec,
         movers: Sequence[str], device: torch.device | str = "cpu",
         group: dist.ProcessGroup | None = None, inflight: int | None = None,
         into: Mapping[str, torch.Tensor] | None = None
         ) -> tuple[dict[str, torch.Tensor], dict[str, Slice], dict[str, TensorSpec], MoveStats]:
    """Step 2 of the module docstring: the new sub-tensors of worker ``me``
    (empty dicts for a leaving worker) built from ``held`` (its old
    sub-tensors by name; ``{}`` for a joiner) and from its peers. ``movers``:
    the workers in ``group``'s rank order (:attr:`Generation.movers`).
    ``into``: tensors of the new sub-tensors' shapes to fill instead of new
    ones (a hot switch's other module's local shards)."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    peer = {w: i for i, w in enumerate(movers)}
    new_ranks = [i for i, h in enumerate(p.new.hosts) if h.name == me]
    stats = MoveStats(bytes_planned_in=planned_bytes_in(p, me))
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, Slice] = {}
    specs: dict[str, TensorSpec] = {}
    if new_ranks:
        fills = {(t, k) for h, t, k in p.fills if h == me}
        tensors, slices, specs = _allocate(model, p.new, new_ranks[0], fills, dev,
                                           into or {})
    cross: list[tuple[int, Transfer]] = []
    for i, t in enumerate(p.transfers):
        if t.src.host != t.dst.host:
            cross.append((i, t))
        elif t.dst.host == me:
            src = _held(held, t, me)
            tensors[t.dst.tensor][box_index(t.dst.box)].copy_(src[box_index(t.src.box)])
            stats.bytes_kept += t.nbytes
    limit = settings.get("PTC_LIVE_INFLIGHT_BYTES", inflight)
    for whole in _rounds(cross, limit):  # cut from the whole plan: the same on every worker
        batch = [(i, t) for i, t in whole if me in (t.src.host, t.dst.host)]
        if not batch:
            continue
        ops: list[dist.P2POp] = []
        landing: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, t in batch:
            if t.src.host == me:
                buf = _held(held, t, me)[box_index(t.src.box)].contiguous()
                ops.append(dist.P2POp(dist.isend, buf, peer[t.dst.host], group, tag=i))
                stats.bytes_sent += buf.numel() * buf.element_size()
            else:
                dest = tensors[t.dst.tensor][box_index(t.dst.box)]
                buf = dest if dest.is_contiguous() else torch.empty_like(dest,
                                                                       memory_format=torch.contiguous_format)
                ops.append(dist.P2POp(dist.irecv, buf, peer[t.src.host], group, tag=i))
                if buf is not dest:
                    landing.append((dest, buf))
                stats.bytes_received += buf.numel() * buf.element_size()
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as e:
            raise LiveError(f"worker {me}: a peer failed during the move: "
                            f"{str(e).splitlines()[0]}") from e
        for dest, buf in landing:
            dest.copy_(buf)
        stats.rounds += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    stats.seconds = time.perf_counter() - t0
    return tensors, slices, specs, stats


def _held(held: Mapping[str, torch.Tensor], t: Transfer, me: str) -> torch.Tensor:
    src = held.get(t.src.tensor)
    if src is None:
        raise LiveError(f"worker {me} is to send {t.src.tensor} [{t.src.slice.key()}] but "
                        "holds no such tensor")
    return src
