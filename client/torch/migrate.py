"""Migrate a rank's state in place when the job's configuration changes.

A worker that lives through a reconfiguration already holds, on its
device, the sub-tensors of its old rank. Under the new configuration its
new rank needs other sub-tensors, but often overlapping ones: same slice
(data parallelism changed), a part of the old slice (tensor parallelism
went up), or the old slice plus neighbours (it went down). :func:`migrate`
builds the new sub-tensors on the device, copying every overlapping region
device to device, and fetches only the rest from the new committed version
(the daemon of the new rank's host first).

Call order: the job is saved and committed at the step the device holds
(:mod:`ptcfs.client.control.saving`); one worker reconfigures it
(:meth:`~ptcfs.client.control.coordinator.Coordinator.reconfigure`); then every
worker calls :func:`migrate` with what it holds and its new rank.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ptcfs import settings
from ptcfs.boxes import Box, box_index, box_intersect, box_subtract, box_volume, translate
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.localread import source_for
from ptcfs.client.torch.state import TORCH_DTYPES, RankState, default_device, new_tensor
from ptcfs.errors import InvalidRequest, PeerError, PtcError
from ptcfs.jobstate import JobState
from ptcfs.sharding import rank_coords, rank_tensors
from ptcfs.types import Slice, TensorSpec, gc_paused

__all__ = ["MigrationStats", "migrate"]


@dataclass
class MigrationStats:
    """What a migration moved: bytes copied on the device, and fetched."""

    bytes_kept: int = 0
    bytes_fetched: int = 0
    bytes_zero: int = 0  # padding rows, filled with zeros

    @property
    def kept_fraction(self) -> float:
        total = self.bytes_kept + self.bytes_fetched
        return self.bytes_kept / total if total else 1.0


@gc_paused()
def migrate(cluster: Cluster, held: RankState, rank: int, state: JobState | None = None,
            device: torch.device | str | None = None) -> tuple[RankState, MigrationStats]:
    """The state of new ``rank`` under ``state`` (default: the job's current
    version), built from ``held`` (the old rank's tensors on its device)
    where they overlap and fetched elsewhere. ``held`` must be at the step
    of the new version; it is not changed (free it when done). The cyclic
    garbage collector is paused meanwhile, as in :func:`load_rank`."""
    st = state if state is not None else Coordinator(cluster).state(held.state.job)
    if st.step != held.step:
        raise InvalidRequest(
            f"the tensors on the device are at step {held.step}, the job {st.job!r} is at "
            f"step {st.step}: save and commit the device's state before reconfiguring")
    if not 0 <= rank < st.config.world:
        raise InvalidRequest(f"rank {rank} is not a rank of job {st.job!r} ({st.describe()})")
    first = next(iter(held.tensors.values()), None)
    dev = torch.device(device) if device is not None else (
        first.device if first is not None else default_device())
    model = st.model_spec()
    home = rank_coords(st.config)[rank].host
    stats = MigrationStats()
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, Slice] = {}
    specs: dict[str, TensorSpec] = {}
    fetches: list[tuple[TensorSpec, Slice, list[str], Box, torch.Tensor]] = []
    for spec, sl in rank_tensors(model, st.config, rank):
        shape = sl.local_shape(spec.shape)
        pieces = sl.pieces(spec.shape)
        state_elems = sum(box_volume(lg) for lg, _ in pieces)
        out = torch.zeros(shape, dtype=TORCH_DTYPES[spec.dtype], device=dev) \
            if state_elems < math.prod(shape) else new_tensor(shape, TORCH_DTYPES[spec.dtype], dev)
        item = out.element_size()
        src_name = spec.name if spec.name in held.tensors else spec.same_as
        old = held.tensors.get(src_name) if src_name else None
        old_pieces = held.slices[src_name].pieces(spec.shape) if old is not None and src_name \
            else []
        hosts: list[str] | None = None
        for logical, local in pieces:
            kept: list[Box] = []
            for ologic, olocal in old_pieces:
                inter = box_intersect(logical, ologic)
                if inter is None or old is None:
                    continue
                out[box_index(translate(inter, logical, local))].copy_(
                    old[box_index(translate(inter, ologic, olocal))])
                kept.append(inter)
                stats.bytes_kept += box_volume(inter) * item
            for region in box_subtract(logical, kept):
                if hosts is None:
                    where = st.placement(spec, model).get(sl, {})
                    hosts = sorted(where, key=lambda h: h != home)
                fetches.append((spec, sl, hosts, translate(region, logical, local), out))
                stats.bytes_fetched += box_volume(region) * item
        stats.bytes_zero += (math.prod(shape) - state_elems) * item
        tensors[spec.name], slices[spec.name], specs[spec.name] = out, sl, spec
    with ThreadPoolExecutor(max_workers=settings.get("PTC_CLIENT_READ_THREADS")) as pool:
        for f in [pool.submit(_fetch, cluster, st, *job) for job in fetches]:
            f.result()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return RankState(st, rank, tensors, slices, st.step, specs), stats


def _fetch(cluster: Cluster, st: JobState, spec: TensorSpec, sl: Slice, hosts: list[str],
           box: Box, out: torch.Tensor) -> None:
    """Read ``box`` (local coordinates) of the stored new sub-tensor into
    ``out[box]`` from the first of ``hosts`` that answers."""
    if not hosts:
        raise PeerError(f"{spec.name} [{sl.key()}] of job {st.job!r} has no host")
    extents = tuple(b - a for a, b in box)
    dest = out[box_index(box)]
    pin = out.device.type == "cuda"
    direct = not pin and dest.is_contiguous()
    buf = dest if direct else torch.empty(extents, dtype=out.dtype, pin_memory=pin)
    raw = buf.reshape(-1).view(torch.uint8).numpy()
    errors: list[str] = []
    for h in hosts:
        try:
            source_for(cluster, h).read_box(st.job, st.version, spec.name, sl.key(), box,
                                            itemsize=out.element_size(), out=raw)
            break
        except PtcError as e:
            errors.append(f"{h}: {e}")
    else:
        raise PeerError(f"cannot fetch {spec.name} [{sl.key()}] of job {st.job!r}: "
                        + "; ".join(errors))
    if not direct:
        dest.copy_(buf, non_blocking=pin)
        if pin:
            torch.cuda.current_stream(out.device).synchronize()
