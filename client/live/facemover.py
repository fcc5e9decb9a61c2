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
2. every rank moves its sub-tensors on the plan
   (:func:`~ptcfs.client.live.mover.move`: what it keeps copied on its
   device, the rest by batched isend/irecv from the peer that holds it);
   no byte of the move goes through the stores;
3. ``move`` returns the new rank's tensors under the new configuration,
   not yet committed, with a :class:`DeferredCommit`: the durable copy
   (:meth:`~ptcfs.client.control.coordinator.Coordinator.reconfigure` of
   the committed version on the daemons, which the face saved at this step
   before the move). The face starts it after the first optimizer step on
   the new mesh (:meth:`~ptcfs.client.torch.job.Job.reconfigure`), so
   nothing of it is on the path from the decision to that step; rank 0
   commits in a thread while training goes on (the
   :class:`~ptcfs.client.torch.saver.DeferredCommit` a live launcher's job
   uses too, there beginning a background save of the new layout);
4. the face waits for it where it waits for a background save (the next
   ``save``, ``wait``, ``reconfigure`` or ``close``; ``wait`` starts it
   first if no step did): every rank learns the new committed version.

:attr:`LiveMover.last` holds this worker's :class:`MoveStats` of the last
move (``bytes_received == bytes_planned_in`` on a complete move) and
:attr:`LiveMover.commit` the last :class:`DeferredCommit` (its
``timings``: ``moved``, ``began`` and ``committed``, from ``time.time()``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.live.mover import MoveStats, device_plan, move, worker_config
from ptcfs.client.torch.gang import gather, on_every, on_rank0, rank_world
from ptcfs.client.torch.saver import DeferredCommit
from ptcfs.client.torch.state import RankState
from ptcfs.errors import LiveError, PtcError
from ptcfs.jobstate import JobState
from ptcfs.types import ParallelConfig

__all__ = ["LiveMover"]


class LiveMover:
    """A :class:`~ptcfs.client.torch.mover.Mover` that moves device to device."""

    def __init__(self) -> None:
        self.last: MoveStats | None = None
        self.commit: DeferredCommit | None = None

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
        moved = on_every(lambda: move(p, names[me], held.tensors, model, names, device))
        tensors, slices, specs, self.last = moved
        self.commit = DeferredCommit(st.step, lambda: _OnRank0(
            lambda: _commit(cluster, st.job, config), st.step))
        return RankState(replace(st, config=config), rank, tensors, slices, st.step, specs,
                         commit=self.commit)


class _OnRank0:
    """A :class:`~ptcfs.client.torch.saver.Saved`: ``fn`` in a thread on
    rank 0 (other ranks: nothing), its result on every rank at :meth:`wait`."""

    def __init__(self, fn: Callable[[], JobState], step: int) -> None:
        self._fn, self._step = fn, step
        self._thread: threading.Thread | None = None
        self._result: JobState | None = None
        self._error: PtcError | None = None
        self._state: JobState | None = None
        if rank_world()[0] == 0:
            self._thread = threading.Thread(target=self._run, name="ptc-live-commit",
                                            daemon=True)
            self._thread.start()

    @property
    def step(self) -> int:
        return self._step

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except PtcError as e:
            self._error = e

    def done(self) -> bool:  # alike on every rank (the face waits collectively when done)
        return self._state is not None

    def copied(self) -> None:
        pass  # it copies nothing: the daemons reconfigure what is committed

    def wait(self) -> JobState:
        def finish() -> JobState:
            assert self._thread is not None
            self._thread.join()
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

        if self._state is None:
            self._state = on_rank0(finish)
        return self._state


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
