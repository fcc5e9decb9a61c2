"""A live job's generations as a worker sees them, and what each change did.

The launcher (:mod:`ptcfs.client.live.agent`) writes generation ``n`` as
JSON under ``gen/<n>`` in its store; :func:`read_generation` reads it back.
:func:`layout_config` is the one rule that turns a generation's workers
into a ptcfs configuration (one "host" per worker, for the device plan);
:class:`Change` is one worker's record of one change.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from ptcfs.client.live.mover import MoveStats, worker_config
from ptcfs.client.torch.dtensor_spec import MESH_NAMES, config_of
from ptcfs.types import MESH_DIMS, Generation, Host, ParallelConfig

__all__ = ["Change", "Layout", "layout_config", "read_generation"]

#: ``layout(world)``: the mesh shape and dimension names for a world size.
Layout = Callable[[int], tuple[tuple[int, ...], tuple[str, ...]]]


def read_generation(store: dist.Store, number: int) -> Generation:
    raw = json.loads(store.get(f"gen/{number}").decode())
    return Generation(raw["number"], tuple(raw["workers"]), tuple(raw["previous"]),
                      tuple(raw["lost"]), raw["decided"], raw["at_step"])


def layout_config(layout: Layout, workers: tuple[str, ...]) -> ParallelConfig:
    """The configuration of ``layout(len(workers))`` on one host per worker."""
    shape, names = layout(len(workers))
    degrees = dict.fromkeys(MESH_DIMS, 1)
    for n, s in zip(names, shape):
        degrees[MESH_NAMES[n]] = s
    return worker_config(config_of(degrees, (Host("any", len(workers)),)), workers)


@dataclass
class Change:
    """What one change did on this worker (times from ``time.time()``)."""

    generation: int
    kind: str  # start, change or loss
    world: int
    step: int
    decided: float
    reformed_s: float = 0.0
    moved_s: float = 0.0
    rebuilt_s: float = 0.0
    first_step_at: float = 0.0
    #: steps some survivor had taken that the job trains again (0: copies covered it)
    steps_lost: int = 0
    #: survivors that took the step's optimizer step at the change (a healed death)
    rolled_forward: tuple[str, ...] = ()
    move: MoveStats = field(default_factory=MoveStats)
    #: the step the change's durable copy commits (-1: none, the job has no store)
    commit_step: int = -1
    #: when that copy began (after ``first_step_at``: it is not on the change's path)
    commit_began: float = 0.0

    @property
    def downtime(self) -> float:
        """From the decision to the end of the first step after it."""
        return self.first_step_at - self.decided
