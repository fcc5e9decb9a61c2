"""A job whose workers changed their mesh themselves: the handle follows.

A live launcher's workers (:mod:`ptcfs.client.live`) move their state
device to device when the job's membership changes, and rebuild their
module on the new mesh, without the stores. :func:`adopt` then gives every
worker of the new group a :class:`~ptcfs.client.torch.job.Job` on that
mesh, so that the stores follow in the background: the durable copy of the
change is a :class:`~ptcfs.client.torch.saver.DeferredCommit` (the one the
training face's live mover uses) that saves the new layout.

The call order (every worker of the new group, collective over the default
process group, after the move and the rebuild; nothing here reaches a
daemon):

1. every rank derives the spec and the mesh's degrees from the module (as
   :func:`~ptcfs.client.torch.job.attach` does) and tells the others its
   host and the job's committed version as it knows it (a worker that
   joined knows none): the new configuration, and the job;
2. every rank makes a handle on the job at the new configuration and the
   step its module is at, not committed yet; its pending save is the
   deferred commit;
3. the caller starts the commit after the first optimizer step on the new
   mesh (every rank at once: :meth:`~ptcfs.client.torch.saver.DeferredCommit.start`):
   when the old group left a save in flight at the change (a planned
   change does not wait for it), every rank that took part in it first
   ends its part (``behind()``, on each rank alone: the old save is
   committed under its own configuration, or failed), and the ranks tell
   each other how it went (one gather: a worker that joined begins nothing
   before the old save has ended, so no rank puts into the old version);
   when the old group lost a worker with a save in flight (``dropped``), or
   an old save may have been left open, rank 0 drops the save left open
   (its missing parts will never come), as ``ptcctl discard`` does
   (:func:`~ptcfs.client.control.saving.discard_save`: under the job's
   lock, a save whose commit was decided rolled forward). Then every rank begins a
   background save of its module's state under the new configuration, at
   the step ``steps()`` says, which rank 0 commits with that configuration
   (:mod:`~ptcfs.client.torch.background`); its copy off the device runs in
   the save's thread alongside the next forward and backward, the
   optimizer's next step waiting for it (``late``, as the face's
   ``job.save`` does). Training goes on meanwhile;
4. the handle waits for it where it waits for any background save (the
   next ``save``, ``wait`` or ``close``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.saving import discard_save
from ptcfs.client.torch.dtensor_spec import Modules, config_of, mesh_rank, spec_from_module
from ptcfs.client.torch.elastic import hosts_of_ranks
from ptcfs.client.torch.gang import gather, on_rank0
from ptcfs.client.torch.job import Attached, Job, same_model
from ptcfs.client.torch.module import state_of
from ptcfs.client.torch.saver import DeferredCommit, Saved, Saver, default_saver
from ptcfs.client.torch.stephooks import before_step
from ptcfs.errors import JobNotFound
from ptcfs.jobstate import JobState

__all__ = ["adopt"]


def adopt(known: JobState | None, module: Modules, optimizer: torch.optim.Optimizer | None,
          mesh: Any, steps: Callable[[], int], *, cluster: Cluster, host: str,
          saver: Saver | None = None, dropped: bool = False,
          behind: Callable[[], bool] | None = None) -> Job:
    """Steps 1 and 2 of the module docstring. ``known``: the job's committed
    version as this worker knows it (None: it joined); ``steps()``: the step
    the module is at (read when the commit starts); ``host``: this worker's
    host in the cluster file; ``saver``: the handle's saver (default: in the
    background); ``behind``: ends this rank's part of a save the old group
    left in flight, True when that save failed (step 3)."""
    spec, degrees = spec_from_module(module, mesh, optimizer=optimizer)
    said = gather((host, known, behind is not None))
    committed = next((st for _, st, _ in said if st is not None), None)
    waits = any(b for _, _, b in said)  # the same on every rank: step 3 gathers or not
    if committed is None:
        raise JobNotFound("no worker of the new group knows the job's committed version")
    same_model(committed, spec, degrees["tp"])
    hosts = hosts_of_ranks([str(h) for h, _, _ in said])
    cfg = config_of(degrees, hosts)
    rank = mesh_rank(mesh)
    step = steps()
    h = Job(cluster, committed.with_(config=cfg, step=step), rank, host, hosts,
            Attached(False, True, 0.0, 0.0, 0), saver=saver or default_saver())
    h._module, h._optimizer = module, optimizer

    def begin() -> Saved:
        left_open = waits and any(gather(behind() if behind is not None else False))
        if dropped or left_open:
            on_rank0(lambda: discard_save(Coordinator(cluster), committed.job))
        now = steps()
        st = h._state
        late = optimizer is not None
        saved = h.saver.begin(cluster, st, h.rank, now,
                              state_of(module, optimizer, st, h.rank), late)
        if late and not saved.done():
            assert optimizer is not None
            before_step(optimizer, saved.copied)
        return saved

    h._pending = DeferredCommit(step + 1, begin)
    return h
