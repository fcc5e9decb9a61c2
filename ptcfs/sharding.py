"""Sharding rules: σ (how a tensor is cut), φ (which rank holds what) and
α (which host holds each rank), all pure functions of the PTC types.

Rank order is Megatron-LM's, ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``;
ranks fill hosts in list order. Layers are split evenly over pipeline
stages; when ``pp`` does not divide the layer count, the first
``layers % pp`` stages take one layer more.
"""

from __future__ import annotations

from functools import lru_cache

from ptcfs.errors import InvalidConfig
from ptcfs.types import (
    Host,
    ModelSpec,
    ParallelConfig,
    RankCoord,
    ShardRule,
    Slice,
    TensorSpec,
)

__all__ = [
    "validate",
    "rank_coords",
    "rank_of",
    "host_ranks",
    "stage_layers",
    "stage_of",
    "padded_length",
    "slice_for",
    "rank_tensors",
    "holders",
    "placement",
    "parse_degrees",
    "parse_hosts",
    "parse_config",
]


def padded_length(length: int, multiple: int, tp: int) -> int:
    """``length`` rounded up to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return -(-length // step) * step


def validate(model: ModelSpec, cfg: ParallelConfig) -> None:
    """Refuse a configuration that cannot hold ``model``, naming the problem."""
    for name, value in (("tp", cfg.tp), ("pp", cfg.pp), ("dp", cfg.dp)):
        if value < 1:
            raise InvalidConfig(f"{name}={value}: every parallel degree must be at least 1")
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
            f"tp*pp*dp = {cfg.tp}*{cfg.pp}*{cfg.dp} = {cfg.world} ranks, "
            f"but the hosts have only {gpus} GPUs"
        )
    if cfg.pp > model.layers:
        raise InvalidConfig(f"pp={cfg.pp} is more than the model's {model.layers} layers")
    for what, value in model.tp_divides:
        if value % cfg.tp:
            raise InvalidConfig(f"tp={cfg.tp} does not divide {what}={value}")
    for spec in model.tensors_for(cfg.pp):
        _check_tensor(spec, cfg.tp)


def _check_tensor(spec: TensorSpec, tp: int) -> None:
    rule = spec.rule
    if rule.split_dim is None:
        return
    if not 0 <= rule.split_dim < len(spec.shape):
        raise InvalidConfig(f"{spec.name}: split dimension {rule.split_dim} out of range")
    if rule.pad_multiple is not None:
        return
    length = spec.shape[rule.split_dim]
    if length % rule.groups or (length // rule.groups) % tp:
        what = f"{length // rule.groups} in each of {rule.groups} groups" if rule.groups > 1 \
            else str(length)
        raise InvalidConfig(
            f"tp={tp} does not divide dimension {rule.split_dim} of {spec.name}: {what}"
        )


def rank_of(cfg: ParallelConfig, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
    """The global rank of coordinates (Megatron order)."""
    return tp_rank + cfg.tp * (dp_rank + cfg.dp * pp_rank)


@lru_cache(maxsize=64)
def rank_coords(cfg: ParallelConfig) -> tuple[RankCoord, ...]:
    """Every rank of ``cfg`` with its coordinates and host, by rank."""
    host_of: list[str] = []
    for h in cfg.hosts:
        host_of.extend([h.name] * h.gpus)
    out = []
    for rank in range(cfg.world):
        tp_rank = rank % cfg.tp
        dp_rank = (rank // cfg.tp) % cfg.dp
        pp_rank = rank // (cfg.tp * cfg.dp)
        out.append(RankCoord(rank, tp_rank, dp_rank, pp_rank, host_of[rank]))
    return tuple(out)


def host_ranks(cfg: ParallelConfig) -> dict[str, list[int]]:
    """Ranks per host name (hosts without ranks map to an empty list)."""
    out: dict[str, list[int]] = {h.name: [] for h in cfg.hosts}
    for c in rank_coords(cfg):
        out[c.host].append(c.rank)
    return out


def stage_layers(layers: int, pp: int) -> list[range]:
    """The global layer indices of each stage (the first stages take the extra)."""
    base, extra = divmod(layers, pp)
    out = []
    start = 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_of(rule: ShardRule, layers: int, pp: int) -> int:
    """The pipeline stage that owns a tensor with ``rule``."""
    if rule.stage == "first":
        return 0
    if rule.stage == "last":
        return pp - 1
    layer = rule.stage
    if not 0 <= layer < layers:
        raise InvalidConfig(f"layer {layer} out of range for a {layers}-layer model")
    base, extra = divmod(layers, pp)
    big = extra * (base + 1)
    if layer < big:
        return layer // (base + 1)
    return extra + (layer - big) // base


def slice_for(spec: TensorSpec, tp: int, tp_rank: int) -> Slice:
    """The slice of ``spec`` that tensor-parallel rank ``tp_rank`` holds."""
    rule = spec.rule
    if rule.split_dim is None:
        return Slice()
    padded = None
    if rule.pad_multiple is not None:
        padded = padded_length(spec.shape[rule.split_dim], rule.pad_multiple, tp)
    return Slice(rule.split_dim, tp_rank, tp, rule.groups, padded)


def rank_tensors(
    model: ModelSpec, cfg: ParallelConfig, rank: int
) -> list[tuple[TensorSpec, Slice]]:
    """φ: the sub-tensors one rank holds, in model order."""
    c = rank_coords(cfg)[rank]
    return [
        (spec, slice_for(spec, cfg.tp, c.tp_rank))
        for spec in model.tensors_for(cfg.pp)
        if stage_of(spec.rule, model.layers, cfg.pp) == c.pp_rank
    ]


def holders(
    model: ModelSpec, cfg: ParallelConfig, spec: TensorSpec
) -> dict[Slice, dict[str, list[int]]]:
    """For one tensor: each slice → host → the ranks on it that hold it."""
    per_tp = _stage_holders(cfg, stage_of(spec.rule, model.layers, cfg.pp))
    if spec.rule.split_dim is not None:
        return {slice_for(spec, cfg.tp, t): hosts for t, hosts in enumerate(per_tp)}
    merged: dict[str, list[int]] = {}
    for hosts in per_tp:
        for h, ranks in hosts.items():
            merged.setdefault(h, []).extend(ranks)
    for ranks in merged.values():
        ranks.sort()
    return {Slice(): merged}


def placement(
    model: ModelSpec,
    cfg: ParallelConfig,
    spec: TensorSpec,
    replicas: int = 1,
    ring: tuple[str, ...] = (),
    lost: frozenset[str] = frozenset(),
) -> dict[Slice, dict[str, list[int]]]:
    """Where every copy of a tensor's slices lives: slice → host → ranks.

    The hosts of the ranks that hold a slice come first; when they are
    fewer than ``replicas``, the next hosts of ``ring`` after the first
    holder (wrapping around) keep extra copies, listed with no ranks.
    Hosts in ``lost`` are dropped: they hold nothing any more. A slice may
    so end up with no host at all; callers decide what that means.
    """
    base = holders(model, cfg, spec)
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


@lru_cache(maxsize=1024)
def _stage_holders(cfg: ParallelConfig, stage: int) -> tuple[dict[str, list[int]], ...]:
    """Per tensor-parallel rank of ``stage``: host → ranks (do not mutate)."""
    coords = rank_coords(cfg)
    out: list[dict[str, list[int]]] = []
    for tp_rank in range(cfg.tp):
        hosts: dict[str, list[int]] = {}
        for dp_rank in range(cfg.dp):
            c = coords[rank_of(cfg, tp_rank, dp_rank, stage)]
            hosts.setdefault(c.host, []).append(c.rank)
        out.append(hosts)
    return tuple(out)


def parse_degrees(text: str) -> tuple[int, int, int]:
    """``"tp=2,pp=1,dp=4"`` → ``(2, 1, 4)``; omitted degrees are 1."""
    values = {"tp": 1, "pp": 1, "dp": 1}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep or key.strip() not in values:
            raise InvalidConfig(f"bad degree {item!r} in {text!r}: expected tp=N,pp=N,dp=N")
        try:
            values[key.strip()] = int(val)
        except ValueError:
            raise InvalidConfig(f"{key.strip()}={val!r} is not a whole number") from None
    return values["tp"], values["pp"], values["dp"]


def parse_hosts(text: str) -> tuple[Host, ...]:
    """``"h0:4,h1:4"`` → hosts; a name without ``:N`` is an error."""
    hosts = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, gpus = item.rpartition(":")
        if not sep or not name:
            raise InvalidConfig(f"bad host {item!r}: expected name:gpus, e.g. h0:4")
        try:
            hosts.append(Host(name, int(gpus)))
        except ValueError:
            raise InvalidConfig(f"bad GPU count in host {item!r}") from None
    if not hosts:
        raise InvalidConfig(f"no hosts in {text!r}: expected name:gpus,name:gpus")
    return tuple(hosts)


def parse_config(degrees: str, hosts: str | tuple[Host, ...]) -> ParallelConfig:
    """A configuration from ``"tp=..,pp=..,dp=.."`` and a host list."""
    tp, pp, dp = parse_degrees(degrees)
    hs = parse_hosts(hosts) if isinstance(hosts, str) else hosts
    return ParallelConfig(tp, pp, dp, hs)
