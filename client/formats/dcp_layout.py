"""DCP export in the job's own layout: one chunk per sub-tensor.

``ptcctl export --format torch-dcp`` writes a ``torch.distributed.checkpoint``
directory whose tensors are stored as the chunks of the job's current
configuration: every distinct sub-tensor the ranks hold (a box of the
logical tensor; a fused or padded slice gives one chunk per piece, the
padding left out), as ``dcp.save`` of the ranks' DTensor state dicts would
store them. Any job, on any mesh, loads it with ``dcp.load`` into its own
state dict (DCP reads, for each local shard, the parts of the chunks it
meets). It is written from one process with DCP's own ``FileSystemWriter``
and a planner that lists the chunks, so DCP builds and checks the
metadata; each sub-tensor is read from a host that holds it when the
writer reaches it: no whole tensor is built, one sub-tensor at a time is
in memory.

Keys, those of torch's recipe
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``
and a few of ptcfs's:

- ``model.<name>``: the parameter; for a job that keeps fp32 master
  weights (bf16 or fp16 parameters with Adam) the **fp32 master**, so that
  ``dcp.load`` into an fp32 model (FSDP2's sharded parameters under a
  ``MixedPrecisionPolicy``) reads the masters, and into a bf16 model their
  rounding;
- ``ptcfs_param.<name>``: for those, the parameter in the job's dtype (the
  import reads both back);
- ``optim.state.<name>.<kind>``: the optimizer state in fp32 (``exp_avg``,
  ``exp_avg_sq``), and ``optim.state.<name>.step``, the job's step;
- ``optim.param_groups.<i>.*``: the optimizer's groups the job recorded
  from the checkpoint it came from, each with its settings (learning rate,
  betas, weight decay...) and its parameters by name
  (:mod:`ptcfs.model.optgroups`), which ``set_state_dict`` puts into the groups
  that hold those parameters; parameters no recorded group covers (all of
  them for a job that recorded none) get one group of torch's defaults for
  Adam (AdamW for ``adamw`` jobs);
- ``step``, ``ptcfs_model`` (how the model was given), ``ptcfs_spec``
  (the whole spec, :func:`~ptcfs.model.specfile.encode_spec`) and
  ``ptcfs_config`` (the job's degrees, the layout of its chunks, which an
  import takes when not given another).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ptcfs.boxes import box_index
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats.common import from_numpy, read_sub
from ptcfs.client.torch.state import TORCH_DTYPES, progress_bar
from ptcfs.dcp.layout import PARAM_KEY, Chunk, chunks, dcp_keys, small_entries
from ptcfs.jobstate import JobState
from ptcfs.types import Slice, TensorSpec

__all__ = ["PARAM_KEY", "LayoutPlanner", "write_dcp", "dcp_keys"]


def _defaults() -> dict[str, dict[str, Any]]:
    """torch's own Adam and AdamW group settings (those of this torch)."""
    out = {}
    for name, cls in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        g = cls([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
        out[name] = {k: v for k, v in g.items() if k != "params"}
    return out


class LayoutPlanner(DefaultSavePlanner):
    """DCP's default planner for the small entries, plus one write item per
    chunk of the job's layout, resolved from the job's store on demand."""

    def __init__(self, coord: Coordinator, state: JobState,
                 keys: dict[tuple[str, ...], TensorSpec], tick: Any) -> None:
        super().__init__()
        self._coord, self._state, self._tick = coord, state, tick
        self._paths = {".".join(p): p for p in keys}
        self._items: list[WriteItem] = []
        self._chunks: dict[tuple[str, tuple[int, ...]], Chunk] = {}
        self._held: tuple[str, Slice, torch.Tensor] | None = None
        for c in chunks(state, keys):
            props = TensorProperties(dtype=TORCH_DTYPES[c.spec.dtype])
            chunk = ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
            self._items.append(WriteItem(
                MetadataIndex(c.fqn, torch.Size(c.offsets)), WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk, props, torch.Size(c.spec.shape))))
            self._chunks[(c.fqn, c.offsets)] = c

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.mappings.update(self._paths)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=plan.items + self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        c = self._chunks.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if c is None:
            return super().resolve_data(write_item)
        held = self._held
        if held is None or held[0] != c.spec.name or held[1] != c.slice:
            sub = from_numpy(read_sub(self._coord, self._state, c.spec, c.slice), c.spec.dtype)
            held = self._held = (c.spec.name, c.slice, sub)
            self._tick(sub.numel() * sub.element_size())
        return held[2][box_index(c.local)].contiguous()


def write_dcp(coord: Coordinator, state: JobState, path: Path,
              progress: bool | None = None) -> Path:
    """A DCP directory of the job's state in its current layout (see the
    module docstring)."""
    keys = dcp_keys(state)
    small = small_entries(state, keys, _defaults())
    for per in small.get("optim", {}).get("state", {}).values():
        per["step"] = torch.tensor(per["step"])  # a tensor, as torch's Adam keeps it
    total = sum(s.nbytes for s in keys.values())
    path.mkdir(parents=True, exist_ok=True)
    with progress_bar(total, f"export {state.job}", progress) as tick, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(small, storage_writer=dcp.FileSystemWriter(str(path)),
                 planner=LayoutPlanner(coord, state, keys, tick), no_dist=True)
    return path
