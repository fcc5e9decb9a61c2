"""One mesh per sequence-length group (HotSPa, SOSP'24): group a step's
sequences by length, pick for each group the fastest mesh that fits its
longest sequence, and price the switches between the groups' meshes.

The plan, in order:

1. :func:`length_groups` cuts the lengths into power-of-two buckets (a
   length ``n`` goes to the bucket bounded by the least power of two
   ``>= n``, at least :data:`MIN_BOUND`, or the caller's ``min_bound``);
2. each group's work is its tokens packed into sequences of its bound,
   ``ceil(tokens / bound)`` of them per step (scaled to ``Query.batch``
   sequences a step; estimated on a whole number of sequences per GPU and
   scaled back to the group's share); its mesh is the fastest that fits
   (:func:`suggest`);
3. a switch from one group's mesh to the next moves the parameters and
   their accumulated gradients between GPUs: the planner's transfers
   (:func:`~ptcfs.plan.planner.plan`) with every GPU as its own holder, each
   GPU's sent and received bytes over the intra-host or inter-host link,
   the slowest GPU deciding; a step of ``k > 1`` groups switches ``k``
   times (short to long, and back for the next step);
4. the single-mesh baseline is the mesh, among those that fit the longest
   group, with the least summed time over all groups;
5. neighbouring groups whose merge does not slow the step (the same mesh,
   or switches that cost more than they win) are merged, greedily, the
   best merge first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ptcfs.errors import InvalidConfig
from ptcfs.plan.planner import plan
from ptcfs.suggest.memory import StateClasses
from ptcfs.suggest.search import Estimate, Query, estimate, meshes, suggest
from ptcfs.suggest.steptime import matmul_params
from ptcfs.types import Host, ModelSpec, ParallelConfig

__all__ = ["MIN_BOUND", "LengthGroup", "GroupPlan", "MeshRouting", "length_groups",
           "switch_seconds", "plan_groups", "routing"]

#: The smallest group bound (tokens).
MIN_BOUND = 256


@dataclass(frozen=True)
class LengthGroup:
    """Sequences of at most ``bound`` tokens: how many, their tokens, and
    the mesh chosen for them (``estimate``: the step's share on that mesh)."""

    bound: int
    count: int
    tokens: int
    estimate: Estimate
    seconds: float


@dataclass(frozen=True)
class GroupPlan:
    """Each group's mesh, the switches, and the best single mesh."""

    groups: tuple[LengthGroup, ...]
    switch_seconds: float
    switch_bytes: int
    single: ParallelConfig
    single_seconds: float

    @property
    def seconds(self) -> float:
        return sum(g.seconds for g in self.groups) + self.switch_seconds

    @property
    def speedup(self) -> float:
        return self.single_seconds / self.seconds if self.seconds else 1.0


def length_groups(lengths: Sequence[int], min_bound: int = MIN_BOUND
                  ) -> list[tuple[int, list[int]]]:
    """Step 1: ``(bound, lengths)`` per power-of-two bucket, shortest first."""
    if min_bound < 1:
        raise InvalidConfig(f"min_bound={min_bound}: a bound must be at least 1 token")
    if not lengths:
        raise InvalidConfig("no sequence lengths given")
    buckets: dict[int, list[int]] = {}
    for n in lengths:
        if n < 1:
            raise InvalidConfig(f"a sequence length must be at least 1 token, not {n}")
        bound = max(min_bound, 1 << (int(n) - 1).bit_length())
        buckets.setdefault(bound, []).append(int(n))
    return sorted(buckets.items())


def _group_query(q: Query, bound: int, tokens: float) -> tuple[Query, float]:
    """The group's query (a whole number of sequences per GPU) and the
    fraction of it that is the group's work."""
    world = sum(h.gpus for h in q.hosts)
    step = world * q.micro
    need = tokens / bound
    batch = max(step, math.ceil(need / step) * step)
    return replace(q, seq=bound, batch=batch, old=None), need / batch


def _per_gpu(hosts: tuple[Host, ...]) -> tuple[Host, ...]:
    return tuple(Host(f"{h.name}#{i}", 1) for h in hosts for i in range(h.gpus))


def _weights(model: ModelSpec) -> ModelSpec:
    return replace(model, tensors=tuple(t for t in model.tensors if not t.is_optim),
                   pp_only=tuple(t for t in model.pp_only if not t.is_optim))


def switch_seconds(q: Query, old: ParallelConfig, new: ParallelConfig) -> tuple[float, int]:
    """Step 3 for one switch: ``(seconds, bytes moved between GPUs)``."""
    if old == new:
        return 0.0, 0
    gpus = _per_gpu(q.hosts)
    p = plan(_weights(q.model), replace(old, hosts=gpus), replace(new, hosts=gpus))
    load: dict[str, list[float]] = {}
    for t in p.transfers:
        if not t.cross_host:
            continue
        same = t.src.host.rsplit("#", 1)[0] == t.dst.host.rsplit("#", 1)[0]
        bw = q.device.intra_host if same else q.device.inter_host
        for gpu in (t.src.host, t.dst.host):
            load.setdefault(gpu, [0.0])[0] += 2 * t.nbytes / bw  # and the gradients
    moved = 2 * p.bytes_cross_host
    return max((v[0] for v in load.values()), default=0.0), moved


def _cycle(q: Query, cfgs: list[ParallelConfig]) -> tuple[float, int]:
    if len(cfgs) < 2:
        return 0.0, 0
    secs, moved = 0.0, 0
    for a, b in zip(cfgs, cfgs[1:] + cfgs[:1]):
        s, n = switch_seconds(q, a, b)
        secs, moved = secs + s, moved + n
    return secs, moved


def plan_groups(q: Query, lengths: Sequence[int], min_bound: int = MIN_BOUND) -> GroupPlan:
    """Steps 1-5 for a step of ``q.batch`` sequences drawn like ``lengths``
    (``min_bound``: the smallest group bound, lower for a model whose
    sequences are all shorter than :data:`MIN_BOUND`)."""
    raw = length_groups(lengths, min_bound)
    scale = q.batch / len(lengths)
    parts = [(bound, len(ls), sum(ls) * scale) for bound, ls in raw]
    classes = StateClasses(q.model)
    n = matmul_params(q.model)
    cache: dict[tuple[int, float], Estimate] = {}

    def best(bound: int, tokens: float) -> Estimate:
        key = (bound, tokens)
        if key not in cache:
            gq, share = _group_query(q, bound, tokens)
            s = suggest(gq)
            if s.best is None:
                raise InvalidConfig(f"no mesh of these GPUs fits sequences of {bound} tokens: "
                                    "recompute activations, or add GPUs")
            e = s.best
            cache[key] = replace(e, step=e.step * share,
                                 step_terms={k: v * share for k, v in e.step_terms.items()})
        return cache[key]

    def total(groups: list[tuple[int, int, float]]) -> tuple[float, list[Estimate]]:
        ests = [best(b, t) for b, _, t in groups]
        return sum(e.step for e in ests) + _cycle(q, [e.config for e in ests])[0], ests

    current, _ = total(parts)
    while len(parts) > 1:  # step 5
        trials = []
        for i in range(len(parts) - 1):
            (_, c0, t0), (b1, c1, t1) = parts[i], parts[i + 1]
            merged = parts[:i] + [(b1, c0 + c1, t0 + t1)] + parts[i + 2:]
            trials.append((total(merged)[0], i, merged))
        secs, _, merged = min(trials, key=lambda t: (t[0], t[1]))
        if secs > current:
            break
        parts, current = merged, secs
    _, ests = total(parts)
    switch, moved = _cycle(q, [e.config for e in ests])
    groups: list[LengthGroup] = []
    for (b, c, t), e in zip(parts, ests):  # neighbours on one mesh are one group
        if groups and groups[-1].estimate.config == e.config:
            g = groups.pop()
            c, t, secs = c + g.count, t + g.tokens, e.step + g.seconds
        else:
            secs = e.step
        groups.append(LengthGroup(b, c, round(t), e, secs))
    single, single_secs = _single(q, parts, classes, n)
    return GroupPlan(tuple(groups), switch, moved, single, single_secs)


def _single(q: Query, parts: list[tuple[int, int, float]], classes: StateClasses,
            n: float) -> tuple[ParallelConfig, float]:
    """Step 4."""
    longest = _group_query(q, parts[-1][0], parts[-1][2])[0]
    queries = [_group_query(q, b, t) for b, _, t in parts]
    best: tuple[float, ParallelConfig] | None = None
    for cfg in meshes(longest):
        if not estimate(longest, cfg, classes, n).fits:
            continue
        try:
            secs = sum(estimate(g, cfg, classes, n).step * share for g, share in queries)
        except InvalidConfig:
            continue
        if best is None or secs < best[0]:
            best = (secs, cfg)
    if best is None:
        raise InvalidConfig(f"no mesh of these GPUs fits sequences of {parts[-1][0]} tokens")
    return best[1], best[0]


@dataclass(frozen=True)
class MeshRouting:
    """A :class:`GroupPlan` as a hot switch takes it: one named mesh per
    distinct configuration (``le<bound>``, by the longest group it serves),
    the length bounds that route a sequence to its mesh, and the home mesh
    (the one that carries the most tokens: the optimizer steps there, so
    the fewest gradients move)."""

    configs: dict[str, ParallelConfig]
    bounds: tuple[tuple[int, str], ...]
    home: str

    def mesh_for(self, length: int) -> str:
        """The mesh of a sequence of ``length`` tokens: its group's; one
        longer than every group's bound goes to the last (widest) mesh."""
        if length < 1:
            raise InvalidConfig(f"a sequence length must be at least 1 token, not {length}")
        return next((name for bound, name in self.bounds if length <= bound),
                    self.bounds[-1][1])

    def route(self, lengths: Sequence[int]) -> dict[str, list[int]]:
        """Each mesh's sequences of a step, as indices into ``lengths``
        (every mesh listed, shortest groups' first)."""
        out: dict[str, list[int]] = {name: [] for name in self.configs}
        for i, n in enumerate(lengths):
            out[self.mesh_for(int(n))].append(i)
        return out


def routing(p: GroupPlan) -> MeshRouting:
    """The hot switch's meshes and length routing of a group plan."""
    names: dict[ParallelConfig, str] = {}
    tokens: dict[str, int] = {}
    bounds = []
    for g in p.groups:
        cfg = g.estimate.config
        names.setdefault(cfg, f"le{g.bound}")
        bounds.append((g.bound, names[cfg]))
        tokens[names[cfg]] = tokens.get(names[cfg], 0) + g.tokens
    for cfg, name in list(names.items()):  # name each mesh by its longest group
        longest = max(b for b, n in bounds if n == name)
        names[cfg] = f"le{longest}"
        bounds = [(b, names[cfg] if n == name else n) for b, n in bounds]
        tokens[names[cfg]] = tokens.pop(name)
    home = max(tokens, key=lambda n: (tokens[n], n))
    return MeshRouting({n: c for c, n in names.items()}, tuple(bounds), home)
