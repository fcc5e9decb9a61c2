"""How a job's ``reconfigure(mesh, ...)`` moves the state: the seam between
the training face (:class:`~ptcfs.client.torch.job.Job`) and the ways to
move it.

A :class:`Mover` turns what this rank holds under the job's configuration
(its old rank's sub-tensors on its device, at the job's committed step)
into the sub-tensors of its new rank under a new configuration, and makes
that configuration the job's. The face saves the step the module is at
before it moves (so what moves is committed), and hands the result to the
new module, so a training script calls ``job.reconfigure(...)`` the same
way whichever mover runs.

The call order (every rank, in the same order):

1. ``rs = mover.move(cluster, held, config, rank)``: collective. ``held``:
   the old rank's sub-tensors, live in the old module (not changed);
   ``config``: the new configuration; ``rank``: this worker's rank under it.
   Returns the new rank's :class:`~ptcfs.client.torch.state.RankState`,
   whose ``state`` is the job's new committed version; or, when its
   ``commit`` is set (a :class:`~ptcfs.client.torch.saver.Saved` with a
   ``start()``), the version that commit will make: the face starts it
   after the first optimizer step on the new mesh and waits for it where it
   waits for a background save.

:class:`StoreMover`, the default, goes through the stores: rank 0
reconfigures the job on the daemons
(:meth:`~ptcfs.client.control.coordinator.Coordinator.reconfigure`), then every
rank keeps what it holds of its new slices and fetches only the rest from
the new version (:func:`~ptcfs.client.torch.migrate.migrate`).
"""

from __future__ import annotations

from typing import Protocol

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.gang import on_every, on_rank0
from ptcfs.client.torch.migrate import migrate
from ptcfs.client.torch.state import RankState
from ptcfs.jobstate import JobState
from ptcfs.types import ParallelConfig

__all__ = ["Mover", "StoreMover", "default_mover"]


class Mover(Protocol):
    def move(self, cluster: Cluster, held: RankState, config: ParallelConfig,
             rank: int) -> RankState: ...


class StoreMover:
    """Reconfigure on the daemons, then migrate each rank in place."""

    def move(self, cluster: Cluster, held: RankState, config: ParallelConfig,
             rank: int) -> RankState:
        job = held.state.job

        def decide() -> JobState:
            coord = Coordinator(cluster)
            now = coord.state(job)
            return now if now.config == config else coord.reconfigure(job, config).new

        new = on_rank0(decide)
        rs, _ = on_every(lambda: migrate(cluster, held, rank, new))
        return rs


def default_mover() -> Mover:
    """The mover a job's handle uses unless it is given one."""
    return StoreMover()
