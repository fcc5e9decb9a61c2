"""A rank's sub-tensors into a DTensor module (FSDP2, tensor parallelism) and
its Adam optimizer, and back, shard by shard.

ptcfs's sub-tensor of a rank is exactly ``DTensor.to_local()`` of the
matching placements (see :mod:`ptcfs.client.torch.dtensor_spec`), so a rank's
state moves between the daemons and a parallelized module without any
whole tensor being built: :func:`load_into` copies each sub-tensor into
``param.to_local()`` and wraps the optimizer's moments with
``DTensor.from_local``; :func:`state_of` hands back the local shards.

Call order of a worker (every rank, collective only where noted)::

    spec, degrees = spec_from_module(model, mesh, optimizer=opt)  # every rank, same answer
    rank = mesh_rank(mesh)                       # this process's rank in the job
    rs = load_rank(cluster, job, rank)           # once the job exists (created on rank 0)
    load_into(rs, model, opt)
    ...                                          # train
    version = begin_save(coord, job)             # rank 0, then a barrier
    put_rank(cluster, rs.state, version, rank, state_of(model, opt, rs.state, rank),
             owned=True)
    commit_step(coord, job, step)                # rank 0, after a barrier

Parameters are matched by state-dict name (FSDP2 keeps the module's names;
DDP's ``module.`` and torch.compile's ``_orig_mod.`` are dropped). Adam's
``step`` is the job's training step. When the job keeps fp32 masters (a
bf16 or fp16 job) and the module's parameter is fp32 (FSDP2 with a
``MixedPrecisionPolicy``), the parameter takes the master and saving
writes both: the parameter rounded to the job's dtype and the master.
"""

from __future__ import annotations

import torch

from ptcfs.client.torch.dtensor_spec import Modules, model_parts, module_parameters
from ptcfs.client.torch.module import load_adam, rank_state
from ptcfs.client.torch.state import RankState
from ptcfs.errors import InvalidRequest
from ptcfs.jobstate import JobState

__all__ = ["load_into", "state_of", "local_of"]



def local_of(p: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a parameter: ``to_local()`` of a DTensor, else itself."""
    from torch.distributed.tensor import DTensor

    t = p.to_local() if isinstance(p, DTensor) else p
    return t.detach()


def _resharded(module: Modules) -> None:
    """FSDP2 modules back to their sharded parameters (a forward without a
    backward may leave them gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts(module):
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _where(rs: RankState) -> str:
    return f"rank {rs.rank} of job {rs.state.job!r} ({rs.state.describe()})"


def load_into(rs: RankState, module: Modules,
              optimizer: torch.optim.Optimizer | None = None) -> None:
    """Copy the rank's sub-tensors into ``module``'s local shards and set
    ``optimizer``'s Adam state (moments as DTensors over the rank's own
    sub-tensors: no copy when dtype and device agree). Every parameter must
    have a tensor and every model tensor of the rank a parameter."""
    _resharded(module)
    params = module_parameters(module)
    model_names = {n for n in rs.tensors if not n.startswith("optim/")}
    missing, unused = sorted(set(params) - model_names), sorted(model_names - set(params))
    if missing or unused:
        raise InvalidRequest(
            f"module and {_where(rs)} do not match: "
            + (f"parameters without a tensor: {', '.join(missing[:4])}; " if missing else "")
            + (f"tensors without a parameter: {', '.join(unused[:4])}" if unused else ""))
    with torch.no_grad():
        for name, p in params.items():
            local = local_of(p)
            src = rs.tensors[name]
            master = rs.tensors.get(f"optim/master/{name}")
            if master is not None and p.dtype == torch.float32:
                src = master
            if tuple(src.shape) != tuple(local.shape):
                raise InvalidRequest(f"{name}: the module's local shard is "
                                     f"{tuple(local.shape)}, the sub-tensor of {_where(rs)} "
                                     f"{tuple(src.shape)}: the mesh is not the job's")
            local.copy_(src)
    if optimizer is not None:
        load_adam(rs, optimizer, params, place=_like)


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``p``'s local shard: a DTensor with ``p``'s placements when
    ``p`` is one (its global shape and stride given, so uneven shards need
    no communication)."""
    from torch.distributed.tensor import DTensor

    local = local.to(device=local_of(p).device, dtype=p.dtype)
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def state_of(module: Modules, optimizer: torch.optim.Optimizer | None,
             state: JobState, rank: int) -> dict[str, torch.Tensor]:
    """The sub-tensors of ``rank`` under ``state``'s configuration, by job
    name, from the module's local shards and the optimizer's (ready for
    :func:`~ptcfs.client.torch.state.put_rank`): the live local tensors where
    dtypes agree, converted copies where they do not. A parameter the
    optimizer has not stepped yet has zero moments."""
    _resharded(module)
    return rank_state(module_parameters(module), optimizer, state, rank, local_of,
                      check_shape=True)
