"""Sharding rules: σ (how a tensor is cut), φ (which rank holds what) and
α (which host holds each rank), all pure functions of the PTC types.

The mesh is ``["pp", "dp", "fsdp", "cp", "tp"]`` in row-major order (see
:class:`~ptcfs.types.ParallelConfig`); ranks fill hosts in list order.
A rank's sub-tensor of a tensor is the logical tensor cut, in this order:

1. tensor parallelism: the rule's split dimension in ``tp`` even parts
   (groups, vocabulary padding), when the tensor has one; a fused tensor of
   parts of their own sizes (``rule.parts``: q, k, v; gate, up) splits each
   part so, a rank's slice being its share of each part, concatenated;
2. fully-sharded data parallelism: ``Shard(0)`` of what step 1 left, in
   ``torch.chunk`` parts over ``fsdp`` (FSDP2's layout), parameters and
   optimizer state alike; with ``cp_shard=1`` over the ``fsdp * cp`` ranks
   of the flattened ``fsdp``/``cp`` mesh instead, chunk ``fsdp_rank * cp +
   cp_rank`` (FSDP2 on torchtitan's ``dp_shard_cp`` mesh, which shards over
   context-parallel ranks even when ``fsdp`` is 1);
3. ZeRO-1 (``zero=1``): optimizer state only, ``Shard(0)`` of what step 2
   left, in chunks over ``dp``.

Context-parallel ranks so hold replicas of the model state by default
(``cp_shard=0``: Megatron-Core's layout, whose context-parallel ranks keep
replicas of the model), and their own chunks of it with ``cp_shard=1``
(torchtitan's). Pipeline parallelism gives each
stage whole layers (``pp_layers``, or evenly with the first ``layers % pp``
stages taking one more). Expert parallelism borrows from the ``dp * fsdp``
data-parallel ranks, innermost first: with ``data_rank = dp_rank * fsdp +
fsdp_rank``, a rank's ``ep_rank`` is ``data_rank % ep`` and it holds the
experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``. Expert tensors are then
sharded in step 2 by what remains of ``fsdp`` (``fsdp / ep`` when ``ep``
divides ``fsdp``, else 1: torchtitan's ``dp_shard_mod_ep``; under
``cp_shard=1`` too they stay replicas over ``cp``) and, with
ZeRO-1, over the rest of the data-parallel ranks (the expert data-parallel
group). Example: ``fsdp=4,ep=2`` with 8 experts: ranks with ``fsdp_rank``
0 and 2 hold experts 0-3, ranks 1 and 3 experts 4-7, and each expert tensor
is cut in two ``Shard(0)`` chunks between the two ranks that hold it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from ptcfs.errors import InvalidConfig
from ptcfs.types import (
    Cut,
    Host,
    ModelSpec,
    ParallelConfig,
    RankCoord,
    ShardRule,
    Slice,
    TensorSpec,
)

__all__ = [
    "chunk_of",
    "Layout",
    "validate",
    "rank_coords",
    "rank_of",
    "host_ranks",
    "pipeline_split",
    "stage_chunks",
    "stage_layers",
    "stage_of",
    "padded_length",
    "layout_of",
    "slice_for",
    "rank_tensors",
    "owned_tensors",
    "HolderKey",
    "holder_key",
    "holders",
    "placement_of",
    "placement",
    "with_extra",
    "parse_degrees",
    "parse_hosts",
    "parse_config",
]


def padded_length(length: int, multiple: int, tp: int) -> int:
    """``length`` rounded up to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return -(-length // step) * step


# --- the mesh ---------------------------------------------------------------


def validate(model: ModelSpec, cfg: ParallelConfig) -> None:
    """Refuse a configuration that cannot hold ``model``, naming the problem."""
    for name in ("tp", "pp", "dp", "fsdp", "cp", "ep"):
        value = getattr(cfg, name)
        if value < 1:
            raise InvalidConfig(f"{name}={value}: every parallel degree must be at least 1")
    if cfg.zero not in (0, 1):
        raise InvalidConfig(f"zero={cfg.zero}: use zero=0 or zero=1")
    if cfg.cp_shard not in (0, 1) or (cfg.cp_shard and cfg.cp == 1):
        raise InvalidConfig(f"cp_shard={cfg.cp_shard}: use cp_shard=1 (FSDP over fsdp*cp) only "
                            "with cp > 1, else cp_shard=0 (context-parallel replicas)")
    if not cfg.hosts:
        raise InvalidConfig("the host list is empty")
    seen: set[str] = set()
    for h in cfg.hosts:
        if h.gpus < 1:
            raise InvalidConfig(f"host {h.name} has gpus={h.gpus}; it must have at least 1")
        if h.name in seen:
            raise InvalidConfig(f"host {h.name} is listed twice")
        seen.add(h.name)
    gpus = sum(h.gpus for h in cfg.hosts)
    if cfg.world > gpus:
        raise InvalidConfig(
            f"pp*dp*fsdp*cp*tp = {cfg.pp}*{cfg.dp}*{cfg.fsdp}*{cfg.cp}*{cfg.tp} = {cfg.world} "
            f"ranks, but the hosts have only {gpus} GPUs"
        )
    if cfg.vpp < 1 or (cfg.vpp > 1 and cfg.pp < 2):
        raise InvalidConfig(f"vpp={cfg.vpp}: virtual stages interleave a pipeline of pp >= 2 "
                            "stages (vpp=1: none)")
    chunks = cfg.pp * cfg.vpp
    what = "stages" if cfg.vpp == 1 else "chunks (pp*vpp)"
    if chunks > model.layers:
        raise InvalidConfig(f"pp={cfg.pp} is more than the model's {model.layers} layers"
                            if cfg.vpp == 1 else f"pp*vpp = {chunks} chunks is more than the "
                            f"model's {model.layers} layers")
    if cfg.pp_layers:
        if len(cfg.pp_layers) != chunks:
            raise InvalidConfig(f"pp_layers has {len(cfg.pp_layers)} counts but there are "
                                f"{chunks} {what}")
        if sum(cfg.pp_layers) != model.layers or min(cfg.pp_layers) < 1:
            raise InvalidConfig(
                f"pp_layers={':'.join(map(str, cfg.pp_layers))} must give every "
                f"{'stage' if cfg.vpp == 1 else 'chunk'} at least one layer and add up to the "
                f"model's {model.layers} layers")
    _validate_ep(model, cfg)
    for what, value in model.tp_divides:
        if value % cfg.tp:
            raise InvalidConfig(f"tp={cfg.tp} does not divide {what}={value}")
    for spec in model.tensors_for(cfg.pp):
        _check_tensor(spec, cfg.tp)


def _validate_ep(model: ModelSpec, cfg: ParallelConfig) -> None:
    if cfg.ep == 1:
        return
    if not model.experts:
        raise InvalidConfig(f"ep={cfg.ep} but the model has no experts")
    if model.experts % cfg.ep:
        raise InvalidConfig(f"ep={cfg.ep} does not divide the model's {model.experts} experts")
    if cfg.data_parallel % cfg.ep:
        raise InvalidConfig(
            f"ep={cfg.ep} must divide dp*fsdp = {cfg.dp}*{cfg.fsdp} = {cfg.data_parallel} "
            "(expert parallelism borrows the data-parallel ranks)")
    if cfg.fsdp % cfg.ep and cfg.ep % cfg.fsdp:
        raise InvalidConfig(f"ep={cfg.ep} must divide fsdp={cfg.fsdp} or be a multiple of it")


def _check_tensor(spec: TensorSpec, tp: int) -> None:
    rule = spec.rule
    if rule.groups < 1:
        raise InvalidConfig(f"{spec.name}: groups={rule.groups} must be at least 1")
    if rule.split_dim is None:
        return
    if not 0 <= rule.split_dim < len(spec.shape):
        raise InvalidConfig(f"{spec.name}: split dimension {rule.split_dim} out of range")
    length = spec.shape[rule.split_dim]
    if rule.parts:
        _check_parts(spec, length, tp)
        return
    if rule.pad_multiple is not None:
        if rule.groups > 1:
            raise InvalidConfig(f"{spec.name}: padding and groups cannot be combined")
        return
    if length % rule.groups or (length // rule.groups) % tp:
        what = f"{length // rule.groups} in each of {rule.groups} groups" if rule.groups > 1 \
            else str(length)
        raise InvalidConfig(
            f"tp={tp} does not divide dimension {rule.split_dim} of {spec.name}: {what}"
        )


def _check_parts(spec: TensorSpec, length: int, tp: int) -> None:
    """A fused tensor's parts fill its split dimension, each of whole units
    that ``tp`` divides (the error names the part)."""
    rule = spec.rule
    if rule.groups > 1 or rule.pad_multiple is not None:
        raise InvalidConfig(f"{spec.name}: parts cannot be combined with groups or padding")
    total = sum(p.size for p in rule.parts)
    if total != length:
        sizes = ", ".join(f"{p.name}={p.size}" for p in rule.parts)
        raise InvalidConfig(f"{spec.name}: its parts ({sizes}) add up to {total}, but "
                            f"dimension {rule.split_dim} is {length}")
    for p in rule.parts:
        if p.units < 1 or p.size % p.units:
            raise InvalidConfig(f"{spec.name}: part {p.name} of {p.size} is not {p.units} whole "
                                f"{p.unit}")
        if p.units % tp:
            raise InvalidConfig(f"tp={tp} does not divide part {p.name} of {spec.name}: its "
                                f"{p.units} {p.unit}")


def rank_of(cfg: ParallelConfig, tp_rank: int, dp_rank: int, pp_rank: int,
            fsdp_rank: int = 0, cp_rank: int = 0) -> int:
    """The global rank of mesh coordinates."""
    return tp_rank + cfg.tp * (cp_rank + cfg.cp * (fsdp_rank + cfg.fsdp * (
        dp_rank + cfg.dp * pp_rank)))


@lru_cache(maxsize=64)
def rank_coords(cfg: ParallelConfig) -> tuple[RankCoord, ...]:
    """Every rank of ``cfg`` with its coordinates and host, by rank."""
    host_of: list[str] = []
    for h in cfg.hosts:
        host_of.extend([h.name] * h.gpus)
    out = []
    for rank in range(cfg.world):
        rest, tp_rank = divmod(rank, cfg.tp)
        rest, cp_rank = divmod(rest, cfg.cp)
        rest, fsdp_rank = divmod(rest, cfg.fsdp)
        pp_rank, dp_rank = divmod(rest, cfg.dp)
        data_rank = dp_rank * cfg.fsdp + fsdp_rank
        out.append(RankCoord(rank, tp_rank, dp_rank, pp_rank, host_of[rank], fsdp_rank,
                             cp_rank, data_rank, data_rank % cfg.ep))
    return tuple(out)


def host_ranks(cfg: ParallelConfig) -> dict[str, list[int]]:
    """Ranks per host name (hosts without ranks map to an empty list)."""
    out: dict[str, list[int]] = {h.name: [] for h in cfg.hosts}
    for c in rank_coords(cfg):
        out[c.host].append(c.rank)
    return out


def pp_layers_of(held: list[set[int]]) -> tuple[int, ...]:
    """Each pipeline stage's layer count from the layers each stage holds
    (``held``, in stage order): InvalidConfig unless every stage holds the
    next layers in order."""
    counts, following = [], 0
    for s, numbers in enumerate(held):
        got = sorted(numbers)
        if not got or got != list(range(following, following + len(got))):
            shown = "none" if not got else (f"{got[0]}..{got[-1]}" if got == list(
                range(got[0], got[-1] + 1)) else ", ".join(map(str, got[:6])))
            raise InvalidConfig(f"pipeline stage {s} holds layers {shown}; ptcfs needs every "
                                f"stage to hold the next layers in order (from {following}), "
                                "or chunks of them that go round the stages in order "
                                "(interleaved)")
        counts.append(len(got))
        following += len(got)
    return tuple(counts)


def pipeline_split(held: list[set[int]]) -> tuple[int, tuple[int, ...]]:
    """``(vpp, pp_layers)`` of a pipeline whose stages hold the layers
    ``held`` (in stage order): each stage the next layers (vpp 1, a count
    per stage), or chunks of consecutive layers that go round the stages in
    order, each stage holding ``vpp`` of them (a count per chunk); else
    InvalidConfig, saying which stage is out of order."""
    try:
        return 1, pp_layers_of(held)
    except InvalidConfig as e:
        plain = e
    where = {n: s for s, numbers in enumerate(held) for n in numbers}
    if len(held) < 2 or sum(map(len, held)) != len(where) or \
            sorted(where) != list(range(len(where))):
        raise plain
    runs: list[list[int]] = []  # [stage, layers] of each chunk
    for n in range(len(where)):
        if runs and runs[-1][0] == where[n]:
            runs[-1][1] += 1
        else:
            runs.append([where[n], 1])
    if len(runs) % len(held) or any(s != c % len(held) for c, (s, _) in enumerate(runs)):
        raise plain
    return len(runs) // len(held), tuple(n for _, n in runs)


def stage_layers(layers: int, pp: int, pp_layers: tuple[int, ...] = ()) -> list[range]:
    """The global layer indices of each stage: ``pp_layers`` when given, else
    even with the first stages taking the extra."""
    counts = list(pp_layers)
    if not counts:
        base, extra = divmod(layers, pp)
        counts = [base + (1 if s < extra else 0) for s in range(pp)]
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def stage_of(rule: ShardRule, layers: int, pp: int, pp_layers: tuple[int, ...] = (),
             vpp: int = 1) -> int:
    """The pipeline stage that owns a tensor with ``rule`` (with ``vpp``
    virtual stages: its layer's chunk's stage)."""
    if rule.stage == "first":
        return 0
    if rule.stage == "last":
        return pp - 1  # the last chunk, pp*vpp - 1, is on stage pp - 1
    layer = rule.stage
    if not 0 <= layer < layers:
        raise InvalidConfig(f"layer {layer} out of range for a {layers}-layer model")
    return _stage_of_layer(layers, pp, pp_layers, vpp)[layer]


def stage_chunks(layers: int, pp: int, pp_layers: tuple[int, ...] = (),
                 vpp: int = 1) -> list[list[range]]:
    """Each stage's layers, as the ranges of its chunks in order (one per
    stage without virtual stages)."""
    out: list[list[range]] = [[] for _ in range(pp)]
    for c, r in enumerate(stage_layers(layers, pp * vpp, pp_layers)):
        out[c % pp].append(r)
    return out


def chunk_of(stage: int | str, chunks: list[range]) -> int:
    """Which of a stage's model chunks (its layers: ``chunks``, from
    :func:`stage_chunks`) holds a tensor of ``stage`` (its rule's: a layer,
    or ``first``/``last`` for the embedding and the head)."""
    if stage == "first":
        return 0
    if stage == "last":
        return len(chunks) - 1
    return next(v for v, r in enumerate(chunks) if stage in r)


@lru_cache(maxsize=256)
def _stage_of_layer(layers: int, pp: int, pp_layers: tuple[int, ...],
                    vpp: int) -> tuple[int, ...]:
    return tuple(c % pp for c, r in enumerate(stage_layers(layers, pp * vpp, pp_layers))
                 for _ in r)


# --- σ: the layout of one tensor --------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a configuration cuts every tensor that shares these properties.

    ``tp_cut``: the tensor-parallel cut of rank 0 (None: replicated);
    ``shard``: the chunks of step 2; ``zero``: the chunks of step 3. Two
    tensors of one layout have the same slices, whatever their names.
    """

    shape: tuple[int, ...]
    tp_cut: Cut | None
    shard: int
    zero: int

    def slice(self, tp_rank: int, shard_rank: int, zero_rank: int) -> Slice:
        return _slice(self, tp_rank, shard_rank, zero_rank)

    def slices(self) -> tuple[Slice, ...]:
        """Every distinct slice of the layout (they cover the tensor, disjoint)."""
        return _slices(self)


def layout_of(spec: TensorSpec, cfg: ParallelConfig) -> Layout:
    """The layout of ``spec`` under ``cfg``."""
    rule = spec.rule
    tp_cut = None
    if rule.split_dim is not None:
        padded = None
        if rule.pad_multiple is not None:
            padded = padded_length(spec.shape[rule.split_dim], rule.pad_multiple, cfg.tp)
        tp_cut = Cut(rule.split_dim, 0, cfg.tp, rule.groups, padded,
                     sizes=tuple(p.size for p in rule.parts))
    shard, zero = _data_degrees(cfg, rule.expert is not None)
    if not spec.shape:
        shard, zero = 1, 1
    return Layout(spec.shape, tp_cut, shard, zero if cfg.zero and spec.is_optim else 1)


def _data_degrees(cfg: ParallelConfig, expert: bool) -> tuple[int, int]:
    """``(fsdp chunks, zero chunks)`` for dense or expert tensors."""
    if not expert or cfg.ep == 1:
        return cfg.fsdp_shards, cfg.dp
    efsdp = cfg.fsdp // cfg.ep if cfg.fsdp % cfg.ep == 0 else 1
    return efsdp, cfg.data_parallel // (cfg.ep * efsdp)


def _data_ranks(cfg: ParallelConfig, c: RankCoord, expert: bool) -> tuple[int, int]:
    """``(fsdp chunk, zero chunk)`` that rank ``c`` takes (see _data_degrees)."""
    if not expert or cfg.ep == 1:
        return (c.fsdp_rank * cfg.cp + c.cp_rank if cfg.cp_shard else c.fsdp_rank), c.dp_rank
    shard, _ = _data_degrees(cfg, True)
    rest = c.data_rank // cfg.ep
    return rest % shard, rest // shard


@lru_cache(maxsize=1 << 16)
def _slice(layout: Layout, tp_rank: int, shard_rank: int, zero_rank: int) -> Slice:
    cuts: list[Cut] = []
    c = layout.tp_cut
    if c is not None:
        cuts.append(Cut(c.dim, tp_rank, c.parts, c.groups, c.padded, sizes=c.sizes))
    if layout.shard > 1:
        cuts.append(Cut(0, shard_rank, layout.shard, chunk=True))
    if layout.zero > 1:
        cuts.append(Cut(0, zero_rank, layout.zero, chunk=True))
    return Slice(tuple(cuts))


@lru_cache(maxsize=4096)
def _slices(layout: Layout) -> tuple[Slice, ...]:
    tps = layout.tp_cut.parts if layout.tp_cut is not None else 1
    return tuple(_slice(layout, t, s, z) for t in range(tps) for s in range(layout.shard)
                 for z in range(layout.zero))


def slice_for(spec: TensorSpec, cfg: ParallelConfig, rank: int) -> Slice:
    """The slice of ``spec`` that ``rank`` holds (whether or not its stage
    and experts include the tensor)."""
    c = rank_coords(cfg)[rank]
    layout = layout_of(spec, cfg)
    shard_rank, zero_rank = _data_ranks(cfg, c, spec.rule.expert is not None)
    return layout.slice(c.tp_rank, shard_rank, zero_rank)


# --- φ and α: who holds what --------------------------------------------------


def _holds(model: ModelSpec, cfg: ParallelConfig, spec: TensorSpec, c: RankCoord) -> bool:
    if stage_of(spec.rule, model.layers, cfg.pp, cfg.pp_layers, cfg.vpp) != c.pp_rank:
        return False
    e = spec.rule.expert
    return e is None or cfg.ep == 1 or e // (model.experts // cfg.ep) == c.ep_rank


def rank_tensors(
    model: ModelSpec, cfg: ParallelConfig, rank: int
) -> list[tuple[TensorSpec, Slice]]:
    """φ: the sub-tensors one rank holds, in model order."""
    c = rank_coords(cfg)[rank]
    out = []
    for spec in model.tensors_for(cfg.pp):
        if _holds(model, cfg, spec, c):
            layout = layout_of(spec, cfg)
            shard_rank, zero_rank = _data_ranks(cfg, c, spec.rule.expert is not None)
            out.append((spec, layout.slice(c.tp_rank, shard_rank, zero_rank)))
    return out


def owned_tensors(
    model: ModelSpec, cfg: ParallelConfig, rank: int
) -> list[tuple[TensorSpec, Slice]]:
    """The sub-tensors of ``rank`` that no lower rank holds: what the rank
    writes when every rank saves its part once (replicas over ``dp``, and
    over ``cp`` unless ``cp_shard=1``, are written by their first rank only)."""
    return [(spec, sl) for spec, sl in rank_tensors(model, cfg, rank)
            if min(r for rs in holders(model, cfg, spec)[sl].values() for r in rs) == rank]


class HolderKey(NamedTuple):
    """What decides where a tensor's slices live: its stage, its expert's
    expert-parallel rank (-1: every rank's) and its layout. Tensors with
    equal keys are placed alike."""

    stage: int
    ep_rank: int
    layout: Layout


def holder_key(model: ModelSpec, cfg: ParallelConfig, spec: TensorSpec) -> HolderKey:
    stage = stage_of(spec.rule, model.layers, cfg.pp, cfg.pp_layers, cfg.vpp)
    return HolderKey(stage, ep_rank_of(model, cfg, spec.rule.expert), layout_of(spec, cfg))


def ep_rank_of(model: ModelSpec, cfg: ParallelConfig, expert: int | None) -> int:
    """The expert-parallel rank that holds ``expert``'s tensors (-1: every rank's)."""
    return -1 if expert is None or cfg.ep == 1 else expert // (model.experts // cfg.ep)


def holders(
    model: ModelSpec, cfg: ParallelConfig, spec: TensorSpec
) -> dict[Slice, dict[str, list[int]]]:
    """For one tensor: each slice → host → the ranks on it that hold it
    (shared between calls: do not mutate)."""
    return _holders(cfg, holder_key(model, cfg, spec))


@lru_cache(maxsize=4096)
def _holders(cfg: ParallelConfig, key: HolderKey) -> dict[Slice, dict[str, list[int]]]:
    layout = key.layout
    groups = _rank_groups(cfg, key.stage, key.ep_rank, layout.tp_cut is not None,
                          layout.shard > 1, layout.zero > 1)
    return {layout.slice(*k): {h: list(r) for h, r in hosts.items()}
            for k, hosts in groups.items()}


@lru_cache(maxsize=1024)
def _rank_groups(cfg: ParallelConfig, stage: int, ep_rank: int, by_tp: bool, by_shard: bool,
                 by_zero: bool) -> dict[tuple[int, int, int], dict[str, tuple[int, ...]]]:
    """The ranks of ``stage`` (and of one expert-parallel rank, or all when
    ``ep_rank`` is -1) grouped by the (tp, shard, zero) chunk they take:
    key → host → ranks. Do not mutate."""
    groups: dict[tuple[int, int, int], dict[str, list[int]]] = {}
    for c in rank_coords(cfg):
        if c.pp_rank != stage or (ep_rank >= 0 and c.ep_rank != ep_rank):
            continue
        shard_rank, zero_rank = _data_ranks(cfg, c, ep_rank >= 0)
        key = (c.tp_rank if by_tp else 0, shard_rank if by_shard else 0,
               zero_rank if by_zero else 0)
        groups.setdefault(key, {}).setdefault(c.host, []).append(c.rank)
    return {k: {h: tuple(r) for h, r in hosts.items()} for k, hosts in sorted(groups.items())}


def placement(
    model: ModelSpec,
    cfg: ParallelConfig,
    spec: TensorSpec,
    replicas: int = 1,
    ring: tuple[str, ...] = (),
    lost: frozenset[str] = frozenset(),
    extra: Mapping[str, Sequence[str]] | None = None,
) -> dict[Slice, dict[str, list[int]]]:
    """Where every copy of a tensor's slices lives: slice → host → ranks
    (shared between calls: do not mutate).

    The hosts of the ranks that hold a slice come first; when they are
    fewer than ``replicas``, the next hosts of ``ring`` after the first
    holder (wrapping around) keep extra copies, listed with no ranks.
    Hosts in ``lost`` are dropped: they hold nothing any more. A slice may
    so end up with no host at all; callers decide what that means.
    ``extra`` (slice key → hosts: copies a repair placed, see
    :mod:`ptcfs.plan.repair`) adds hosts with no ranks after those.
    """
    return with_extra(placement_of(cfg, holder_key(model, cfg, spec), replicas, ring, lost),
                      extra, lost)


def with_extra(where: dict[Slice, dict[str, list[int]]],
               extra: Mapping[str, Sequence[str]] | None,
               lost: frozenset[str] = frozenset()) -> dict[Slice, dict[str, list[int]]]:
    """``where`` with the hosts of ``extra`` (slice key → hosts) added to
    their slices, with no ranks (hosts in ``lost`` left out); ``where``
    itself when there is nothing to add."""
    if not extra:
        return where
    out = {}
    for sl, hosts in where.items():
        more = [h for h in extra.get(sl.key(), ()) if h not in hosts and h not in lost]
        out[sl] = {**hosts, **{h: [] for h in more}} if more else hosts
    return out


@lru_cache(maxsize=4096)
def placement_of(cfg: ParallelConfig, key: HolderKey, replicas: int = 1,
                 ring: tuple[str, ...] = (), lost: frozenset[str] = frozenset()
                 ) -> dict[Slice, dict[str, list[int]]]:
    """:func:`placement` of every tensor whose :func:`holder_key` is ``key``."""
    base = _holders(cfg, key)
    if replicas <= 1 and not lost:
        return base
    out: dict[Slice, dict[str, list[int]]] = {}
    for sl, hosts in base.items():
        placed = dict(hosts)
        if len(placed) < replicas and ring:
            first = next(iter(hosts))
            start = ring.index(first) + 1 if first in ring else 0
            for i in range(len(ring)):
                if len(placed) >= replicas:
                    break
                placed.setdefault(ring[(start + i) % len(ring)], [])
        out[sl] = {h: r for h, r in placed.items() if h not in lost}
    return out


# --- text ---------------------------------------------------------------------

_DEGREES = ("pp", "dp", "fsdp", "cp", "tp", "ep", "zero", "vpp", "cp_shard")
#: The most GPUs (rank slots) one host may have.
MAX_GPUS = 4096


def parse_degrees(text: str) -> dict[str, int | tuple[int, ...]]:
    """``"pp=2,fsdp=4,tp=2"`` → the degrees given, as ParallelConfig keywords
    (``pp_layers=3,5,5,3`` or ``3:5:5:3`` too); each key at most once."""
    values: dict[str, int | tuple[int, ...]] = {}
    last = ""
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep and last == "pp_layers" and item.isdigit():  # pp_layers=3,5,5,3
            layers = values["pp_layers"]
            values["pp_layers"] = (layers if isinstance(layers, tuple) else ()) + (int(item),)
            continue
        last = key
        if not sep or key not in _DEGREES + ("pp_layers",):
            raise InvalidConfig(
                f"bad degree {item!r} in {text!r}: expected key=N with key one of "
                + ", ".join(_DEGREES) + " (or pp_layers=A:B:...)")
        if key in values:
            raise InvalidConfig(f"{key} is given twice in {text!r}")
        try:
            values[key] = tuple(int(v) for v in val.split(":")) if key == "pp_layers" \
                else int(val)
        except ValueError:
            raise InvalidConfig(f"{key}={val!r} is not a whole number") from None
    return values


def parse_hosts(text: str) -> tuple[Host, ...]:
    """``"h0:4,h1:4"`` → hosts; a name without ``:N`` is an error."""
    hosts = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, gpus = item.rpartition(":")
        if not sep or not name:
            raise InvalidConfig(f"bad host {item!r}: expected name:gpus, e.g. h0:4")
        try:
            n = int(gpus)
        except ValueError:
            raise InvalidConfig(f"bad GPU count in host {item!r}") from None
        if not 1 <= n <= MAX_GPUS:
            raise InvalidConfig(f"host {item!r}: a host has 1 to {MAX_GPUS} GPUs")
        hosts.append(Host(name, n))
    if not hosts:
        raise InvalidConfig(f"no hosts in {text!r}: expected name:gpus,name:gpus")
    return tuple(hosts)


def parse_config(degrees: str, hosts: str | tuple[Host, ...]) -> ParallelConfig:
    """A configuration from ``"pp=..,dp=..,fsdp=..,cp=..,tp=..,ep=..,zero=.."``
    (and ``vpp=..``, ``cp_shard=0|1``, ``pp_layers=..``) and a host list."""
    d = parse_degrees(degrees)
    hs = parse_hosts(hosts) if isinstance(hosts, str) else hosts
    ints = {k: v for k, v in d.items() if isinstance(v, int)}
    layers = d.get("pp_layers", ())
    pp = ints.pop("pp", len(layers) // ints.get("vpp", 1)
                  if isinstance(layers, tuple) and layers else 1)
    return ParallelConfig(ints.pop("tp", 1), pp, ints.pop("dp", 1), hs,
                          pp_layers=layers if isinstance(layers, tuple) else (), **ints)
