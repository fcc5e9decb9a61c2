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
from ptcfs.types import Endpoint, Entry, ModelSpec, Plan, Slice, Transfer, gc_paused

__all__ = ["HostWork", "split_plan", "encode", "decode"]


@dataclass(frozen=True)
class HostWork:
    """What one host builds in a new version: the entries it will hold, and
    the transfers that fill them (every transfer's ``dst.host`` is ``host``)."""

    host: str
    entries: tuple[Entry, ...]
    transfers: tuple[Transfer, ...]


@gc_paused()
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


#: Numbers per transfer in :func:`encode`'s flat list: source host, rank,
#: tensor, slice, box; destination rank, tensor, slice, box; bytes; the
#: destination's ranks. Names, slices, boxes and rank lists are numbers into
#: tables.
_FIELDS = 11


@gc_paused()
def encode(work: HostWork) -> dict[str, Any]:
    """The ``stage`` arguments that carry ``work`` (msgpack-friendly and
    compact: every name, slice, box and rank list is sent once, in a table,
    and each transfer is eleven numbers into them)."""
    names: dict[str, int] = {}  # hosts and tensors
    slices: dict[Slice, int] = {}
    boxes: dict[Box, int] = {}
    ranks: dict[tuple[int, ...], int] = {}
    name, sl, box, rank = names.setdefault, slices.setdefault, boxes.setdefault, ranks.setdefault
    flat: list[int] = []
    add = flat.extend
    for t in work.transfers:
        s, d = t.src, t.dst
        add((name(s.host, len(names)), s.rank, name(s.tensor, len(names)),
             sl(s.slice, len(slices)), box(s.box, len(boxes)), d.rank,
             name(d.tensor, len(names)), sl(d.slice, len(slices)), box(d.box, len(boxes)),
             t.nbytes, rank(t.dst_ranks, len(ranks))))
    return {
        "entries": [[e.tensor, e.slice.key(), list(e.shape), e.dtype] for e in work.entries],
        "names": list(names),
        "slices": [x.key() for x in slices],
        "boxes": [_list(b) for b in boxes],
        "ranks": [list(r) for r in ranks],
        "transfers": flat,
    }


@gc_paused()
def decode(host: str, args: dict[str, Any]) -> HostWork:
    """The :class:`HostWork` that :func:`encode` sent to ``host``;
    InvalidRequest when the arguments are malformed."""
    try:
        entries = tuple(Entry(str(t), Slice.from_key(str(k)), tuple(int(n) for n in shape),
                              str(dt)) for t, k, shape, dt in args["entries"])
        names = [str(x) for x in args["names"]]
        slices = [Slice.from_key(str(x)) for x in args["slices"]]
        boxes = [_box(b) for b in args["boxes"]]
        ranks = [tuple(int(r) for r in rs) for rs in args["ranks"]]
        flat = args["transfers"]
        if len(flat) % _FIELDS or not all(isinstance(n, int) and n >= 0 for n in flat[9::11]):
            raise ValueError
        transfers = tuple(
            Transfer(Endpoint(names[sh], int(sr), names[st], slices[ss], boxes[sb]),
                     Endpoint(host, int(dr), names[dt], slices[ds], boxes[db]),
                     int(n), ranks[rk])
            for sh, sr, st, ss, sb, dr, dt, ds, db, n, rk
            in zip(*(iter(flat),) * _FIELDS))
    except (KeyError, TypeError, ValueError, IndexError):
        raise InvalidRequest("stage: malformed entries or transfers") from None
    return HostWork(host, entries, transfers)


def _list(box: Box) -> list[list[int]]:
    return [[a, b] for a, b in box]


def _box(raw: Any) -> Box:
    return tuple((int(a), int(b)) for a, b in raw)
