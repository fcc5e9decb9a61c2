"""What the mount asks of the cluster for ``/ptc/<job>/dcp/`` and
``/ptc/<job>/hf-save/``: commit a save written by ``dcp.save``
(:mod:`ptcfs.fuse.dcpwrite`) or ``save_pretrained``
(:mod:`ptcfs.fuse.hfwrite`), and delete the versions of a step whose
folder was removed.

The mount acts here as ``ptcctl`` would, through a
:class:`~ptcfs.client.control.coordinator.Coordinator` made at the first
use (with the mount's keys): the commit is the client's two-phase commit
(:func:`~ptcfs.client.control.saving.commit_step`), under the job's lock.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

from ptcfs.dcp.layout import Saved
from ptcfs.errors import PtcError
from ptcfs.server.net.cluster import ClusterSpec

__all__ = ["MountSaver"]


class MountSaver:
    """Commits and step removals for one host's mount."""

    def __init__(self, spec: ClusterSpec, host_id: str):
        self.spec = spec
        self.host_id = host_id
        self._coord: Any = None
        self._lock = threading.Lock()

    def _coordinator(self) -> Any:
        from ptcfs.client.control.conn import Cluster
        from ptcfs.client.control.coordinator import Coordinator

        with self._lock:
            if self._coord is None:
                self._coord = Coordinator(Cluster(self.spec, caller=f"{self.host_id}-mount"))
            return self._coord

    def commit(self, job: str, step: int, saved: Saved | None, uid: int,
               spec: str | None = None) -> None:
        """The job's open save (the mount put its sub-tensors) committed at
        ``step``, with what a ``dcp.save`` kept besides them (``saved``) or
        the spec a ``save_pretrained`` recorded (``spec``)."""
        from ptcfs.client.control.saving import commit_step

        commit_step(self._coordinator(), job, step,
                    dcp=saved.encode() if saved is not None else None, spec_text=spec)

    def drop(self, job: str, step: int) -> None:
        """Delete ``job``'s committed versions of ``step`` on every host;
        EBUSY where one is the current version or open on a mount."""
        coord = self._coordinator()
        answers, _ = coord.cluster.call_all("versions", job=job)
        committed: dict[int, int] = {}
        read: set[int] = set()
        for vs in answers.values():
            for v in vs:
                if v["state"] == "committed":
                    committed[v["version"]] = int(v["meta"].get("step", 0))
                    if v.get("readers"):
                        read.add(v["version"])
        mine = [v for v, s in committed.items() if s == step]
        current = max(committed, default=-1)
        if current in mine:
            raise OSError(errno.EBUSY, f"step {step} of job {job!r} is its current version "
                          f"(version {current}); it stays")
        if read & set(mine):
            raise OSError(errno.EBUSY, f"step {step} of job {job!r} is open on a mount; "
                          "remove it once its readers close")
        for h, vs in answers.items():
            for v in vs:
                if v["version"] in mine:
                    try:
                        coord.cluster.client(h).call("delete_version", job=job,
                                                     version=v["version"])
                    except PtcError:
                        continue  # pruned with the next versions

    def close(self) -> None:
        with self._lock:
            if self._coord is not None:
                self._coord.cluster.close()
                self._coord = None
