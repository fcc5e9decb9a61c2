"""A live job's durable copy: its state in ptcfs's stores, behind the workers.

A launcher-driven live job (``python -m ptcfs.client.live --job NAME``)
is a ptcfs job: each worker keeps a :class:`Durable`, its handle on the
job (the training face's :class:`~ptcfs.client.torch.job.Job`), and the
stores follow every change in the background. Nothing of it is on the path
from a change's decision to the first step after it.

Call order (the worker, :mod:`ptcfs.client.live.worker`, makes these calls;
each is collective over the group named, unless said otherwise):

1. :meth:`Durable.attach` (the first generation, once its module is built):
   the job is created from the module's values when the stores do not have
   it, else resumed from its committed version (reconfigured on the
   daemons to this mesh first if it was saved on another):
   :func:`~ptcfs.client.torch.entry.attach`. The step the job resumes at;
2. :meth:`Durable.before_change` (every worker of the old generation, at a
   change, before the group is re-formed; on each worker alone): nothing
   waits. When the old group is whole (a planned change) a save in flight
   goes on in its thread against its own version and configuration (the
   old module's tensors, which nothing changes any more, are what it
   copies), and the next commit waits for it (step 4); a change's commit
   that had not begun is superseded by this change's. When the group is not
   whole (a lost worker: its part of the save will never come) the save is
   given up. A failed save is reported, not raised: the last committed
   version stays current, and the next commit goes on;
3. :meth:`Durable.after_change` (every worker of the new generation, after
   the move and the rebuild): the handle follows the new mesh
   (:func:`~ptcfs.client.torch.adopt.adopt`, no daemon reached), its
   pending save a :class:`~ptcfs.client.torch.saver.DeferredCommit`. A
   worker that leaves ends its part of the save in flight, then exits
   (:meth:`Durable.leave`);
4. :meth:`Durable.after_step` (every worker, after each step): starts that
   commit after the first step on the new mesh: every worker ends its part
   of the old group's save still in flight, if there is one (each alone,
   then one gather, so that a worker that joined begins nothing before
   that save has ended); every rank copies its state off the device in a
   thread (alongside the next forward and backward: the optimizer's next
   step waits for the copy) and puts it; rank 0 commits it as the job's
   next version, with the new configuration
   (:mod:`~ptcfs.client.torch.background`);
5. :meth:`Durable.save` (every worker, when the script saves): a background
   save of the step to the same job, as the face's ``job.save``;
6. :meth:`Durable.close` (every worker of the last generation): waits for
   the save in flight and saves the last step if it is not committed, so
   the stores hold what the workers held when they stopped.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ptcfs import settings
from ptcfs.client.torch.adopt import adopt
from ptcfs.client.torch.background import InBackground
from ptcfs.client.torch.entry import attach
from ptcfs.client.torch.job import Job, connect
from ptcfs.client.torch.saver import DeferredCommit
from ptcfs.errors import PtcError

__all__ = ["Durable"]


class Durable:
    """One worker's side of a live job's durable copy (module docstring)."""

    def __init__(self, job: str, name: str, cluster: str | None = None,
                 host: str | None = None) -> None:
        self.name, self.worker = job, name
        self.cluster = connect(cluster)
        self.host = str(settings.get("PTC_HOST", host) or self.cluster.hosts[0])
        self.saver = InBackground()
        self.job: Job | None = None
        self._dropped = False
        #: the savers of old groups whose save was in flight at a change (step 2)
        self._behind: list[InBackground] = []

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               mesh: Any) -> int:
        """Step 1: the step the job is at (0 when it was created now)."""
        self.job = attach(self.name, module, optimizer, mesh, cluster=self.cluster,
                          host=self.host, saver=self.saver)
        return self.job.step

    def before_change(self, whole: bool) -> None:
        """Step 2; ``whole``: the old group can still run a collective."""
        if self.job is None:
            return
        pending = self.job.pending
        if not whole:
            if pending is not None and not pending.done():
                print(f"worker {self.worker}: the group lost a worker; the save of step "
                      f"{pending.step} is given up unless it has committed already",
                      file=sys.stderr, flush=True)
            self.job.abandon()
            for old in self._behind:
                old.cancel()
            self._behind.clear()
            self._dropped = True
            return
        if pending is None or (isinstance(pending, DeferredCommit) and not pending.started):
            return  # nothing in flight; a change's commit not begun is superseded
        self._behind.append(self.saver)
        self.saver = InBackground(self.saver.timeout_s)

    def after_change(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     mesh: Any, step: int) -> None:
        """Step 3, at ``step`` (the step the new group goes on from)."""
        known = self.job.state if self.job is not None else None
        self._step = step
        self.job = adopt(known, module, optimizer, mesh, lambda: self._step, cluster=self.cluster,
                         host=self.host, saver=self.saver, dropped=self._dropped,
                         behind=self._end_behind if self._behind else None)
        self._dropped = False

    _step = 0  # the step the worker is at, for the commit (after_step keeps it)

    def after_step(self, step: int) -> DeferredCommit | None:
        """Step 4: the commit started now, if one was."""
        self._step = step
        pending = self.job.pending if self.job is not None else None
        if isinstance(pending, DeferredCommit) and not pending.started:
            pending.start()
            return pending
        return None

    def save(self, step: int) -> None:
        """Step 5: ``step`` in the background (a failed earlier save is
        reported); nothing when the step is being committed already (a
        change's copy); a change's copy not begun yet begins now, with this
        step."""
        pending = self.job.pending if self.job is not None else None
        if self.job is None or (pending is not None and pending.step == step):
            return
        if isinstance(pending, DeferredCommit) and not pending.started:
            self._step = step  # a change's copy not begun yet: it commits this step
            pending.start()
            return
        try:
            self.job.save(step)
        except PtcError as e:
            self._report(e)

    def close(self, step: int) -> None:
        """Step 6: ``step`` committed when this returns (a failure raises)."""
        if self.job is None:
            return
        self._end_behind()
        try:
            if self.job.wait().step < step:
                self.job.save(step)
            self.job.close()
        finally:
            self.cluster.close()

    def leave(self) -> None:
        """A worker that left the job (not collective): its part of the save
        in flight ended (put, and committed when it was the old group's
        rank 0), then its connection closed."""
        self._end_behind()
        self.job = None
        self.cluster.close()

    def _end_behind(self) -> bool:
        """This worker's part of the old groups' saves in flight, ended (each
        worker alone; step 4): True when one failed (it may be left open)."""
        failed = False
        for old in self._behind:
            e = old.end()
            if e is not None:
                self._report(e)
                failed = True
        self._behind.clear()
        return failed

    def _report(self, e: PtcError) -> None:
        print(f"worker {self.worker}: the job's durable copy failed, its last committed "
              f"version stays current: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
