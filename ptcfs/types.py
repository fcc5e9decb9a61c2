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

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "DTYPE_SIZES",
    "Box",
    "Host",
    "ModelSpec",
    "ParallelConfig",
    "Plan",
    "RankCoord",
    "ShardRule",
    "Slice",
    "Endpoint",
    "TensorSpec",
    "Transfer",
    "box_volume",
    "box_intersect",
    "box_shift",
    "full_box",
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

Box = tuple[tuple[int, int], ...]
Stage = int | Literal["first", "last"]


def full_box(shape: tuple[int, ...]) -> Box:
    """The box that covers a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_volume(box: Box) -> int:
    """Number of elements in ``box`` (0 for an empty box)."""
    v = 1
    for a, b in box:
        if b <= a:
            return 0
        v *= b - a
    return v


def box_intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_shift(box: Box, origin: Box) -> Box:
    """Express ``box`` relative to the start corner of ``origin``."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


@dataclass(frozen=True)
class ShardRule:
    """How tensor and pipeline parallelism cut one logical tensor (σ).

    ``split_dim``: the dimension tensor parallelism splits, or None when the
    tensor is replicated over the tensor-parallel group.
    ``groups``: that dimension holds this many equal, contiguous groups that
    are split separately (fused ``[gate; up]`` is 2; a ``[q; k; v]`` stored
    by blocks is 3). Each rank gets its part of every group, concatenated.
    ``pad_multiple``: when set, the split dimension is padded up to a
    multiple of ``pad_multiple * tp`` (Megatron's vocabulary padding).
    ``stage``: the pipeline stage that owns the tensor: a global layer index,
    or ``"first"`` / ``"last"``.
    """

    split_dim: int | None = None
    groups: int = 1
    pad_multiple: int | None = None
    stage: Stage = "first"


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of a model: name, unpadded shape, dtype, rule.

    ``same_as`` names another tensor that holds the same values (the output
    layer tied to the embedding): when this tensor appears in a new
    configuration and did not exist in the old one, it is filled from it.
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


@dataclass(frozen=True)
class ModelSpec:
    """A model as ptcfs sees it: its tensors and what constrains tp and pp.

    ``tensors`` exist under every configuration; ``pp_only`` only when
    ``pp > 1`` (the output layer tied to the embedding). ``tp_divides`` names
    quantities tensor parallelism must divide, e.g. ``(("heads", 16),)``.
    ``params`` records the preset's arguments, for display.
    """

    name: str
    layers: int
    tensors: tuple[TensorSpec, ...]
    tp_divides: tuple[tuple[str, int], ...] = ()
    pp_only: tuple[TensorSpec, ...] = ()
    params: tuple[tuple[str, int | str], ...] = ()

    def tensors_for(self, pp: int) -> tuple[TensorSpec, ...]:
        """The tensors that exist under pipeline degree ``pp``."""
        return self.tensors + (self.pp_only if pp > 1 else ())


@dataclass(frozen=True)
class Host:
    """A machine: its name and how many GPUs (rank slots) it has."""

    name: str
    gpus: int


@dataclass(frozen=True)
class ParallelConfig:
    """A parallel configuration and its allocation to hosts (φ and α).

    Ranks are numbered in Megatron-LM order,
    ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``, and fill the hosts
    in list order, ``gpus`` ranks per host.
    """

    tp: int
    pp: int
    dp: int
    hosts: tuple[Host, ...]

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class RankCoord:
    """Where one rank sits: its coordinates and its host."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    host: str


@dataclass(frozen=True, slots=True)
class Slice:
    """The sub-tensor one tensor-parallel rank holds (one store entry).

    Part ``index`` of ``parts`` along ``dim``; when ``groups > 1`` the part is
    taken from each of the groups and concatenated. ``padded`` is the padded
    length of ``dim`` (vocabulary padding) or None. ``Slice()`` is the whole
    tensor (replicated).
    """

    dim: int | None = None
    index: int = 0
    parts: int = 1
    groups: int = 1
    padded: int | None = None

    def key(self) -> str:
        """A short canonical text for the slice, used in store keys."""
        if self.dim is None:
            return "full"
        text = f"d{self.dim}.{self.index}of{self.parts}"
        if self.groups > 1:
            text += f".g{self.groups}"
        if self.padded is not None:
            text += f".p{self.padded}"
        return text

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the sub-tensor of a logical tensor of ``shape``."""
        if self.dim is None:
            return shape
        length = self.padded if self.padded is not None else shape[self.dim]
        out = list(shape)
        out[self.dim] = length // self.parts
        return tuple(out)

    def pieces(self, shape: tuple[int, ...]) -> list[tuple[Box, Box]]:
        """``(logical box, local box)`` pairs of the state this slice holds.

        Padding rows are not state and appear in no piece. The pieces are
        disjoint and in local order.
        """
        if self.dim is None:
            box = full_box(shape)
            return [(box, box)]
        d = self.dim
        length = self.padded if self.padded is not None else shape[d]
        group_len = length // self.groups
        part_len = group_len // self.parts
        real = shape[d]
        out: list[tuple[Box, Box]] = []
        for g in range(self.groups):
            lo = g * group_len + self.index * part_len
            hi = min(lo + part_len, real)
            if hi <= lo:
                continue
            local_lo = g * part_len
            logical = tuple((lo, hi) if i == d else (0, n) for i, n in enumerate(shape))
            local = tuple(
                (local_lo, local_lo + hi - lo) if i == d else (0, n) for i, n in enumerate(shape)
            )
            out.append((logical, local))
        return out


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One end of a transfer: a region of a sub-tensor on a host.

    ``rank`` is a rank on ``host`` that holds (source) or needs
    (destination) the sub-tensor; ``box`` is in the sub-tensor's local
    coordinates.
    """

    host: str
    rank: int
    tensor: str
    slice: Slice
    box: Box


@dataclass(frozen=True, slots=True)
class Transfer:
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
