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
meets). Export (:class:`Stacked`, :func:`stacked_chunks`): the stacked key is
written as the chunks of its experts' sub-tensors, each at offset ``j`` of
dimension 0 with size 1 there, so no stacked tensor is built in memory and
torchtitan's ``dcp.load`` reshards them onto its own mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ptcfs.client.formats.common import Entry, Source
from ptcfs.client.formats.dcp_box import read_box
from ptcfs.dcp.layout import Chunk, chunks
from ptcfs.dcp.titan import expert_name, expert_of, is_stacked
from ptcfs.errors import CheckpointError
from ptcfs.jobstate import JobState
from ptcfs.types import TensorSpec

__all__ = ["Stacked", "split", "stacked", "stacked_chunks"]


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


@dataclass(frozen=True)
class Stacked:
    """A stacked key to write: its state-dict path and its experts' job tensors, in order."""

    path: tuple[str, ...]
    experts: tuple[TensorSpec, ...]

    @property
    def fqn(self) -> str:
        return ".".join(self.path)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)


def stacked(job: str, names: Mapping[str, str], specs: Mapping[str, TensorSpec],
            kinds: tuple[str, ...], stepped: Container[str] | None = None) -> list[Stacked]:
    """The stacked keys of a job whose tensors have torchtitan names
    ``names`` (job name → torchtitan's): each parameter at the top level,
    each moment of ``kinds`` as ``optimizer.state.<param>.<kind>`` (of the
    parameters in ``stepped`` only, when given)."""
    by: dict[str, dict[int, str]] = {}
    for job_name, titan in names.items():
        e = expert_of(titan)
        if e is not None:
            by.setdefault(e[0], {})[e[1]] = job_name
    out = []
    for param, experts in sorted(by.items()):
        if sorted(experts) != list(range(len(experts))):
            raise CheckpointError(f"job {job!r}: the experts of {param} are "
                                  f"{sorted(experts)}, not 0 to {len(experts) - 1}")
        order = [experts[j] for j in range(len(experts))]
        parts = [specs[n] for n in order]
        if len({(p.shape, p.dtype) for p in parts}) != 1:
            raise CheckpointError(f"job {job!r}: the experts of {param} differ in shape or "
                                  "dtype; torchtitan stacks them in one tensor")
        out.append(Stacked((param,), tuple(parts)))
        for kind in kinds if stepped is None or param in stepped else ():
            moments = [specs.get(f"optim/{kind}/{n}") for n in order]
            if all(m is not None for m in moments):
                out.append(Stacked(("optimizer", f"state.{param}.{kind}"),
                                   tuple(m for m in moments if m is not None)))
    return out


def stacked_chunks(state: JobState, s: Stacked) -> list[Chunk]:
    """The chunks of a stacked key: each expert's in the job's layout, at
    its expert's offset (size 1) of dimension 0."""
    return [replace(c, fqn=s.fqn, offsets=(j, *c.offsets), sizes=(1, *c.sizes))
            for j, spec in enumerate(s.experts) for c in chunks(state, {s.path: spec})]
