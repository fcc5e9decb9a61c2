"""The training face's live mover: ``job.reconfigure(mesh, ...)`` with the
same processes, the state moved device to device on ptcfs's plan.

Select it when attaching (the face never imports this room; it takes any
:class:`~ptcfs.client.torch.mover.Mover`)::

    from ptcfs.client.live import LiveMover
    job = ptc.attach("llama", model, opt, mesh, mover=LiveMover())
    job.reconfigure(new_mesh, new_model, new_opt, step)   # device to device

What :meth:`LiveMover.move` does (every rank of the default process group,
collective; each process is one worker named by its process-group rank):

1. every rank tells the others its old and new rank; the old and new
   configurations on one "host" per worker
   (:func:`~ptcfs.client.live.mover.worker_config`) give the plan
   (:func:`~ptcfs.client.live.mover.device_plan`, cached per layout pair);
2. rank 0 starts the durable copy on the daemons in a thread
   (:meth:`~ptcfs.client.control.coordinator.Coordinator.reconfigure` of the
   committed version, which the face saved at this step before the move);
3. every rank moves its sub-tensors on the plan
   (:func:`~ptcfs.client.live.mover.move`: what it keeps copied on its
   device, the rest by batched isend/irecv from the peer that holds it);
   no byte of the move goes through the stores;
4. rank 0 waits for the daemons' new version and every rank learns it:
   ``reconfigure`` returns once the stores hold the new version, the
   commit overlapping the device move rather than following it.

:attr:`LiveMover.last` holds this worker's :class:`MoveStats` of the last
move (``bytes_received == bytes_planned_in`` on a complete move).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.live.mover import MoveStats, device_plan, move, worker_config
from ptcfs.client.torch.gang import gather, on_every, on_rank0, rank_world
from ptcfs.client.torch.state import RankState
from ptcfs.errors import LiveError
from ptcfs.jobstate import JobState
from ptcfs.types import ParallelConfig

__all__ = ["LiveMover"]


class LiveMover:
    """A :class:`~ptcfs.client.torch.mover.Mover` that moves device to device."""

    def __init__(self) -> None:
        self.last: MoveStats | None = None

    def move(self, cluster: Cluster, held: RankState, config: ParallelConfig,
             rank: int) -> RankState:
        st = held.state
        me, world = rank_world()
        names = [f"w{i}" for i in range(world)]
        ranks = gather((held.rank, rank))
        old_w, new_w = _order(ranks, 0, names), _order(ranks, 1, names)
        model = st.model_spec()
        p = device_plan(model, worker_config(st.config, old_w), worker_config(config, new_w))
        device = next(iter(held.tensors.values()), torch.empty(0)).device
        with ThreadPoolExecutor(1, thread_name_prefix="ptc-live-commit") as pool:
            commit: Future[JobState] | None = None
            if me == 0:
                commit = pool.submit(_commit, cluster, st.job, config)
            moved = on_every(lambda: move(p, names[me], held.tensors, model, names, device))
            new = on_rank0(lambda: commit.result() if commit is not None else st)
        tensors, slices, specs, self.last = moved
        return RankState(new, rank, tensors, slices, st.step, specs)


def _order(ranks: list[tuple[int, int]], which: int, names: list[str]) -> list[str]:
    """The workers in the order of their old (``which=0``) or new ranks."""
    by = sorted(range(len(ranks)), key=lambda i: ranks[i][which])
    if [ranks[i][which] for i in by] != list(range(len(ranks))):
        raise LiveError(f"the workers' {'new' if which else 'old'} ranks "
                        f"{sorted(r[which] for r in ranks)} are not 0..{len(ranks) - 1}: "
                        "a live move keeps the same processes")
    return [names[i] for i in by]


def _commit(cluster: Cluster, job: str, config: ParallelConfig) -> JobState:
    """The new version on the daemons: the committed one on ``config``."""
    coord = Coordinator(cluster)
    now = coord.state(job)
    return now if now.config == config else coord.reconfigure(job, config).new
