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
from ptcfs.jobstate import JobState
from ptcfs.model.optgroups import named_groups
from ptcfs.model.specfile import encode_spec
from ptcfs.sharding import layout_of
from ptcfs.types import Box, ModelSpec, Slice, TensorSpec

__all__ = ["PARAM_KEY", "write_dcp", "dcp_keys"]

#: Top-level key of the job-dtype parameters whose fp32 masters are ``model.<name>``.
PARAM_KEY = "ptcfs_param"


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Where one chunk's values are: a box of a job sub-tensor."""

    spec: TensorSpec
    slice: Slice
    local: Box


def dcp_keys(state: JobState) -> dict[tuple[str, ...], TensorSpec]:
    """Every exported tensor's path in the nested state dict (``("model",
    name)``, ``("optim", "state", name, kind)``, ``(PARAM_KEY, name)``) →
    the job tensor whose values it holds."""
    model = state.model_spec()
    specs = {s.name: s for s in model.tensors}
    out: dict[tuple[str, ...], TensorSpec] = {}
    for s in model.tensors:
        if s.is_optim:
            _, kind, name = s.name.split("/", 2)
            if kind != "master":
                out[("optim", "state", name, kind)] = s
            continue
        master = specs.get(f"optim/master/{s.name}")
        out[("model", s.name)] = master or s
        if master is not None:
            out[(PARAM_KEY, s.name)] = s
    return out


def _groups(optimizer: str, model: ModelSpec, names: list[str]) -> list[dict[str, Any]]:
    """The param groups over ``names``: the groups the job recorded, with
    their settings (:func:`ptcfs.model.optgroups.named_groups`), then one of
    torch's defaults for ``optimizer`` over the names none of them covers."""
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    g = cls([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    return [{**g, **(settings or {}), "params": list(members)}
            for settings, members in named_groups(model, names)]


class _LayoutPlanner(DefaultSavePlanner):
    """DCP's default planner for the small entries, plus one write item per
    chunk of the job's layout, resolved from the job's store on demand."""

    def __init__(self, coord: Coordinator, state: JobState,
                 keys: dict[tuple[str, ...], TensorSpec], tick: Any) -> None:
        super().__init__()
        self._coord, self._state, self._tick = coord, state, tick
        self._paths = {".".join(p): p for p in keys}
        self._items: list[WriteItem] = []
        self._chunks: dict[tuple[str, tuple[int, ...]], _Chunk] = {}
        self._held: tuple[str, Slice, torch.Tensor] | None = None
        for path, spec in keys.items():
            fqn = ".".join(path)
            props = TensorProperties(dtype=TORCH_DTYPES[spec.dtype])
            for sl in layout_of(spec, state.config).slices():
                for lbox, local in sl.pieces(spec.shape):
                    offsets = tuple(a for a, _ in lbox)
                    chunk = ChunkStorageMetadata(torch.Size(offsets),
                                                 torch.Size(b - a for a, b in lbox))
                    self._items.append(WriteItem(
                        MetadataIndex(fqn, torch.Size(offsets)), WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk, props, torch.Size(spec.shape))))
                    self._chunks[(fqn, offsets)] = _Chunk(spec, sl, local)

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
    small: dict[str, Any] = {"step": state.step, "ptcfs_model": state.model,
                             "ptcfs_spec": state.spec or encode_spec(state.model_spec()),
                             "ptcfs_config": state.config.degrees_text()}
    params = [p[1] for p in keys if p[0] == "model"]
    if state.optimizer in ("adam", "adamw"):
        small["optim"] = {
            "state": {n: {"step": torch.tensor(float(state.step))} for n in params},
            "param_groups": _groups(state.optimizer, state.model_spec(), params)}
    total = sum(s.nbytes for s in keys.values())
    path.mkdir(parents=True, exist_ok=True)
    with progress_bar(total, f"export {state.job}", progress) as tick, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(small, storage_writer=dcp.FileSystemWriter(str(path)),
                 planner=_LayoutPlanner(coord, state, keys, tick), no_dist=True)
    return path
