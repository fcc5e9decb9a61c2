"""A new job from the values a training job's modules hold, every rank
writing its own sub-tensors: no whole tensor is built anywhere.

The call order of :func:`create_from_ranks` (every rank, collective):

1. rank 0 checks that the job does not exist and that every host answers,
   then opens version 1 as staging on every host (``begin_at``);
2. every rank puts the sub-tensors it is the first holder of
   (:func:`ptcfs.sharding.owned_tensors`) on every host that must hold them
   under the configuration;
3. rank 0 commits version 1 on every host, or, when any rank failed,
   aborts it (nothing of the job is left) and every rank raises;
4. rank 0 deals the job's dataset, if one was ingested before, to the new
   data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ptcfs.client.control.access import created_by
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import advance_data
from ptcfs.client.torch.gang import on_every, on_rank0, rank_world
from ptcfs.client.torch.state import to_numpy
from ptcfs.errors import InvalidConfig, InvalidRequest, PeerError, WorkerError
from ptcfs.jobstate import JobState
from ptcfs.sharding import owned_tensors, validate

__all__ = ["create_from_ranks"]


def create_from_ranks(cluster: Cluster, state: JobState, rank: int,
                      tensors: Mapping[str, torch.Tensor]) -> JobState:
    """Version 1 of the job ``state`` describes, from each rank's ``tensors``
    (its sub-tensors under ``state``'s configuration); see the module
    docstring. Returns the committed state."""
    state = created_by(state, cluster.key_name)
    hosts = list(cluster.hosts)

    def begin() -> None:
        validate(state.model_spec(), state.config)
        unknown = [h.name for h in state.config.hosts if h.name not in hosts]
        if unknown:
            raise InvalidConfig(f"hosts not in the cluster file: {', '.join(unknown)}")
        existing, down = cluster.call_all("versions", job=state.job)
        if down:
            raise PeerError(f"hosts not answering: {', '.join(down)}; cannot create job "
                            f"{state.job!r}")
        if any(existing.values()):
            raise InvalidRequest(f"job {state.job!r} exists already")
        cluster.call_hosts(hosts, "begin_at", job=state.job, version=state.version,
                           meta=state.to_meta())

    def put() -> None:
        model = state.model_spec()
        for spec, sl in owned_tensors(model, state.config, rank):
            t = tensors[spec.name]
            data = to_numpy(t)
            for h in state.placement(spec, model)[sl]:
                cluster.client(h).put(state.job, state.version, spec.name, sl.key(), data,
                                      spec.dtype)

    on_rank0(begin)
    try:
        on_every(put)
    except WorkerError:
        if rank_world()[0] == 0:
            cluster.call_hosts(hosts, "abort", job=state.job, version=state.version, quiet=True)
        raise

    def commit() -> None:
        cluster.call_hosts(hosts, "commit", job=state.job, version=state.version,
                           meta=state.to_meta())
        advance_data(cluster, state.job, None, state.config.data_parallel)

    on_rank0(commit)
    return state
