"""The contracts of ptcfs: every type that crosses a module boundary.

All of them are frozen dataclasses, so a plan or a configuration can be
hashed, compared, printed and sent over the wire without surprises.

Coordinates: a *logical* tensor is the whole, unpadded tensor of the model
(``TensorSpec.shape``). A *sub-tensor* is what one rank holds under a
configuration, described by a :class:`Slice`; its *local* coordinates run
from 0 along every dimension of ``Slice.local_shape``. A :data:`Box` is a
hyper-rectangle, one ``(start, stop)`` pair per dimension.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, NamedTuple

from ptcfs.boxes import Box, box_intersect, box_volume, full_box

__all__ = [
    "DTYPE_SIZES",
    "Box",
    "Cut",
    "DamagedEntry",
    "MESH_DIMS",
    "Host",
    "ModelSpec",
    "ParallelConfig",
    "Part",
    "Plan",
    "RankCoord",
    "ShardRule",
    "Slice",
    "Endpoint",
    "Entry",
    "Generation",
    "TensorSpec",
    "Transfer",
    "box_volume",
    "box_intersect",
    "full_box",
    "gc_paused",
]

#: Bytes per element of the dtypes ptcfs knows.
DTYPE_SIZES: dict[str, int] = {
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "uint8": 1,
    "int8": 1,
    "bool": 1,
}

Stage = int | Literal["first", "last"]


@dataclass(frozen=True)
class Part:
    """One part of a fused tensor along its split dimension: ``q``, ``k`` or
    ``v`` of a fused ``qkv_proj``, ``gate`` or ``up`` of ``gate_up_proj``.

    ``size``: its length along that dimension; ``units``: how many whole
    ``unit``s (``heads``, ``rows``) it holds. Tensor parallelism gives each
    rank ``units / tp`` of them, so ``tp`` must divide ``units``.
    """

    name: str
    size: int
    units: int
    unit: str = "rows"


@dataclass(frozen=True)
class ShardRule:
    """How tensor, pipeline and expert parallelism cut one logical tensor (σ).

    ``split_dim``: the dimension tensor parallelism splits, or None when the
    tensor is replicated over the tensor-parallel group.
    ``groups``: that dimension holds this many equal, contiguous groups that
    are split separately (fused ``[gate; up]`` is 2; a ``[q; k; v]`` stored
    by blocks is 3). Each rank gets its part of every group, concatenated.
    ``parts``: when set, that dimension holds these fused parts in order,
    of any sizes (Phi-3's ``qkv_proj``: 64 query rows, 32 key, 32 value),
    each split in ``tp`` even parts; a rank's slice is its part of each,
    concatenated (``groups`` is then 1).
    ``pad_multiple``: when set, the split dimension is padded up to a
    multiple of ``pad_multiple * tp`` (Megatron's vocabulary padding).
    ``stage``: the pipeline stage that owns the tensor: a global layer index,
    or ``"first"`` / ``"last"``.
    ``expert``: the index of the expert the tensor belongs to (a
    mixture-of-experts MLP), or None; expert parallelism places expert ``e``
    on the expert-parallel rank ``e // (experts / ep)``.

    Fully-sharded and ZeRO data parallelism need no rule: they take
    ``Shard(0)`` of whatever tensor parallelism leaves (see
    :mod:`ptcfs.sharding`).
    """

    split_dim: int | None = None
    groups: int = 1
    pad_multiple: int | None = None
    stage: Stage = "first"
    expert: int | None = None
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of a model: name, unpadded shape, dtype, rule.

    ``same_as`` names another tensor that holds the same values (the output
    layer tied to the embedding): when this tensor appears in a new
    configuration and did not exist in the old one, it is filled from it.
    Optimizer state is named ``optim/<state>/<parameter>`` (see
    :attr:`is_optim`): ZeRO-1 shards it while parameters stay replicated.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    rule: ShardRule = field(default_factory=ShardRule)
    same_as: str | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return box_volume(full_box(self.shape)) * self.itemsize

    @property
    def is_optim(self) -> bool:
        """Optimizer state (``optim/<state>/<parameter>``), not a parameter."""
        return self.name.startswith("optim/")


@dataclass(frozen=True)
class ModelSpec:
    """A model as ptcfs sees it: its tensors and what constrains the mesh.

    ``tensors`` exist under every configuration; ``pp_only`` only when
    ``pp > 1`` (the output layer tied to the embedding). ``tp_divides`` names
    quantities tensor parallelism must divide, e.g. ``(("heads", 16),)``.
    ``experts``: how many experts each mixture-of-experts layer has (0 for a
    dense model); expert parallelism must divide it.
    ``params`` records the preset's arguments, for display.
    """

    name: str
    layers: int
    tensors: tuple[TensorSpec, ...]
    tp_divides: tuple[tuple[str, int], ...] = ()
    pp_only: tuple[TensorSpec, ...] = ()
    params: tuple[tuple[str, int | str], ...] = ()
    experts: int = 0

    def tensors_for(self, pp: int) -> tuple[TensorSpec, ...]:
        """The tensors that exist under pipeline degree ``pp``."""
        return self.tensors + (self.pp_only if pp > 1 else ())


@dataclass(frozen=True)
class Host:
    """A machine: its name and how many GPUs (rank slots) it has."""

    name: str
    gpus: int


#: The mesh dimensions of a configuration, outermost first (torchtitan's order).
MESH_DIMS = ("pp", "dp", "fsdp", "cp", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    """A parallel configuration and its allocation to hosts (φ and α).

    The mesh is ``["pp", "dp", "fsdp", "cp", "tp"]`` in row-major order, so
    ``rank = tp_rank + tp*(cp_rank + cp*(fsdp_rank + fsdp*(dp_rank + dp*pp_rank)))``
    (Megatron-LM's order when ``cp = fsdp = 1``); ranks fill the hosts in
    list order, ``gpus`` ranks per host. ``ep`` borrows from the
    ``dp * fsdp`` data-parallel ranks; context-parallel ranks hold replicas
    of the state (Megatron-Core's layout), or with ``cp_shard=1`` FSDP shards
    over all ``fsdp * cp`` ranks (torchtitan's ``dp_shard_cp``; see
    :attr:`fsdp_shards`); ``zero=1`` shards optimizer state over ``dp``;
    ``pp_layers`` gives each stage's layer count explicitly (empty: even,
    the first ``layers % pp`` stages taking one more). ``vpp`` > 1:
    an interleaved pipeline, as Megatron's virtual stages and torchtitan's
    interleaved schedules build: the layers are cut into ``pp * vpp``
    chunks in order (``pp_layers`` then gives each chunk's count), chunk
    ``c`` on stage ``c % pp``.
    """

    tp: int
    pp: int
    dp: int
    hosts: tuple[Host, ...]
    fsdp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    pp_layers: tuple[int, ...] = ()
    vpp: int = 1
    cp_shard: int = 0

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.tp

    @property
    def fsdp_shards(self) -> int:
        """FSDP's ``Shard(0)`` chunks: ``fsdp``, whose context-parallel ranks
        hold replicas (``cp_shard=0``, Megatron-Core's layout); with
        ``cp_shard=1`` ``fsdp * cp``: context-parallel ranks read the same
        sequences but hold different chunks of the state, as torchtitan's
        FSDP mesh ``dp_shard_cp`` (``dp_shard`` flattened with ``cp``) has
        them, chunk ``fsdp_rank * cp + cp_rank``."""
        return self.fsdp * self.cp if self.cp_shard else self.fsdp

    @property
    def data_parallel(self) -> int:
        """Ranks that read different data: ``dp * fsdp``."""
        return self.dp * self.fsdp

    def degrees(self) -> dict[str, int | list[int]]:
        """Every degree and option, e.g. for JSON: ``{"pp": 1, ..., "zero": 0}``."""
        out: dict[str, int | list[int]] = {
            "pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "cp": self.cp, "tp": self.tp,
            "ep": self.ep, "zero": self.zero}
        if self.vpp > 1:
            out["vpp"] = self.vpp
        if self.cp_shard:
            out["cp_shard"] = self.cp_shard
        if self.pp_layers:
            out["pp_layers"] = list(self.pp_layers)
        return out

    def degrees_text(self) -> str:
        """The degrees as ``--config`` takes them: ``tp``, ``pp`` and ``dp`` always,
        the others when not at their defaults (``tp=2,pp=1,dp=1,fsdp=4``)."""
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"{k}={v}" for k, v in (("fsdp", self.fsdp), ("cp", self.cp), ("ep", self.ep),
                                          ("zero", self.zero)) if v != (0 if k == "zero" else 1)]
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.cp_shard:
            parts.append(f"cp_shard={self.cp_shard}")
        if self.pp_layers:
            parts.append("pp_layers=" + ":".join(map(str, self.pp_layers)))
        return ",".join(parts)


@dataclass(frozen=True)
class RankCoord:
    """Where one rank sits: its mesh coordinates and its host.

    ``data_rank`` (``dp_rank * fsdp + fsdp_rank``) picks the rank's share of
    the data; ``ep_rank`` (``data_rank % ep``) its experts.
    """

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    host: str
    fsdp_rank: int = 0
    cp_rank: int = 0
    data_rank: int = 0
    ep_rank: int = 0


@dataclass(frozen=True, slots=True)
class Cut:
    """One step of σ: part ``index`` of ``parts`` along ``dim`` of the tensor
    the earlier cuts left.

    An even cut (tensor parallelism) first pads ``dim`` to ``padded`` when
    set, then splits each of ``groups`` equal groups (or, when ``sizes`` is
    set, each group of those lengths in order) into ``parts`` equal parts
    and concatenates this part of every group. A ``chunk`` cut
    (``Shard(0)`` of FSDP and ZeRO) has ``torch.chunk``'s semantics: every
    part takes ``ceil(n / parts)`` in order, the last ones fewer or none.
    """

    dim: int
    index: int
    parts: int
    groups: int = 1
    padded: int | None = None
    chunk: bool = False
    sizes: tuple[int, ...] = ()

    def key(self) -> str:
        if self.chunk:
            return f"c{self.dim}.{self.index}of{self.parts}"
        text = f"d{self.dim}.{self.index}of{self.parts}"
        if self.groups > 1:
            text += f".g{self.groups}"
        if self.sizes:
            text += ".s" + ":".join(map(str, self.sizes))
        if self.padded is not None:
            text += f".p{self.padded}"
        return text

    def segments(self, length: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """The new length of ``dim`` and the ``(lo, hi, new_lo)`` runs of the
        old local coordinates that form it, in order."""
        n = self.padded if self.padded is not None else length
        if self.chunk:
            size = -(-n // self.parts)
            lo, hi = min(self.index * size, n), min((self.index + 1) * size, n)
            return hi - lo, ((lo, hi, 0),) if hi > lo else ()
        if self.sizes:
            runs, start, new = [], 0, 0
            for size in self.sizes:
                part = size // self.parts
                if part:
                    runs.append((start + self.index * part, start + (self.index + 1) * part, new))
                start, new = start + size, new + part
            return new, tuple(runs)
        group_len = n // self.groups
        part = group_len // self.parts
        return part * self.groups, tuple(
            (g * group_len + self.index * part, g * group_len + (self.index + 1) * part, g * part)
            for g in range(self.groups) if part)


@dataclass(frozen=True, slots=True)
class Slice:
    """The sub-tensor one rank holds (one store entry): the logical tensor
    cut by ``cuts`` in order. ``Slice()`` is the whole tensor (replicated);
    :meth:`split` makes the one-cut slice of tensor parallelism."""

    cuts: tuple[Cut, ...] = ()
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.cuts))
        object.__setattr__(self, "_key", "+".join(c.key() for c in self.cuts) if self.cuts
                           else "full")

    def __hash__(self) -> int:  # computed once: slices key the planner's many lookups
        return self._hash

    @classmethod
    def split(cls, dim: int, index: int, parts: int, groups: int = 1,
              padded: int | None = None, sizes: tuple[int, ...] = ()) -> Slice:
        return cls((Cut(dim, index, parts, groups, padded, sizes=sizes),))

    @classmethod
    def from_key(cls, key: str) -> Slice:
        """The slice whose :meth:`key` is ``key``; ValueError if it is none."""
        return _slice_from_key(key)

    @property
    def is_full(self) -> bool:
        return not self.cuts

    def key(self) -> str:
        """A short canonical text for the slice, used in store keys (made
        once: plans and stage requests name slices by it many times)."""
        return self._key

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the sub-tensor of a logical tensor of ``shape``."""
        return _cut_up(self.cuts, shape)[0]

    def pieces(self, shape: tuple[int, ...]) -> list[tuple[Box, Box]]:
        """``(logical box, local box)`` pairs of the state this slice holds.

        Padding rows are not state and appear in no piece. The pieces are
        disjoint and in local order.
        """
        return list(_cut_up(self.cuts, shape)[1])


@lru_cache(maxsize=1 << 16)
def _cut_up(cuts: tuple[Cut, ...], shape: tuple[int, ...]
            ) -> tuple[tuple[int, ...], tuple[tuple[Box, Box], ...]]:
    """Local shape and pieces of ``cuts`` applied to a tensor of ``shape``."""
    local = list(shape)
    pieces: list[tuple[Box, Box]] = [(full_box(shape), full_box(shape))]
    if box_volume(full_box(shape)) == 0:
        pieces = []
    for c in cuts:
        local[c.dim], runs = c.segments(local[c.dim])
        out = []
        for logical, box in pieces:
            a, b = box[c.dim]
            for lo, hi, new_lo in runs:
                s, e = max(a, lo), min(b, hi)
                if e <= s:
                    continue
                shift = logical[c.dim][0] - a
                out.append((_with_range(logical, c.dim, s + shift, e + shift),
                            _with_range(box, c.dim, s - lo + new_lo, e - lo + new_lo)))
        pieces = sorted(out, key=lambda p: p[1])
    return tuple(local), tuple(pieces)


@lru_cache(maxsize=1 << 16)
def _slice_from_key(key: str) -> Slice:
    if key == "full":
        return Slice()
    cuts = []
    for text in key.split("+"):
        head, *opts = text.split(".")
        kind, dim = head[0], int(head[1:])
        index, _, parts = opts[0].partition("of")
        if kind not in "cd" or not parts:
            raise ValueError(f"not a slice key: {key!r}")
        groups, padded = 1, None
        sizes: tuple[int, ...] = ()
        for o in opts[1:]:
            if o[0] == "g":
                groups = int(o[1:])
            elif o[0] == "s":
                sizes = tuple(int(n) for n in o[1:].split(":"))
            elif o[0] == "p":
                padded = int(o[1:])
            else:
                raise ValueError(f"not a slice key: {key!r}")
        cuts.append(Cut(dim, int(index), int(parts), groups, padded, kind == "c", sizes))
    out = Slice(tuple(cuts))
    if out.key() != key:
        raise ValueError(f"not a canonical slice key: {key!r}")
    return out


def _with_range(box: Box, dim: int, lo: int, hi: int) -> Box:
    return box[:dim] + ((lo, hi),) + box[dim + 1:]


@dataclass(frozen=True, slots=True)
class Entry:
    """A sub-tensor as a host stores it: one store entry of a version."""

    tensor: str
    slice: Slice
    shape: tuple[int, ...]
    dtype: str


class Endpoint(NamedTuple):
    """One end of a transfer: a region of a sub-tensor on a host.

    ``rank`` is a rank on ``host`` that holds (source) or needs
    (destination) the sub-tensor; ``box`` is in the sub-tensor's local
    coordinates. (Named tuples, not dataclasses: a large plan builds
    hundreds of thousands of them, and a tuple is built several times
    faster.)
    """

    host: str
    rank: int
    tensor: str
    slice: Slice
    box: Box


class Transfer(NamedTuple):
    """Copy ``src`` to ``dst``: ``nbytes`` bytes, across hosts or not.

    ``dst_ranks`` lists every new rank on the destination host that uses
    the destination sub-tensor; they share the one copy the host stores.
    """

    src: Endpoint
    dst: Endpoint
    nbytes: int
    dst_ranks: tuple[int, ...] = ()

    @property
    def cross_host(self) -> bool:
        return self.src.host != self.dst.host


@dataclass(frozen=True)
class Plan:
    """What a reconfiguration moves, as computed by the planner.

    ``bytes_total``: bytes of all destination sub-tensors, summed over the
    new ranks (padding included). ``bytes_min_cross_host``: the lower bound,
    the state bytes each destination host needs and does not hold.
    ``fills``: ``(host, tensor, slice key)`` of destination sub-tensors
    that hold padding rows, which the executor fills with zeros.
    """

    old: ParallelConfig
    new: ParallelConfig
    transfers: tuple[Transfer, ...]
    bytes_total: int
    bytes_min_cross_host: int
    host_send: tuple[tuple[str, int], ...]
    fills: tuple[tuple[str, str, str], ...] = ()

    @property
    def bytes_cross_host(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.src.host != t.dst.host)

    @property
    def max_host_send_bytes(self) -> int:
        return max((b for _, b in self.host_send), default=0)


@dataclass(frozen=True)
class DamagedEntry:
    """A stored sub-tensor whose bytes no longer match the checksum written
    with them, found by a scrub and taken out of its version (quarantined):
    no read serves it, and a repair restores it from a copy that holds."""

    job: str
    version: int
    tensor: str
    #: the box of the tensor it holds (its slice key)
    part: str
    #: the damaged chunk: its index in the entry's blob, and the blob
    chunk: int
    blob: int
    #: when the scrub found it (the store's wall clock, in seconds)
    found: float


@dataclass(frozen=True)
class Generation:
    """One membership of a live job (:mod:`ptcfs.client.live`): the workers
    that run it, in rank order, as the launcher decided at ``decided``
    (``time.time()``). ``previous``: the workers of generation ``number - 1``
    in their rank order (empty for the first); ``lost``: those of them that
    died and hold nothing now. A previous worker neither in ``workers`` nor
    lost is *leaving*: it hands over what it holds, then exits."""

    number: int
    workers: tuple[str, ...]
    previous: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    decided: float = 0.0
    #: the change takes effect at the first step boundary at or after this step
    at_step: int = 0

    @property
    def leaving(self) -> tuple[str, ...]:
        return tuple(w for w in self.previous if w not in self.workers and w not in self.lost)

    @property
    def joining(self) -> tuple[str, ...]:
        return tuple(w for w in self.workers if w not in self.previous)

    @property
    def movers(self) -> tuple[str, ...]:
        """Who takes part in the move: the new workers in rank order, then
        the leaving ones."""
        return self.workers + self.leaving


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused, then restored: for code that
    makes hundreds of thousands of :class:`Transfer` and :class:`Endpoint`
    tuples (plans, their per-host parts), which hold no cycles. The
    collector's passes over them cost more than making them: the 175B plan
    of ``bench/bench_planner.py --control`` takes 2.0 s with it, 0.95 s
    without. So do the training client's loads, in processes of many
    objects (:func:`ptcfs.client.torch.state.load_rank`). Also a decorator."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
