"""Dealing each global batch to the data-parallel ranks.

Step ``s`` consumes the global batch of stream positions ``[s*B, (s+1)*B)``
(:mod:`ptcfs.data.order`). Under data-parallel degree ``dp``:

- ``samples`` (the default): rank ``d`` takes a contiguous part of the
  batch; the first ``B mod dp`` ranks take one sample more, so nothing is
  dropped (``B = 12, dp = 5``: 3, 3, 2, 2, 2).
- ``tokens``: the batch's samples go, longest first (ties: earlier in the
  batch first), each to the rank with the fewest tokens so far (ties: fewer
  samples, then the lower rank): the greedy longest-processing-time rule.
  Each rank keeps its samples in batch order. A function of the batch's
  lengths and ``dp`` only, so every host computes the same deal.

Either way every sample of the batch goes to exactly one rank, and the
batch itself does not depend on ``dp``: whatever sequence of degrees a job
runs under, it sees the same sequence of global batches, each sample of the
stream exactly once.

A rank's *view* covers the steps from the committed one up to the last step
that starts in the position's epoch (its last batch may reach into the
next epoch); a job that goes on reads the next view after committing a
later position.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ptcfs.data.order import stream_samples
from ptcfs.errors import InvalidRequest

__all__ = ["RankView", "even_bounds", "balanced_ranks", "view_steps", "deal_steps"]


@dataclass(frozen=True, eq=False)
class RankView:
    """One rank's samples for steps ``[first_step, stop_step)``: ``samples``
    in consumption order, ``counts[i]`` of them in step ``first_step + i``."""

    rank: int
    first_step: int
    stop_step: int
    samples: np.ndarray
    counts: np.ndarray

    def step_samples(self, step: int) -> np.ndarray:
        """This rank's samples of one step of the view."""
        i = step - self.first_step
        if not 0 <= i < len(self.counts):
            raise InvalidRequest(f"step {step} is outside this view's steps "
                                 f"[{self.first_step}, {self.stop_step})")
        start = int(self.counts[:i].sum())
        return self.samples[start:start + int(self.counts[i])]


def even_bounds(batch: int, dp: int) -> np.ndarray:
    """``bounds[d]:bounds[d+1]`` is rank d's part of a batch of ``batch``."""
    q, r = divmod(batch, dp)
    d = np.arange(dp + 1)
    return np.asarray(d * q + np.minimum(d, r), dtype=np.int64)


def balanced_ranks(tokens: np.ndarray, dp: int) -> np.ndarray:
    """The rank of each sample of a batch with these token counts."""
    lengths = np.asarray(tokens, dtype=np.int64)
    heap = [(0, 0, d) for d in range(dp)]
    out = np.empty(len(lengths), dtype=np.int64)
    for i in np.lexsort((np.arange(len(lengths)), -lengths)):
        load, n, d = heapq.heappop(heap)
        out[i] = d
        heapq.heappush(heap, (load + int(lengths[i]), n + 1, d))
    return out


def view_steps(count: int, global_batch: int, step: int) -> tuple[int, int]:
    """``(first, stop)`` steps of the view at ``step``: up to the last step
    that starts in the epoch of ``step``."""
    epoch = step * global_batch // count
    return step, -(-(epoch + 1) * count // global_batch)


def deal_steps(count: int, seed: int, global_batch: int, first: int, stop: int, dp: int,
               tokens: np.ndarray | None = None) -> list[RankView]:
    """Every rank's samples for steps ``[first, stop)`` under degree ``dp``
    (balanced by ``tokens``, one count per sample, when given)."""
    if dp < 1 or count < 1 or global_batch < 1 or not 0 <= first <= stop:
        raise InvalidRequest(f"cannot deal steps [{first}, {stop}) of {count} samples in "
                             f"batches of {global_batch} to {dp} ranks")
    steps = stop - first
    batches = stream_samples(count, seed, first * global_batch,
                             stop * global_batch).reshape(steps, global_batch)
    if tokens is None:
        b = even_bounds(global_batch, dp)
        return [RankView(d, first, stop, batches[:, b[d]:b[d + 1]].reshape(-1),
                         np.full(steps, b[d + 1] - b[d], dtype=np.int64)) for d in range(dp)]
    lengths = np.asarray(tokens, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(dp)]
    counts = np.zeros((dp, steps), dtype=np.int64)
    for i, batch in enumerate(batches):
        ranks = balanced_ranks(lengths[batch], dp)
        for d in range(dp):
            mine = batch[ranks == d]
            parts[d].append(mine)
            counts[d, i] = len(mine)
    return [RankView(d, first, stop,
                     np.concatenate(parts[d]) if parts[d] else np.empty(0, dtype=np.int64),
                     counts[d]) for d in range(dp)]
