"""Hot switching (HotSPa): two or more meshes of the same workers within one step.

A job keeps one module per mesh over the same workers (say ``fsdp=4`` for
short sequences and ``fsdp=2,tp=2`` for long ones) and one *home* mesh whose
module the optimizer steps. Within a step it runs a micro-batch on another
mesh: :meth:`MeshSwitch.params` first moves the home module's parameters
into that mesh's module's local shards, and after its backward
:meth:`MeshSwitch.grads` moves the gradients it made into the home
module's, where the home micro-batches accumulate onto them. Both are
device-to-device moves on ptcfs's plan (:mod:`ptcfs.client.live.mover`);
the plans between two meshes are computed once (``device_plan`` is cached)
and each switch costs only its transfers.

Call order (every worker, collective over the default group, whose ranks
are the meshes' ranks in ptcfs's order):

1. ``sw = MeshSwitch(model, {"short": cfg_a, "long": cfg_b}, rank)``:
   ``model`` holds the parameters only (no optimizer state), the configs
   come from :func:`~ptcfs.client.torch.dtensor_spec.config_of`;
2. per step, for each micro-batch on a mesh other than home:
   ``sw.params(home, other, modules)``, forward and backward there,
   ``sw.grads(other, home, modules)``; then the home micro-batches and the
   optimizer step on home.

The meshes may come from the sequence-length chooser (``ptcctl suggest
--seq-lengths``): ``sw, r = MeshSwitch.for_lengths(model, query, lengths,
rank)`` groups a step's lengths, picks each group's mesh and switches
between them; ``r`` (a :class:`~ptcfs.suggest.lengths.MeshRouting`) names
the meshes and the home one (``r.home``), and ``r.route(lengths)`` deals
each step's sequences to the meshes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ptcfs.client.live.mover import MoveStats, device_plan, move, worker_config
from ptcfs.client.torch.dtensor import local_of
from ptcfs.client.torch.dtensor_spec import module_parameters
from ptcfs.errors import LiveError
from ptcfs.suggest.lengths import MIN_BOUND, MeshRouting, plan_groups, routing
from ptcfs.suggest.search import Query
from ptcfs.types import ModelSpec, ParallelConfig

__all__ = ["MeshSwitch"]


class MeshSwitch:
    """Moves between the modules of several meshes of the same workers."""

    def __init__(self, model: ModelSpec, configs: Mapping[str, ParallelConfig], rank: int,
                 device: str = "cpu") -> None:
        if any(s.is_optim for s in model.tensors):
            raise LiveError("a hot switch moves parameters and gradients: give the model "
                            "spec without optimizer state (spec_from_module(..., "
                            "optimizer=None))")
        worlds = {c.world for c in configs.values()}
        if len(worlds) != 1:
            raise LiveError(f"the meshes of a hot switch must have one world size, not "
                            f"{sorted(worlds)}")
        world = worlds.pop()
        self.workers = tuple(f"r{i}" for i in range(world))
        self.me = self.workers[rank]
        self.model, self.device = model, device
        self.configs = {k: worker_config(c, self.workers) for k, c in configs.items()}

    @classmethod
    def for_lengths(cls, model: ModelSpec, q: Query, lengths: Sequence[int], rank: int,
                    device: str = "cpu", min_bound: int = MIN_BOUND
                    ) -> tuple[MeshSwitch, MeshRouting]:
        """A switch between the meshes the sequence-length chooser picks for
        a step drawn like ``lengths`` (:func:`~ptcfs.suggest.lengths.plan_groups`
        on ``q``: the job's model with its optimizer, its hosts, batch and
        device), and their routing. ``model``: the parameters' spec, as for
        the constructor. The chooser's hosts must be the workers' (one rank
        per GPU, in order); ``min_bound``: as for ``plan_groups``."""
        r = routing(plan_groups(q, lengths, min_bound))
        return cls(model, r.configs, rank, device), r

    def _move(self, src: str, dst: str, held: dict[str, torch.Tensor],
              into: dict[str, torch.Tensor] | None) -> tuple[dict[str, torch.Tensor], MoveStats]:
        p = device_plan(self.model, self.configs[src], self.configs[dst])
        out, _, _, stats = move(p, self.me, held, self.model, self.workers, self.device,
                                into=into)
        return out, stats

    def params(self, src: str, dst: str, modules: Mapping[str, torch.nn.Module]) -> MoveStats:
        """The parameters of ``modules[src]`` into ``modules[dst]``'s local shards."""
        held = {n: local_of(p) for n, p in module_parameters(modules[src]).items()}
        into = {n: local_of(p) for n, p in module_parameters(modules[dst]).items()}
        with torch.no_grad():
            return self._move(src, dst, held, into)[1]

    def grads(self, src: str, dst: str, modules: Mapping[str, torch.nn.Module]) -> MoveStats:
        """The gradients of ``modules[src]`` become ``modules[dst]``'s (whose
        own must be None: its backward then accumulates onto them); the
        source's are dropped."""
        from torch.distributed.tensor import DTensor

        sparams, dparams = module_parameters(modules[src]), module_parameters(modules[dst])
        held = {}
        for n, p in sparams.items():
            if p.grad is None:
                raise LiveError(f"{n} has no gradient on mesh {src!r}: run its backward first")
            held[n] = local_of(p.grad)
        with torch.no_grad():
            out, stats = self._move(src, dst, held, None)
        for n, p in dparams.items():
            if p.grad is not None:
                raise LiveError(f"{n} already has a gradient on mesh {dst!r}: move the other "
                                "mesh's gradients before its own backward")
            g = out[n]
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride()) \
                if isinstance(p, DTensor) else g
        for p in sparams.values():
            p.grad = None
        return stats
