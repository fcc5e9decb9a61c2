"""A training job's handle: its state in ptcfs in a few calls.

The handle hides the cluster connection, the coordinator and the version
bookkeeping. Every call below is collective over the job's workers (the
default process group; a process without one is a job of one rank), and
an error on any worker raises one :class:`~ptcfs.errors.WorkerError` on
every worker.

A module on a DeviceMesh (FSDP2, tensor parallelism, pipeline stages: the
spec comes from the module, :mod:`ptcfs.client.torch.dtensor_spec`)::

    job = attach("llama", model, opt, mesh)   # created, resumed or reconfigured
    data = job.data(file="tokens.npy", batch=12, seed=1)
    for step in range(job.step, steps):
        train(data.rows(step))
        if (step + 1) % 5 == 0:
            job.save(step + 1)                # copies; put, commit in the background
    job.close()                               # waits for the last save

A preset model whose mesh ptcfs picks (:mod:`ptcfs.client.torch.elastic`), the
module built for that mesh::

    job = start("gpt", "gpt:layers=2,...", tp=2, batch=12, init=init)
    model = build(job.config)                 # the configuration ptcfs chose
    job.load(model, opt)

What ``attach`` does (rank 0 decides, every rank learns the outcome):

1. every rank derives the spec and the mesh's degrees from the module, and
   tells the others its host (``PTC_HOST``): the configuration;
2. rank 0 reads the job: none → it is created from the modules' own
   values, every rank writing its own shards (:mod:`.create`); the same
   model on another mesh → ptcfs reconfigures it to this one; another
   model → refused;
3. every rank (unless the job was just created) loads its rank's state
   from the committed version and hands it to the module and optimizer.

``save(step)`` goes through a :class:`~ptcfs.client.torch.saver.Saver` and
``reconfigure(mesh, ...)`` through a :class:`~ptcfs.client.torch.mover.Mover`:
either may be swapped (a save in the call, a live move device to device)
without a change to the script. By default a save runs in the background
(:mod:`.background`): ``save`` returns at once, the copy off the device
running until the optimizer's next step (which waits for it), and the put
and the commit go on while training does. The
handle waits for a save in flight before the next save, a load, a
reconfiguration and ``close``; ``wait()`` waits for it at any other point
(before reading the committed version from outside the job, say). A save
that failed raises one :class:`~ptcfs.errors.WorkerError` of one line on
every rank at that wait, and the last committed version stays current.
``background=False`` gives the save in the call: committed when ``save``
returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import latest_record
from ptcfs.client.torch.background import InBackground
from ptcfs.client.torch.data import Data, FileRows, Rows, ViewRows
from ptcfs.client.torch.dtensor_spec import (
    Modules,
    config_of,
    mesh_rank,
    module_parameters,
    spec_from_module,
)
from ptcfs.client.torch.elastic import hosts_of_ranks
from ptcfs.client.torch.gang import gather, on_every
from ptcfs.client.torch.module import load_into, local_of, state_of
from ptcfs.client.torch.mover import Mover, default_mover
from ptcfs.client.torch.saver import Saved, Saver, default_saver
from ptcfs.client.torch.state import RankState, load_rank
from ptcfs.client.torch.stephooks import before_step, start_after_step
from ptcfs.data import Position
from ptcfs.errors import InvalidConfig, InvalidRequest
from ptcfs.jobstate import JobState
from ptcfs.sharding import rank_coords, rank_tensors
from ptcfs.types import Host, ModelSpec, ParallelConfig

__all__ = ["Attached", "Job", "connect", "same_model"]

Optimizer = torch.optim.Optimizer


@dataclass(frozen=True)
class Attached:
    """How the workers got the job's state when they attached (for logs)."""

    created: bool
    reconfigured: bool
    reconfigure_s: float  # rank 0's part: creating or reconfiguring the job
    load_s: float
    bytes_loaded: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def connect(cluster: str | Path | Cluster | None = None) -> Cluster:
    """The connection to a cluster: its file (default ``$PTC_CLUSTER``); a
    connection given passes through."""
    return cluster if isinstance(cluster, Cluster) else Cluster.load(cluster)


class Job:
    """One worker's handle on a job (made by :func:`attach` or :func:`start`)."""

    def __init__(self, cluster: Cluster, state: JobState, rank: int, host: str,
                 hosts: tuple[Host, ...], attached: Attached, *, own_cluster: bool = False,
                 saver: Saver | None = None, mover: Mover | None = None,
                 dtype: str | None = None):
        self.cluster = cluster
        self.rank = rank
        self.host = host  # this worker's, in the cluster file
        self.attached = attached
        self.saver = saver or default_saver()
        self.mover = mover or default_mover()
        self._state = state
        self._hosts = hosts
        self._own = own_cluster
        self._dtype = dtype  # the spec's dtype override, for the next meshes
        self._module: Modules | None = None
        self._optimizer: Optimizer | None = None
        self._loaded: RankState | None = None  # read at start, not handed to a module yet
        self._pending: Saved | None = None
        self._data: list[Data] = []

    # --- what the job is now ---------------------------------------------------
    @property
    def name(self) -> str:
        return self._state.job

    @property
    def state(self) -> JobState:
        """The committed version the workers run under (a save in flight not
        yet: :meth:`wait` for it)."""
        return self._state

    @property
    def step(self) -> int:
        """The committed training step (where training resumes; a save in
        flight not yet: :meth:`wait` for it)."""
        return self._state.step

    @property
    def config(self) -> ParallelConfig:
        return self._state.config

    @property
    def world(self) -> int:
        return self._state.config.world

    @property
    def data_rank(self) -> int:
        """This worker's data-parallel rank (over ``dp * fsdp``)."""
        return rank_coords(self.config)[self.rank].data_rank

    def describe(self) -> str:
        """The configuration in words: ``tp=2,pp=1,dp=1,fsdp=2 on h0:4``."""
        return self._state.describe()

    # --- load, save ------------------------------------------------------------
    def load(self, module: Modules, optimizer: Optimizer | None = None) -> None:
        """Hand this rank's committed state to ``module`` and ``optimizer``;
        later saves take their state from them."""
        self._load(module, optimizer)

    def _load(self, module: Modules, optimizer: Optimizer | None) -> int:
        self.wait()
        rs = self._loaded
        self._loaded = None
        if rs is None or rs.state.version != self._state.version:
            rs = on_every(lambda: load_rank(self.cluster, self.name, self.rank,
                                            _device_of(module), state=self._state))
        on_every(lambda: load_into(rs, module, optimizer))
        self._module, self._optimizer = module, optimizer
        return rs.nbytes

    def save(self, step: int) -> Saved:
        """Commit the module's and optimizer's state as ``step``: collective;
        returns when the saver lets training go on (see :mod:`.saver`): by
        default once the tensors are copied, the commit coming later (see
        :meth:`wait`); with ``background=False`` once the step is committed."""
        module = self._bound()
        self.wait()
        tensors = state_of(module, self._optimizer, self._state, self.rank)
        # with the optimizer known, nothing else changes the tensors before its next
        # step: the saver may copy them until then (alongside the forward and backward)
        late = self._optimizer is not None
        pending = self.saver.begin(self.cluster, self._state, self.rank, step, tensors, late)
        self._pending = pending
        if pending.done():
            self.wait()
        elif late:
            assert self._optimizer is not None
            before_step(self._optimizer, pending.copied)
        return pending

    def wait(self) -> JobState:
        """Wait for the last save to be committed and give the committed
        state: collective. A save that failed raises one
        :class:`~ptcfs.errors.WorkerError` on every rank, naming each rank
        that failed and why, in one line; the last committed version stays
        current and the next save starts afresh."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._state = pending.wait()
            for d in self._data:
                d.committed()
        return self._state

    @property
    def pending(self) -> Saved | None:
        """The save (or a live change's durable copy) not waited for yet."""
        return self._pending

    def abandon(self) -> None:
        """Give up the save in flight, on this rank alone (not collective):
        for workers whose group lost a member, who cannot wait for it
        together. The last committed version stays current."""
        self._pending = None
        if isinstance(self.saver, InBackground):
            self.saver.cancel()

    def reconfigure(self, mesh: Any, module: Modules, optimizer: Optimizer | None,
                    step: int) -> None:
        """Move the job to ``mesh`` (the same workers), its state into
        ``module`` and ``optimizer``, parallelized on it. ``step``: the step
        the module bound now is at; saved first when the job is behind it."""
        old = self._bound()
        spec, degrees = spec_from_module(module, mesh, optimizer=optimizer, dtype=self._dtype)
        same_model(self._state, spec, degrees["tp"])
        self._hosts = hosts_of_ranks([str(n) for n in gather(self.host)])  # the world now
        cfg = config_of(degrees, self._hosts)
        if step != self.wait().step:
            self.save(step)
            self.wait()
        st = self._state
        held = RankState(st, self.rank, state_of(old, self._optimizer, st, self.rank),
                         {s.name: sl for s, sl in rank_tensors(st.model_spec(), st.config,
                                                               self.rank)}, st.step)
        rank = mesh_rank(mesh)
        rs = self.mover.move(self.cluster, held, cfg, rank)
        on_every(lambda: load_into(rs, module, optimizer))
        self._state, self.rank = rs.state, rank
        self._module, self._optimizer = module, optimizer
        if rs.commit is not None:  # the durable copy, after the first step (see .mover)
            self._pending = rs.commit
            if optimizer is None or any(d.reads_commits for d in self._data):
                self.wait()  # nothing to start it, or a view that reads the committed layout
            else:
                start_after_step(optimizer, rs.commit)
            return
        for d in self._data:
            d.committed()

    # --- the dataset -----------------------------------------------------------
    def data(self, *, view: str | Path | None = None, file: str | Path | None = None,
             batch: int, seed: int = 0) -> Data:
        """This worker's samples of each step (:mod:`.data`): ``view``, a
        ``/ptc`` mount (``{host}`` becomes ``PTC_HOST``) whose
        ``<job>/data/`` holds the ingested dataset, or ``file``, a token
        ``.npy`` read in the same order; ``batch``: the global batch."""
        if (view is None) == (file is None):
            raise InvalidRequest("give the dataset as view= (a /ptc mount) or file= (a .npy)")
        source: Rows
        if view is not None:
            mount = Path(str(view).replace("{host}", self.host))
            source = ViewRows(mount / self.name / "data", batch)
        else:
            source = FileRows(str(file), batch, seed)
        d = Data(source, lambda: (self.config.data_parallel, self.data_rank))
        self._data.append(d)
        return d

    def position(self) -> Position | None:
        """The dataset's committed read position (None: the job has no dataset)."""
        rec = latest_record(self.cluster, self.name)
        return rec.position if rec is not None else None

    # --- the end -----------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight (raising its failure, as :meth:`wait`
        does), then close the connection if the handle opened it. Leaving a
        ``with`` block does the same; leaving it by an exception only closes
        the connection (the other ranks may not be there to wait with), and
        a save still in flight then may not be committed."""
        try:
            self.wait()
        finally:
            if self._own:
                self.cluster.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._own:
            self.cluster.close()

    def _bound(self) -> Modules:
        if self._module is None:
            raise InvalidRequest(f"job {self.name!r}: load a module into it first "
                                 "(job.load(model, optimizer))")
        return self._module


def _device_of(module: Modules) -> torch.device:
    p = next(iter(module_parameters(module).values()), None)
    return local_of(p).device if p is not None else torch.device("cpu")


def same_model(st: JobState, spec: ModelSpec, tp: int) -> None:
    """Refuse a module of another model than the job's. Without tensor
    parallelism a module cannot tell how its tensors would split: then
    names, shapes and dtypes must agree, and the job's split rules stay."""
    def key(m: ModelSpec) -> list[Any]:
        return list(m.tensors) if tp > 1 else [(t.name, t.shape, t.dtype) for t in m.tensors]

    held = st.model_spec()
    if key(held) == key(spec):
        return
    if [(t.name, t.shape, t.dtype) for t in held.tensors] == \
            [(t.name, t.shape, t.dtype) for t in spec.tensors]:
        raise InvalidConfig(f"job {st.job!r} splits its tensors for tensor parallelism "
                            "otherwise than this module; apply the same tensor-parallel plan "
                            "on every mesh (a tp dimension of 1 included)")
    raise InvalidConfig(f"job {st.job!r} holds another model than this module "
                        f"({st.model}); attach it to another job")
