"""Attaching a training script's workers to a job: :func:`attach` for a
module on a DeviceMesh, :func:`start` for a preset model whose mesh ptcfs
picks (the calls and their order: :mod:`ptcfs.client.torch.job`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ptcfs import settings
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.create import create_from_ranks
from ptcfs.client.torch.dtensor_spec import (
    Modules,
    config_of,
    mesh_rank,
    optimizer_name,
    spec_from_module,
)
from ptcfs.client.torch.elastic import Init, hosts_of_ranks, resume
from ptcfs.client.torch.gang import gather, on_rank0, rank_world
from ptcfs.client.torch.job import Attached, Job, connect, same_model
from ptcfs.client.torch.module import state_of
from ptcfs.client.torch.mover import Mover
from ptcfs.client.torch.saver import Saver, default_saver
from ptcfs.errors import InvalidConfig, JobNotFound
from ptcfs.jobstate import JobState
from ptcfs.model.specfile import encode_spec
from ptcfs.suggest.device import Device

__all__ = ["attach", "start"]

Optimizer = torch.optim.Optimizer


def _saver(saver: Saver | None, background: bool) -> Saver:
    """The saver given, else the default one ``background`` picks."""
    return saver if saver is not None else default_saver(background)


def _host(cluster: Cluster, host: str | None, world: int) -> str:
    me = settings.get("PTC_HOST", host)
    if me:
        return str(me)
    if world == 1:
        return cluster.hosts[0]
    raise InvalidConfig("set PTC_HOST to this worker's host name in the cluster file")


def attach(job: str, module: Modules, optimizer: Optimizer | None = None, mesh: Any = None, *,
           cluster: str | Path | Cluster | None = None, host: str | None = None,
           dtype: str | None = None, saver: Saver | None = None,
           mover: Mover | None = None, background: bool = True) -> Job:
    """Attach ``module`` (parallelized on ``mesh``; None: a plain module on
    one process) and ``optimizer`` (Adam, AdamW or None) to ``job``,
    collectively (see the module docstring): created from the module's
    values, resumed, or reconfigured to this mesh, then loaded. ``host``:
    this worker's host (default ``$PTC_HOST``; one process alone: the
    cluster's first); ``dtype``: the job's dtype when not the module's
    (``"bf16"`` keeps fp32 masters of an fp32 module); ``background`` (the
    default): ``save`` returns once the tensors are copied, stored and
    committed in the background
    (:class:`~ptcfs.client.torch.background.InBackground`; ``job.wait()``
    waits for the commit), False: committed when ``save`` returns
    (:class:`~ptcfs.client.torch.saver.StoreSaver`); ``saver``: another
    :class:`~ptcfs.client.torch.saver.Saver`, in place of either."""
    saver = _saver(saver, background)
    conn = connect(cluster)
    own = conn is not cluster
    try:
        rank, world = rank_world()
        if mesh is None and world > 1:
            raise InvalidConfig("pass the DeviceMesh the module was parallelized on "
                                f"(the job has {world} workers)")
        spec, degrees = spec_from_module(module, mesh, optimizer=optimizer, dtype=dtype)
        me = _host(conn, host, world)
        hosts = hosts_of_ranks([str(n) for n in gather(me)])
        cfg = config_of(degrees, hosts)
        rank = mesh_rank(mesh)
        new = JobState(job, 1, f"module:{spec.name}", dtype or spec.tensors[0].dtype,
                       optimizer_name(optimizer), cfg, 0, conn.replicas, tuple(conn.hosts),
                       encode_spec(spec))
        t0 = time.perf_counter()

        def decide() -> tuple[str, JobState]:
            coord = Coordinator(conn)
            try:
                st = coord.state(job)
            except JobNotFound:
                return "created", new
            same_model(st, spec, degrees["tp"])
            if st.config == cfg:
                return "resumed", st
            return "reconfigured", coord.reconfigure(job, cfg).new

        what, st = on_rank0(decide)
        if what == "created":
            st = create_from_ranks(conn, st, rank, state_of(module, optimizer, st, rank))
        decided = time.perf_counter() - t0
        h = Job(conn, st, rank, me, hosts, Attached(what == "created", what == "reconfigured",
                                                    decided, 0.0, 0), own_cluster=own,
                saver=saver, mover=mover, dtype=dtype)
        h._module, h._optimizer = module, optimizer
        if what != "created":
            t0 = time.perf_counter()
            nbytes = h._load(module, optimizer)
            h.attached = Attached(False, what == "reconfigured", decided,
                                  time.perf_counter() - t0, nbytes)
        return h
    except BaseException:
        if own:
            conn.close()
        raise


def start(job: str, model: str, *, init: Init | None = None, tp: int = 1, pp: int = 1,
          batch: int | None = None, dtype: str = "fp32", optimizer: str = "adam",
          policy: str = "fastest-that-fits", gpu: Device | str = "h100-sxm",
          seq: int | None = None, degrees: tuple[str, ...] = ("tp", "pp", "dp"), vpp: int = 1,
          cp_shard: int | None = None, cluster: str | Path | Cluster | None = None,
          host: str | None = None,
          device: torch.device | str | None = None, saver: Saver | None = None,
          mover: Mover | None = None, background: bool = True) -> Job:
    """Start the workers of a job of the preset ``model`` on the mesh
    ``policy`` picks for them (:func:`ptcfs.client.torch.elastic.resume`:
    created from ``init`` when new, else resumed or reconfigured), its
    state read onto ``device``; build the module for ``job.config``, then
    ``job.load(module, optimizer)``; ``background`` and ``saver`` as for
    :func:`attach`."""
    saver = _saver(saver, background)
    conn = connect(cluster)
    own = conn is not cluster
    try:
        me = _host(conn, host, rank_world()[1])
        r = resume(conn, job, model, tp=tp, pp=pp, batch=batch, dtype=dtype, optimizer=optimizer,
                   init=init, host=me, device=device, policy=policy, gpu=gpu, seq=seq,
                   degrees=degrees, vpp=vpp, cp_shard=cp_shard)
    except BaseException:
        if own:
            conn.close()
        raise
    rs = r.rank_state
    h = Job(conn, rs.state, rs.rank, me, rs.state.config.hosts,
            Attached(r.created, r.reconfigured, r.reconfigure_seconds, r.load_seconds,
                     r.bytes_loaded), own_cluster=own, saver=saver, mover=mover)
    h._loaded = rs
    return h
