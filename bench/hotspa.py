"""HotSPa's greedy switching planner, reimplemented as the peer of ours.

HotSPa (SOSP'24) plans a parallelism switch device by device. For every
destination GPU (in rank order) and every region of every sub-tensor it
needs under the new configuration (in model order):

1. if the same GPU held the region under the old configuration, it is
   reused (nothing is sent);
2. else, if GPUs on the same node held it, the one that has sent the
   fewest bytes so far sends it (intra-node, not across hosts);
3. else the least-loaded GPU (fewest bytes sent so far) among all the
   others that held it sends it across hosts.

Ties go to the lower old rank. A GPU is ``(host, index among the host's
ranks)``. Unlike our planner, which plans per host and shares one copy
among the ranks of a host that need the same slice, HotSPa fetches a
region once per destination GPU; and its loads are per GPU, so a host's
total can end up uneven. Only the state that ranks hold counts as a
source (no replica-only copies), as in HotSPa.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ptcfs.sharding import holders, rank_coords, rank_tensors
from ptcfs.types import ModelSpec, ParallelConfig, Slice, TensorSpec, box_intersect, box_volume

__all__ = ["GreedyResult", "hotspa_plan"]


@dataclass
class GreedyResult:
    """Bytes the greedy plan moves, per host and in total."""

    bytes_cross_host: int = 0
    bytes_intra_node: int = 0
    bytes_reused: int = 0
    host_send: dict[str, int] = field(default_factory=dict)

    @property
    def max_host_send_bytes(self) -> int:
        return max(self.host_send.values(), default=0)


def _gpus(cfg: ParallelConfig) -> dict[int, tuple[str, int]]:
    """rank → (host, index of the rank among its host's ranks)."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for c in rank_coords(cfg):
        out[c.rank] = (c.host, seen[c.host])
        seen[c.host] += 1
    return out


def _overlaps(shape: tuple[int, ...], dst: Slice,
              srcs: list[Slice]) -> list[tuple[Slice, int]]:
    """(source slice, elements) of every region where ``dst`` meets a source."""
    out = []
    for d_box, _ in dst.pieces(shape):
        for s in srcs:
            for s_box, _ in s.pieces(shape):
                inter = box_intersect(d_box, s_box)
                if inter is not None:
                    out.append((s, box_volume(inter)))
    return out


def _source(spec: TensorSpec, old: dict[str, TensorSpec]) -> TensorSpec:
    if spec.name in old:
        return old[spec.name]
    if spec.same_as and spec.same_as in old:
        return old[spec.same_as]
    raise ValueError(f"tensor {spec.name} has no source in the old configuration")


def hotspa_plan(model: ModelSpec, old: ParallelConfig, new: ParallelConfig) -> GreedyResult:
    """The bytes HotSPa's greedy planner moves to turn ``old`` into ``new``."""
    old_gpu, new_gpu = _gpus(old), _gpus(new)
    old_specs = {s.name: s for s in model.tensors_for(old.pp)}
    # per source tensor: slice → the old ranks holding it, in rank order
    owners: dict[str, dict[Slice, list[int]]] = {}
    sent: dict[int, int] = defaultdict(int)  # old rank → bytes it has sent so far
    out = GreedyResult(host_send={h.name: 0 for h in old.hosts})
    cache: dict[tuple[str, Slice], list[tuple[Slice, int]]] = {}
    for rank in range(new.world):
        host, _ = new_gpu[rank]
        for spec, dsl in rank_tensors(model, new, rank):
            src = _source(spec, old_specs)
            if src.name not in owners:
                owners[src.name] = {sl: sorted(r for rs in hs.values() for r in rs)
                                    for sl, hs in holders(model, old, src).items()}
            by_slice = owners[src.name]
            key = (spec.name, dsl)
            if key not in cache:
                cache[key] = _overlaps(spec.shape, dsl, list(by_slice))
            for ssl, elems in cache[key]:
                nbytes = elems * spec.itemsize
                cands = by_slice[ssl]
                if any(old_gpu[r] == new_gpu[rank] for r in cands):
                    out.bytes_reused += nbytes
                    continue
                near = [r for r in cands if old_gpu[r][0] == host]
                pick = min(near or cands, key=lambda r: (sent[r], r))
                sent[pick] += nbytes
                if near:
                    out.bytes_intra_node += nbytes
                else:
                    out.bytes_cross_host += nbytes
                    src_host = old_gpu[pick][0]
                    out.host_send[src_host] = out.host_send.get(src_host, 0) + nbytes
    return out
