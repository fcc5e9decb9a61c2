"""The lengths of a job's coming steps through the cluster
(:func:`ptcfs.data.lookahead.lookahead`, the same as the mount's
``data/lookahead.json``): the committed record from every host, the
per-sample index from the first host that answers."""

from __future__ import annotations

from typing import Any

import numpy as np

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import dataset_record
from ptcfs.data.lookahead import lookahead
from ptcfs.data.names import store_job
from ptcfs.data.record import INDEX_TENSOR, DatasetRecord
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import PeerError, PtcError

__all__ = ["dataset_index", "coming_steps"]


def dataset_index(cluster: Cluster, rec: DatasetRecord) -> dict[str, np.ndarray]:
    """The dataset's per-sample index (every host holds it)."""
    sj = store_job(rec.job)
    errors = []
    for h in cluster.hosts:
        try:
            client = cluster.client(h)
            out = {}
            for e in client.call("entries", job=sj, version=rec.base_version):
                if e["tensor"] != INDEX_TENSOR:
                    continue
                raw = client.peer.read_into(sj, rec.base_version, INDEX_TENSOR, e["part"])
                out[e["part"]] = np.frombuffer(bytes(raw), dtype=numpy_dtype(e["dtype"])).reshape(
                    e["shape"])
            return out
        except PtcError as err:
            errors.append(f"{h}: {err}")
    raise PeerError(f"no host gave the index of {rec.job!r}'s dataset: {'; '.join(errors)}")


def coming_steps(cluster: Cluster, job: str, steps: int, dp: int | None = None
                 ) -> dict[str, Any]:
    """The next ``steps`` steps' sample lengths from the committed read
    position, dealt to ``dp`` ranks (default: the position's degree)."""
    rec = dataset_record(cluster, job)
    return lookahead(rec, dataset_index(cluster, rec), steps, dp)
