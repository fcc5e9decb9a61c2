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
   when the old group lost a worker with a save in flight (``dropped``),
   rank 0 first drops the save that group left open (its dead worker's part
   will never come), then every rank begins a background save of its
   module's state under the new configuration, at the step ``steps()``
   says, which rank 0 commits with that configuration
   (:mod:`~ptcfs.client.torch.background`). Training goes on meanwhile;
4. the handle waits for it where it waits for any background save (the
   next ``save``, ``wait`` or ``close``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.saving import open_save
from ptcfs.client.torch.dtensor_spec import Modules, config_of, mesh_rank, spec_from_module
from ptcfs.client.torch.elastic import hosts_of_ranks
from ptcfs.client.torch.gang import gather, on_rank0
from ptcfs.client.torch.job import Attached, Job, _same_model
from ptcfs.client.torch.module import state_of
from ptcfs.client.torch.saver import DeferredCommit, Saved, Saver, default_saver
from ptcfs.errors import JobNotFound
from ptcfs.jobstate import JobState

__all__ = ["adopt"]


def adopt(known: JobState | None, module: Modules, optimizer: torch.optim.Optimizer | None,
          mesh: Any, steps: Callable[[], int], *, cluster: Cluster, host: str,
          saver: Saver | None = None, dropped: bool = False) -> Job:
    """Steps 1 and 2 of the module docstring. ``known``: the job's committed
    version as this worker knows it (None: it joined); ``steps()``: the step
    the module is at (read when the commit starts); ``host``: this worker's
    host in the cluster file; ``saver``: the handle's saver (default: in the
    background)."""
    spec, degrees = spec_from_module(module, mesh, optimizer=optimizer)
    said = gather((host, known))
    committed = next((st for _, st in said if st is not None), None)
    if committed is None:
        raise JobNotFound("no worker of the new group knows the job's committed version")
    _same_model(committed, spec, degrees["tp"])
    hosts = hosts_of_ranks([str(h) for h, _ in said])
    cfg = config_of(degrees, hosts)
    rank = mesh_rank(mesh)
    step = steps()
    h = Job(cluster, committed.with_(config=cfg, step=step), rank, host, hosts,
            Attached(False, True, 0.0, 0.0, 0), saver=saver or default_saver())
    h._module, h._optimizer = module, optimizer

    def begin() -> Saved:
        if dropped:
            on_rank0(lambda: _drop_open_save(cluster, committed.job))
        now = steps()
        st = h._state
        return h.saver.begin(cluster, st, h.rank, now, state_of(module, optimizer, st, h.rank))

    h._pending = DeferredCommit(step + 1, begin)
    return h


def _drop_open_save(cluster: Cluster, job: str) -> None:
    """Abort the save left open on every host, if there is one."""
    version = open_save(Coordinator(cluster), job)
    if version is not None:
        cluster.call_hosts(cluster.hosts, "abort", quiet=True, job=job, version=version)
