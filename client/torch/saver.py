"""How a job's ``save(step)`` is carried out: the seam between the training
face (:class:`~ptcfs.client.torch.job.Job`) and the ways to save.

A :class:`Saver` makes what every rank holds at a step the job's next
committed version. It may return before the commit (a save in the
background): the face keeps the :class:`Saved` it returns and waits on it
before it saves again, loads, reconfigures or closes, so a training script
calls ``job.save(step)`` the same way whichever saver runs.

The call order (every rank, in the same order):

1. ``saved = saver.begin(cluster, state, rank, step, tensors, late)``:
   collective. ``tensors`` are the rank's sub-tensors as the module holds
   them, live (:func:`~ptcfs.client.torch.module.state_of`): training
   changes them as soon as ``begin`` returns, so a saver that returns early
   takes its copy of them first; unless ``late`` is true, when the caller
   calls ``saved.copied()`` before anything changes them (the face does, in
   a hook before the optimizer's next step).
2. Training goes on.
3. ``saved.wait()`` gives the committed :class:`~ptcfs.jobstate.JobState`;
   collective too (every rank waits at the same point), and it raises on
   every rank when the save failed, the previous version staying current.

:class:`~ptcfs.client.torch.background.InBackground`, the default, returns
once the rank's tensors are copied and puts and commits them in a thread.
:class:`StoreSaver` (``attach(..., background=False)``) saves in the call:
rank 0 opens the version, each sub-tensor's first holder puts it on its own
host, rank 0 commits the step (:func:`ptcfs.client.torch.elastic.save`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.torch.background import InBackground
from ptcfs.client.torch.elastic import save
from ptcfs.jobstate import JobState

__all__ = ["Saved", "Saver", "Committed", "DeferredCommit", "StoreSaver", "default_saver"]


class Saved(Protocol):
    """A save begun: done now, or later."""

    @property
    def step(self) -> int: ...

    def done(self) -> bool: ...

    def copied(self) -> None: ...

    def wait(self) -> JobState: ...


class Saver(Protocol):
    def begin(self, cluster: Cluster, state: JobState, rank: int, step: int,
              tensors: Mapping[str, torch.Tensor], late: bool = False) -> Saved: ...


@dataclass(frozen=True)
class Committed:
    """A save that was committed before ``begin`` returned."""

    step: int
    state: JobState
    seconds: float

    def done(self) -> bool:
        return True

    def copied(self) -> None:
        pass

    def wait(self) -> JobState:
        return self.state


class DeferredCommit:
    """A :class:`Saved` that begins when told: the durable copy of a live
    change, which must not be on the path from the decision to the first
    step on the new mesh.

    1. made (every rank) with the step it commits and ``begin``, what
       starts the copy (a function returning the :class:`Saved` it makes);
    2. :meth:`start` (every rank, once, after the first optimizer step on
       the new mesh: the face's optimizer hook, or the live worker's loop)
       calls ``begin``; a second call does nothing;
    3. :meth:`wait` (collective, where the face waits for a background save)
       starts it if nothing did, then waits for it: the committed version.

    The training face's live mover (:class:`~ptcfs.client.live.LiveMover`)
    begins a reconfiguration of the committed version on the daemons; a
    live launcher's job (:func:`~ptcfs.client.torch.adopt.adopt`) begins a
    background save of the new layout. ``timings`` (``time.time()``):
    ``moved`` when made, ``began`` at :meth:`start`, ``committed`` when
    :meth:`wait` returned."""

    def __init__(self, step: int, begin: Callable[[], Saved]) -> None:
        self._step, self._begin = step, begin
        self._saved: Saved | None = None
        self.timings: dict[str, float] = {"moved": time.time()}

    @property
    def step(self) -> int:
        """The step it commits (once started, the step its save took)."""
        return self._saved.step if self._saved is not None else self._step

    @property
    def started(self) -> bool:
        return self._saved is not None

    def start(self) -> None:
        if self._saved is None:
            self.timings["began"] = time.time()
            self._saved = self._begin()

    def done(self) -> bool:
        return self._saved is not None and self._saved.done()

    def copied(self) -> None:
        if self._saved is not None:
            self._saved.copied()

    def wait(self) -> JobState:
        self.start()
        assert self._saved is not None
        state = self._saved.wait()
        self.timings.setdefault("committed", time.time())
        return state


class StoreSaver:
    """Step 1 does it all: the step is committed when ``begin`` returns."""

    def begin(self, cluster: Cluster, state: JobState, rank: int, step: int,
              tensors: Mapping[str, torch.Tensor], late: bool = False) -> Saved:
        t0 = time.perf_counter()
        new = save(cluster, state, step, dict(tensors))
        return Committed(step, new, time.perf_counter() - t0)


def default_saver(background: bool = True) -> Saver:
    """The saver a job's handle uses unless it is given one: in the
    background (the default), or in the call."""
    if background:
        return InBackground()
    return StoreSaver()
