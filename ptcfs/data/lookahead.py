"""The lengths of a job's coming steps, before they are read: for a
scheduler that groups sequences by length (HotSPa, dynamic context
parallelism) ahead of time.

From the committed read position (:mod:`ptcfs.data.record`), for each of
the next ``steps`` steps: the length of every sample of the global batch
(in batch order, whatever the data-parallel degree), and the samples each
data-parallel rank will read, in the order it reads them, with their
lengths and their sum. It is a function of the dataset record and its
per-sample index alone (:func:`~ptcfs.data.deal.deal_steps`, the same deal
the rank views are built from), so every host computes the same look-ahead.

Lengths are tokens where the index holds a count per sample (``npy``,
``megatron``, ``jsonl`` with a length), else bytes (``unit`` says which).
With ``balance = "tokens"`` (sample packing), each step's per-rank token
counts are within the longest sample of the step of each other: the deal
gives each sample, longest first, to the rank with the fewest tokens, so
the fullest rank's last sample went to it while it was the emptiest
(``spread <= bound``, both in the output).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ptcfs.data.deal import deal_steps
from ptcfs.data.order import stream_samples
from ptcfs.data.record import DatasetRecord
from ptcfs.errors import InvalidRequest

__all__ = ["lengths_of", "lookahead"]


def lengths_of(index: dict[str, np.ndarray]) -> tuple[np.ndarray, str]:
    """Each sample's length and its unit (``tokens`` or ``bytes``)."""
    if "tokens" in index:
        return np.asarray(index["tokens"], dtype=np.int64), "tokens"
    return np.diff(np.asarray(index["offsets"], dtype=np.int64)), "bytes"


def lookahead(rec: DatasetRecord, index: dict[str, np.ndarray], steps: int,
              dp: int | None = None) -> dict[str, Any]:
    """The next ``steps`` steps from ``rec``'s position, dealt to ``dp``
    ranks (default: the position's degree)."""
    if steps < 1:
        raise InvalidRequest(f"a look-ahead needs at least 1 step, not {steps}")
    degree = rec.position.dp if dp is None else dp
    if degree < 1:
        raise InvalidRequest(f"the data-parallel degree must be at least 1, not {degree}")
    lengths, unit = lengths_of(index)
    first = rec.position.step
    tokens = index.get("tokens") if rec.balance == "tokens" else None
    views = deal_steps(rec.count, rec.seed, rec.global_batch, first, first + steps, degree,
                       tokens)
    batches = stream_samples(rec.count, rec.seed, first * rec.global_batch,
                             (first + steps) * rec.global_batch).reshape(steps,
                                                                         rec.global_batch)
    starts = [np.concatenate([[0], np.cumsum(v.counts)]) for v in views]
    out = []
    for i in range(steps):
        ranks = []
        for v, st in zip(views, starts):
            ids = v.samples[st[i]:st[i + 1]]
            ranks.append({"samples": ids.tolist(), "lengths": lengths[ids].tolist(),
                          "total": int(lengths[ids].sum())})
        totals = [r["total"] for r in ranks]
        out.append({"step": first + i, "lengths": lengths[batches[i]].tolist(),
                    "samples": batches[i].tolist(), "ranks": ranks,
                    "spread": max(totals) - min(totals),
                    "bound": int(lengths[batches[i]].max())})
    return {"job": rec.job, "version": rec.version, "from_step": first, "steps": steps,
            "dp": degree, "balance": rec.balance, "unit": unit,
            "global_batch": rec.global_batch, "step_lengths": out}
