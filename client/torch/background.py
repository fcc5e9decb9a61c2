"""Saves that do not stall training: copy off the device, then put and commit
in the background.

Call order of a rank (every rank of the job makes one :class:`BackgroundSaver`
and calls :meth:`~BackgroundSaver.save` at the same steps)::

    saver = BackgroundSaver(cluster, rank)
    ...
    saver.save(state, step, tensors)   # returns once the tensors are copied
    ...                                # training goes on while they are stored
    saver.close()                      # at the end: waits for the last save

1. :meth:`~BackgroundSaver.save` first waits for this rank's previous save
   (and raises :class:`~ptcfs.errors.SaveFailed` if it failed), then copies
   the rank's sub-tensors into staging buffers: pinned host memory for CUDA
   tensors (a non-blocking copy on a side stream, waited for by the
   background thread, not by the caller; the training stream's next kernels
   wait for it on the device), a CPU copy for CPU tensors. The buffers are
   kept and reused from save to save. Then it returns.
   With ``late=True`` the CPU copy runs in the background thread too, and
   the caller calls :meth:`~BackgroundSaver.copied` before it changes the
   tensors: the training face does so in a hook before the optimizer's next
   step, the only thing that changes them, so the copy runs alongside the
   next forward and backward (the way DeepSpeed's decoupled checkpointing
   overlaps it) and the loop waits only if the copy is not done by then.
2. A background thread opens the save (any rank; idempotent; a rank that
   owns no sub-tensor, a data-parallel replica, opens nothing once the step
   is committed: it may come after rank 0's commit), puts the rank's owned
   sub-tensors into it on the rank's host, and then
   - rank 0 commits the step, trying again while other ranks' puts are
     missing (:class:`~ptcfs.client.control.saving.IncompleteSave`), up to
     ``timeout_s``;
   - every other rank waits until the job's committed step reaches the
     step, so that its next save cannot put into this one's version.
3. A failure leaves the last committed version current; it is raised at
   the next call of any method. :meth:`~BackgroundSaver.close` waits for the
   last save (and raises its failure). :meth:`~BackgroundSaver.cancel`
   gives a save up (a live job whose group lost a worker: its part will
   never come): the thread stops at its next wait, rank 0 dropping the
   version it opened, and the failure is forgotten.

The version is committed under ``state``'s configuration, which may be
another than the committed one (a live change's durable copy).

:class:`InBackground` is the :class:`~ptcfs.client.torch.saver.Saver` the
training face uses by default (``attach(...)``; ``background=False`` saves
in the call): ``job.save(step)`` returns once the tensors are copied, and
the face waits on the save (every rank together) before its next save,
load, reconfiguration or close, or when ``job.wait()`` asks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.saving import IncompleteSave, begin_save, commit_step, join_save
from ptcfs.client.torch.gang import on_every, on_rank0
from ptcfs.client.torch.state import new_tensor, put_rank
from ptcfs.errors import InvalidRequest, PtcError, SaveFailed, VersionNotFound
from ptcfs.jobstate import JobState
from ptcfs.sharding import owned_tensors

__all__ = ["BackgroundSaver", "InBackground", "Pending"]


class BackgroundSaver:
    """One rank's saves, each stored in the background (module docstring)."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float = 300.0):
        self.cluster = cluster
        self.rank = rank
        self.timeout_s = timeout_s
        self._coord = Coordinator(cluster)
        self._staging: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._stream: torch.cuda.Stream | None = None
        #: set while no save in flight still has to copy its tensors
        self._copied = threading.Event()
        self._copied.set()
        self._cancel = threading.Event()
        #: (model, dtype, optimizer, layout) -> whether this rank owns a sub-tensor there
        self._owned: dict[tuple[object, ...], bool] = {}
        #: the last committed state this rank's saves produced (rank 0's commit)
        self.committed: JobState | None = None

    # --- the caller's side --------------------------------------------------------
    def save(self, state: JobState, step: int, tensors: Mapping[str, torch.Tensor],
             late: bool = False) -> None:
        """Copy ``tensors`` (the rank's sub-tensors under ``state``'s
        configuration) off the device and store them as ``step`` in the
        background. ``late``: CPU tensors are copied in the background too;
        the caller calls :meth:`copied` before it changes them."""
        self.wait()
        self._cancel.clear()
        later: Mapping[str, torch.Tensor] | None = None
        staged: dict[str, torch.Tensor] = {}
        ready = None
        if late and not any(t.is_cuda for t in tensors.values()):
            later = tensors
            self._copied.clear()
        else:
            staged, ready = self._stage(tensors)
        self._thread = threading.Thread(target=self._run,
                                        args=(state, step, staged, ready, later),
                                        name=f"ptcfs-save-r{self.rank}", daemon=True)
        self._thread.start()

    def copied(self) -> None:
        """Wait until the save in flight has copied the tensors (at once
        unless it was made with ``late=True``); its failure is raised later,
        at :meth:`wait`."""
        self._copied.wait()

    def wait(self) -> None:
        """Wait for the save in flight; SaveFailed if it (or an earlier one) failed."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        failed, self._failed = self._failed, None
        if failed is not None:
            why = " ".join(f"{type(failed).__name__}: {failed}".split())  # one line
            raise SaveFailed(f"a background save of rank {self.rank} failed, the last "
                             f"committed version stays current: {why}") from failed

    def cancel(self) -> None:
        """Give the save in flight up and wait for its thread (a put under
        way ends first); its failure is not raised."""
        self._cancel.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
        self._failed = None

    def close(self) -> None:
        """Wait for the last save (raising its failure)."""
        self.wait()
        self._staging.clear()

    def __enter__(self) -> BackgroundSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stage(self, tensors: Mapping[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        """Each tensor copied into its kept staging buffer (pinned for CUDA)."""
        out: dict[str, torch.Tensor] = {}
        cuda = any(t.is_cuda for t in tensors.values())
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream()
        if cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream())
        for name, t in tensors.items():
            t = t.detach()
            buf = self._staging.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                # pinned for a copy from CUDA; else huge pages where big: fewer TLB misses
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) \
                    if t.is_cuda else new_tensor(tuple(t.shape), t.dtype, torch.device("cpu"))
                self._staging[name] = buf
            if t.is_cuda:
                assert self._stream is not None
                with torch.cuda.stream(self._stream):
                    buf.copy_(t, non_blocking=True)
                    t.record_stream(self._stream)
            else:
                buf.copy_(t)
            out[name] = buf
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(self._stream)
            # the training stream's next kernels (the optimizer step's in-place updates)
            # run after the copies have read the tensors: ordered on the device, the
            # caller does not wait
            torch.cuda.current_stream().wait_event(ready)
        return out, ready

    # --- the background thread ------------------------------------------------------
    def _run(self, state: JobState, step: int, staged: dict[str, torch.Tensor],
             ready: torch.cuda.Event | None, later: Mapping[str, torch.Tensor] | None) -> None:
        version: int | None = None
        try:
            if later is not None:
                try:
                    staged, _ = self._stage(later)
                finally:
                    self._copied.set()
            if ready is not None:
                ready.synchronize()
            if self._owns(state):
                version = begin_save(self._coord, state.job)
            else:  # a replica: it may come after rank 0 committed this step
                version = join_save(self._coord, state.job, step)
                if version is None:
                    return
            try:
                put_rank(self.cluster, state, version, self.rank, staged, owned=True,
                         progress=False)
            except VersionNotFound:
                if self.rank == 0:
                    raise
                raise InvalidRequest(self._dropped(state.job, step)) from None
            if self.rank == 0:
                self.committed = self._commit(state, step)
            else:
                self._until_committed(state.job, step, version, state.config.hosts[0].name)
        except BaseException as e:  # noqa: BLE001 - reported at the next call
            self._failed = e
            if self.rank == 0 and version is not None:
                # the save cannot commit: drop it, so the other ranks stop waiting for it
                self.cluster.call_hosts(self.cluster.hosts, "abort", quiet=True,
                                        job=state.job, version=version)

    def _owns(self, state: JobState) -> bool:
        """Whether this rank owns a sub-tensor under ``state``'s layout (a
        data-parallel replica owns none), kept per layout."""
        key = (state.spec or state.model, state.dtype, state.optimizer, state.config)
        if key not in self._owned:
            self._owned[key] = bool(owned_tensors(state.model_spec(), state.config, self.rank))
        return self._owned[key]

    def _commit(self, state: JobState, step: int) -> JobState:
        deadline = time.monotonic() + self.timeout_s
        pause = 0.002
        while True:
            try:
                return commit_step(self._coord, state.job, step, config=state.config)
            except IncompleteSave:
                if time.monotonic() + pause > deadline:
                    raise
            self._pause(pause)
            pause = min(pause * 2, 0.1)

    def _until_committed(self, job: str, step: int, version: int, host: str) -> None:
        """Until rank 0 has committed ``step``; InvalidRequest at once when
        the save (``version``, opened on ``host``) is gone there (rank 0
        failed and dropped it)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.002
        while True:
            dropped = False
            try:
                if self._coord.state(job).step >= step:
                    return
                dropped = all(v["version"] != version
                              for v in self.cluster.client(host).call("versions", job=job))
            except PtcError:
                pass
            if dropped:
                raise InvalidRequest(self._dropped(job, step))
            if time.monotonic() + pause > deadline:
                raise InvalidRequest(f"step {step} of job {job!r} was not committed within "
                                     f"{self.timeout_s:.0f} s (rank 0 commits it)")
            self._pause(pause)
            pause = min(pause * 2, 0.1)

    @staticmethod
    def _dropped(job: str, step: int) -> str:
        """Why a rank's save failed when rank 0 dropped it (before or while
        the rank put its part)."""
        return (f"step {step} of job {job!r} was not committed: its save was dropped "
                "(rank 0's part failed; rank 0 says why)")

    def _pause(self, seconds: float) -> None:
        if self._cancel.wait(seconds):
            raise SaveFailed("the save was given up (cancel)")


class Pending:
    """A save in the background (a :class:`~ptcfs.client.torch.saver.Saved`).

    ``done()`` is False until ``wait()`` has returned, on every rank alike
    (whether the thread has finished differs from rank to rank, and the face
    waits collectively when a save is done)."""

    def __init__(self, saver: BackgroundSaver, step: int):
        self.saver = saver
        self._step = step
        self._state: JobState | None = None

    @property
    def step(self) -> int:
        return self._step

    def done(self) -> bool:
        return self._state is not None

    def copied(self) -> None:
        """This rank's tensors are copied: training may change them."""
        self.saver.copied()

    def wait(self) -> JobState:
        """Collective: every rank's part stored and the step committed; a
        failure on any rank raises one WorkerError on every rank."""
        if self._state is None:
            on_every(self.saver.wait)
            state = on_rank0(lambda: self.saver.committed)
            if state is None or state.step != self._step:
                raise InvalidRequest(f"step {self._step} was not committed by rank 0")
            self._state = state
        return self._state


class InBackground:
    """The face's saver that stores in the background: one
    :class:`BackgroundSaver` per rank, its staging buffers kept from save
    to save (made again when the rank or the connection changes)."""

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self._saver: BackgroundSaver | None = None

    def begin(self, cluster: Cluster, state: JobState, rank: int, step: int,
              tensors: Mapping[str, torch.Tensor], late: bool = False) -> Pending:
        s = self._saver
        if s is None or s.cluster is not cluster or s.rank != rank:
            if s is not None:
                s.close()
            s = self._saver = BackgroundSaver(cluster, rank, self.timeout_s)
        s.save(state, step, tensors, late)
        return Pending(s, step)

    def cancel(self) -> None:
        """Give this rank's save in flight up (:meth:`BackgroundSaver.cancel`)."""
        if self._saver is not None:
            self._saver.cancel()

    def end(self) -> SaveFailed | None:
        """Wait for this rank's save in flight on this rank alone (not
        collective: a live job's old group, whose save goes on after a
        change), then drop the staging buffers; its failure is returned, not
        raised."""
        s, self._saver = self._saver, None
        if s is None:
            return None
        try:
            s.close()
        except SaveFailed as e:
            return e
        return None
