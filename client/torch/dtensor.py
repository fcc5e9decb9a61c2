"""A rank's sub-tensors into a DTensor module (FSDP2, tensor parallelism) and
its Adam optimizer, and back, shard by shard: the names of
:mod:`ptcfs.client.torch.module`, whose one :func:`load_into` and
:func:`state_of` take plain and DTensor modules alike.

ptcfs's sub-tensor of a rank is exactly ``DTensor.to_local()`` of the
matching placements (see :mod:`ptcfs.client.torch.dtensor_spec`), so a rank's
state moves between the daemons and a parallelized module without any
whole tensor being built: :func:`load_into` copies each sub-tensor into
``param.to_local()`` and wraps the optimizer's moments with
``DTensor.from_local``; :func:`state_of` hands back the local shards.

A training script does all of this through :mod:`ptcfs.client.torch`
(``attach``, ``save``); the calls underneath, for code that is not a
torchrun job (every rank, collective only where noted)::

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

from ptcfs.client.torch.module import load_into, local_of, state_of

__all__ = ["load_into", "state_of", "local_of"]
