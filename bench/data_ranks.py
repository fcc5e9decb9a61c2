"""One data-parallel rank reading its ptcfs dataset view through the /ptc
mount (run by :class:`ranks.Ranks`), as a training loop does.

A rank opens ``/ptc/<job>/data/ranks/<d>/samples.npy`` (``np.load`` with
``mmap_mode="r"``) on the mount of its host and reads step by step the
number of rows ``batches.npy`` gives, each batch into a torch tensor.
Resuming is committing the read position (step and data-parallel degree,
on rank 0, as ``ptcctl commit``/``reconfigure`` do) and then opening the
view. Samples carry their own index as token 0.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PtcfsDataRank"]


class PtcfsDataRank:
    """Rank ``rank`` of ``world`` reading job ``job``'s view on ``mounts[rank % len]``."""

    def __init__(self, rank: int, world: int, cluster_file: str, job: str, mounts: list[str]):
        from ptcfs.client.control.conn import Cluster

        self.rank, self.world, self.job = rank, world, job
        self.cluster = Cluster.load(cluster_file)
        self.view = Path(mounts[rank % len(mounts)]) / job / "data" / "ranks" / str(rank)

    def run(self, global_batch: int, steps: int | None, position: tuple[int, int] | None,
            want_ids: bool) -> dict[str, Any]:
        """Commit ``position`` (step, dp) if given, then read ``steps`` steps
        of this rank's view (None: the whole view)."""
        import torch
        import torch.distributed as dist

        from ptcfs.client.control.datastate import commit_position

        dist.barrier()
        t0 = time.perf_counter()
        t_commit = 0.0
        if position is not None:
            if self.rank == 0:
                commit_position(self.cluster, self.job, *position)
            dist.barrier()
            t_commit = time.perf_counter() - t0
        counts = np.load(self.view / "batches.npy")
        rows = np.load(self.view / "samples.npy", mmap_mode="r")
        ids: list[np.ndarray] = []
        at, n, t_first = 0, 0, 0.0
        for c in counts.tolist():
            tok = torch.from_numpy(np.array(rows[at:at + c]))
            at += c
            if not n:
                t_first = time.perf_counter() - t0
            n += 1
            if want_ids:
                ids.append(tok[:, 0].numpy().copy())
            if steps is not None and n >= steps:
                break
        t_end = time.perf_counter() - t0
        del rows
        dist.barrier()
        return {"first_batch_s": t_first, "end_s": t_end, "steps": n, "samples": at,
                "ids": ids, "commit_s": t_commit}

    def close(self) -> None:
        self.cluster.close()
