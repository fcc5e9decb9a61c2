"""Repairing a job's copies after hosts are lost: what to copy where.

A pure function of the job's current record, the live hosts and what each
of them holds (:func:`plan_repair`); the daemon's ``repair`` operation
(:mod:`ptcfs.server.ops.repair`) carries it out.

The record. A repaired version is a new version of the job with the same
configuration, ring and step, whose record (:class:`~ptcfs.jobstate.JobState`)
also names the hosts declared lost (``lost``: they hold nothing of it) and
the copies placed beyond the ring's (``holders``). :meth:`JobState.placement
<ptcfs.jobstate.JobState.placement>` applies both, so everything that asks
where a copy lives (reads, ``fetch_tensor``, ``verify``, saves, the mount,
the planner's next reconfiguration) sees the repaired copies. A new version,
rather than new entries in the current one, because committed versions are
immutable and the two-phase commit makes the new record appear on every
host at once: a repair cut short leaves the old version current and whole.
A reconfiguration places every copy afresh and drops both lists.

For every sub-tensor of the current version:

1. its holders are the hosts the record names, less the lost ones; a live
   holder that lacks it (it was down when the version was written) gets a
   copy and stays a holder;
2. when fewer than ``replicas`` live hosts would then hold it, new holders
   are chosen among the live hosts that do not, least-loaded first (bytes
   of the job held, counting the copies given so far), largest pieces
   first;
3. every copy comes from the live holder that has sent least so far.

Every host of the new version builds it from its own copies (shared with
the old version, nothing copied) and the new copies, fetched from peers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ptcfs.errors import StateLost
from ptcfs.jobstate import JobState
from ptcfs.plan.stagework import HostWork
from ptcfs.types import Endpoint, Entry, Slice, Transfer, full_box

__all__ = ["Copy", "RepairPlan", "plan_repair"]


@dataclass(frozen=True)
class Copy:
    """One new copy of a sub-tensor: from a live holder to a host."""

    tensor: str
    part: str
    nbytes: int
    src: str
    dst: str


@dataclass(frozen=True)
class RepairPlan:
    old: JobState
    new: JobState
    copies: tuple[Copy, ...]
    #: every live host's part of the new version
    work: dict[str, HostWork]

    @property
    def bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


def plan_repair(state: JobState, live: Sequence[str], have: Mapping[str, set[tuple[str, str]]],
                lost: Sequence[str] = ()) -> RepairPlan | None:
    """The repair of ``state`` (see the module docstring), or None when
    every sub-tensor has its copies on live hosts and no lost host is named.

    ``live``: the hosts that answer, in the cluster's order; ``have``: for
    each live host, the ``(tensor, slice key)`` it holds in ``state``'s
    version; ``lost``: hosts declared lost (every host not in ``live`` is
    treated as lost too). StateLost, naming the first piece, when some
    sub-tensor has no live copy."""
    model = state.model_spec()
    gone = frozenset(state.lost) | frozenset(lost)
    alive = set(live) - gone
    live = [h for h in live if h in alive]
    specs = model.tensors_for(state.config.pp)
    pieces: list[tuple[int, str, Slice, list[str], list[str], list[str]]] = []
    named_gone: set[str] = set()
    load = {h: 0 for h in live}
    for spec in specs:
        for sl, hosts in state.placement(spec, model).items():
            nbytes = spec.itemsize * _volume(sl.local_shape(spec.shape))
            key = (spec.name, sl.key())
            holding = [h for h in hosts if h in alive and key in have.get(h, ())]
            lacking = [h for h in hosts if h in alive and h not in holding]
            named_gone.update(h for h in hosts if h not in alive or h in gone)
            if not holding:
                where = ", ".join(hosts) or "no host"
                raise StateLost(f"{spec.name} [{sl.key()}] of job {state.job!r} has no live copy "
                                f"(it was on {where}); it cannot be repaired")
            for h in holding:
                load[h] += nbytes
            pieces.append((nbytes, spec.name, sl, list(hosts), holding, lacking))
    new_lost = tuple(sorted(set(state.lost) | named_gone))
    extra = {(t, p): list(hs) for t, p, hs in state.holders}
    copies: list[Copy] = []
    sent = {h: 0 for h in live}
    for nbytes, name, sl, named, holding, lacking in sorted(pieces, key=lambda p: -p[0]):
        room = [h for h in live if h not in named]
        want = max(0, state.replicas - len(holding) - len(lacking))
        added = sorted(room, key=lambda h: (load[h], live.index(h)))[:want]
        if added:
            extra[(name, sl.key())] = extra.get((name, sl.key()), []) + added
        for dst in lacking + added:
            src = min(holding, key=lambda h: (sent[h], live.index(h)))
            sent[src] += nbytes
            load[dst] += nbytes
            copies.append(Copy(name, sl.key(), nbytes, src, dst))
    if not copies and new_lost == state.lost:
        return None
    holders = tuple(sorted((t, p, tuple(h for h in hs if h not in named_gone))
                           for (t, p), hs in extra.items()))
    new = state.with_(version=state.version + 1, lost=new_lost,
                      holders=tuple(x for x in holders if x[2]))
    return RepairPlan(state, new, tuple(copies), _work(new, copies, live))


def _work(new: JobState, copies: list[Copy], live: Sequence[str]) -> dict[str, HostWork]:
    """Each live host's entries in ``new`` and the transfers that fill them:
    its own copies, or the new ones from their sources."""
    model = new.model_spec()
    source = {(c.tensor, c.part, c.dst): c.src for c in copies}
    entries: dict[str, list[Entry]] = {h: [] for h in live}
    moves: dict[str, list[Transfer]] = {h: [] for h in live}
    for spec in model.tensors_for(new.config.pp):
        for sl, hosts in new.placement(spec, model).items():
            shape = sl.local_shape(spec.shape)
            box = full_box(shape)
            nbytes = spec.itemsize * _volume(shape)
            for h in hosts:
                entries[h].append(Entry(spec.name, sl, shape, spec.dtype))
                src = source.get((spec.name, sl.key(), h), h)
                moves[h].append(Transfer(Endpoint(src, -1, spec.name, sl, box),
                                         Endpoint(h, -1, spec.name, sl, box), nbytes))
    return {h: HostWork(h, tuple(entries[h]), tuple(moves[h])) for h in live if entries[h]}


def _volume(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
