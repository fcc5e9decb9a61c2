"""torchtitan's stacked experts: one tensor per projection in its checkpoints,
one tensor per expert in a job.

torchtitan's MoE keeps a layer's routed experts stacked on dimension 0
(``moe.routed_experts.inner_experts.w1_EFD``: ``[experts, hidden, dim]``),
its Adam moments too. A job keeps expert ``j`` of stacked tensor ``S`` as
its own tensor ``S.<j>`` (:func:`~ptcfs.dcp.titan.expert_name`) whose rule
names its expert, as the experts of Megatron-Core and Hugging Face jobs
are kept: expert parallelism places whole experts, the expert
data-parallel group shards each one, and the spec is transformers' own
for the model (each expert's tensors as Hugging Face names them, one to
one).

Import (:func:`split`): each expert's tensor is read from the checkpoint as
the box ``[j]`` of the stacked key (DCP reads only the stored chunks it
meets). Export, and the mount's view, write the stacked key as the chunks of
its experts' sub-tensors, each at offset ``j`` of dimension 0 with size 1
there (:func:`~ptcfs.dcp.titan.stacked_key`, a
:class:`~ptcfs.dcp.titan.Composite`), so no stacked tensor is built in
memory and torchtitan's ``dcp.load`` reshards them onto its own mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ptcfs.client.formats.common import Entry, Source
from ptcfs.client.formats.dcp_box import read_box
from ptcfs.dcp.titan import expert_name, is_stacked
from ptcfs.errors import CheckpointError

__all__ = ["split"]


def split(src: Source, path: Path, keys: Mapping[str, str]) -> None:
    """Each stacked tensor of ``src`` (a parameter or a moment; ``keys``: job
    name → its DCP key) becomes its experts' tensors."""
    for name in list(src.tensors):
        if not is_stacked(name.rpartition("/")[2]):
            continue
        e = src.tensors.pop(name)
        if len(e.shape) < 2:
            raise CheckpointError(f"{e.where}: of shape {e.shape}, not experts stacked on "
                                  "dimension 0")
        for j in range(e.shape[0]):
            src.tensors[expert_name(name, j)] = Entry(
                e.shape[1:], e.dtype, _box(path, keys[name], j, e.shape, e.dtype),
                f"{e.where} [expert {j}]")
        src.chunks.pop(name, None)  # cut by expert: no mesh of the job's to see in them
        src.writers.pop(name, None)


def _box(path: Path, key: str, j: int, shape: tuple[int, ...], dtype: torch.dtype
         ) -> Callable[[], torch.Tensor]:
    def get() -> torch.Tensor:
        return read_box(path, key, (j,) + (0,) * (len(shape) - 1), (1, *shape[1:]), dtype)[0]

    return get
