"""Each host's part of a plan, and how it travels to that host's daemon.

The coordinator splits a :class:`~ptcfs.types.Plan` into one
:class:`HostWork` per destination host in a single pass over the plan
(:func:`split_plan`), sends each with :func:`encode` as the ``stage``
request's arguments, and the daemon rebuilds the same typed objects with
:func:`decode` for its executor: the planner's :class:`~ptcfs.types.Transfer`
is what the executor carries out, end to end. Slices travel as their store
keys (:meth:`~ptcfs.types.Slice.key`), boxes as lists of pairs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ptcfs.boxes import Box
from ptcfs.errors import InvalidRequest
from ptcfs.sharding import placement
from ptcfs.types import Endpoint, Entry, ModelSpec, Plan, Slice, Transfer

__all__ = ["HostWork", "split_plan", "encode", "decode"]


@dataclass(frozen=True)
class HostWork:
    """What one host builds in a new version: the entries it will hold, and
    the transfers that fill them (every transfer's ``dst.host`` is ``host``)."""

    host: str
    entries: tuple[Entry, ...]
    transfers: tuple[Transfer, ...]


def split_plan(plan: Plan, model: ModelSpec, replicas: int = 1,
               ring: tuple[str, ...] = ()) -> dict[str, HostWork]:
    """Every new host's work: one pass over the new placement and one over
    the transfers."""
    entries: dict[str, list[Entry]] = {h.name: [] for h in plan.new.hosts}
    for spec in model.tensors_for(plan.new.pp):
        for sl, hosts in placement(model, plan.new, spec, replicas, ring).items():
            entry = Entry(spec.name, sl, sl.local_shape(spec.shape), spec.dtype)
            for h in hosts:
                entries.setdefault(h, []).append(entry)
    moves: dict[str, list[Transfer]] = defaultdict(list)
    for t in plan.transfers:
        moves[t.dst.host].append(t)
    return {h: HostWork(h, tuple(e), tuple(moves.get(h, ()))) for h, e in entries.items()}


def encode(work: HostWork) -> dict[str, Any]:
    """The ``stage`` arguments that carry ``work`` (msgpack-friendly)."""
    return {
        "entries": [[e.tensor, e.slice.key(), list(e.shape), e.dtype] for e in work.entries],
        "transfers": [[t.src.host, t.src.rank, t.src.tensor, t.src.slice.key(), _list(t.src.box),
                       t.dst.rank, t.dst.tensor, t.dst.slice.key(), _list(t.dst.box),
                       t.nbytes, list(t.dst_ranks)] for t in work.transfers],
    }


def decode(host: str, args: dict[str, Any]) -> HostWork:
    """The :class:`HostWork` that :func:`encode` sent to ``host``;
    InvalidRequest when the arguments are malformed."""
    try:
        entries = tuple(Entry(str(t), Slice.from_key(str(k)), tuple(int(n) for n in shape),
                              str(dt)) for t, k, shape, dt in args["entries"])
        transfers = tuple(
            Transfer(Endpoint(str(sh), int(sr), str(st), Slice.from_key(str(sk)), _box(sb)),
                     Endpoint(host, int(dr), str(dt), Slice.from_key(str(dk)), _box(db)),
                     int(n), tuple(int(r) for r in ranks))
            for sh, sr, st, sk, sb, dr, dt, dk, db, n, ranks in args["transfers"])
    except (KeyError, TypeError, ValueError, IndexError):
        raise InvalidRequest("stage: malformed entries or transfers") from None
    return HostWork(host, entries, transfers)


def _list(box: Box) -> list[list[int]]:
    return [[a, b] for a, b in box]


def _box(raw: Any) -> Box:
    return tuple((int(a), int(b)) for a, b in raw)
