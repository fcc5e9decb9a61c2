"""A worker's samples of each step: its data-parallel rank's view of the job's
dataset through a ``/ptc`` mount, or the same rows from a token file.

Both give the samples in the dataset library's order and deal
(:mod:`ptcfs.data`): step ``s`` takes the global batch at stream positions
``[s*B, (s+1)*B)`` of the seeded epoch order (``B``: the global batch) and
data-parallel rank ``d`` its contiguous part, so the samples of a step do
not depend on the configuration.

- :class:`ViewRows`: ``<mount>/<job>/data/`` of the dataset ingested into
  the job (``ptcctl data ingest JOB FILE --global-batch B --seed K``); the
  view starts at the committed read position and is opened again after
  each commit (the job's handle says when).
- :class:`FileRows`: a ``.npy`` of ``[samples, seq+1]`` token rows, read
  in the same order (no mount needed).

:class:`Data` ties one of them to a job's handle, which knows the
data-parallel degree and this worker's data rank, also after a
reconfiguration: ``data.rows(step)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ptcfs.data import even_bounds, stream_samples
from ptcfs.errors import InvalidRequest

__all__ = ["Data", "FileRows", "ViewRows", "Rows"]


class Rows(Protocol):
    #: whether its rows come from the committed version's layout (a mount's view)
    reads_commits: bool

    def rows(self, step: int, dp: int, dp_rank: int) -> np.ndarray: ...
    def committed(self) -> None: ...


class FileRows:
    """Rows of a token file, in the dataset library's order and deal."""

    reads_commits = False

    def __init__(self, path: str | Path, batch: int, seed: int):
        self.rows_ = np.load(path, mmap_mode="r")
        self.batch, self.seed = batch, seed

    def rows(self, step: int, dp: int, dp_rank: int) -> np.ndarray:
        ids = stream_samples(len(self.rows_), self.seed, step * self.batch,
                             (step + 1) * self.batch)
        bounds = even_bounds(self.batch, dp)
        return np.asarray(self.rows_[ids[bounds[dp_rank]:bounds[dp_rank + 1]]])

    def committed(self) -> None:
        pass


class ViewRows:
    """This rank's view under ``<mount>/<job>/data/``, opened again after
    each commit (the view starts at the committed position)."""

    reads_commits = True

    def __init__(self, root: str | Path, batch: int):
        self.root, self.batch = Path(root), batch
        self.view: tuple[int, int, np.ndarray, np.ndarray] | None = None

    def _open(self, step: int, dp: int, dp_rank: int
              ) -> tuple[int, int, np.ndarray, np.ndarray]:
        base = Path(os.path.realpath(self.root))  # the position's immutable version
        try:
            # held open until the samples are mapped: an open file keeps its version
            # on the host (a prune waits for it), so its other files cannot go between
            held = open(base / "position.json", "rb")
        except FileNotFoundError:
            raise InvalidRequest(f"{base} holds no dataset view: ingest the job's dataset "
                                 "(ptcctl data ingest) or read the token file") from None
        with held:
            return self._read(base, json.loads(held.read()), step, dp, dp_rank)

    def _read(self, base: Path, pos: dict[str, Any], step: int, dp: int, dp_rank: int
              ) -> tuple[int, int, np.ndarray, np.ndarray]:
        first, stop = pos["view_steps"]
        if not first <= step < stop or pos["dp"] != dp or pos["global_batch"] != self.batch:
            raise InvalidRequest(
                f"{base}: the data position is step {first} (view to {stop}), dp={pos['dp']}, "
                f"global batch {pos['global_batch']}; the job is at step {step} with dp={dp} "
                f"and batch {self.batch}")
        rank = base / "ranks" / str(dp_rank)
        counts = np.load(rank / "batches.npy")
        starts = np.concatenate([[0], np.cumsum(counts)])
        self.view = (first, stop, np.load(rank / "samples.npy", mmap_mode="r"), starts)
        return self.view

    def rows(self, step: int, dp: int, dp_rank: int) -> np.ndarray:
        view = self.view
        if view is None or not view[0] <= step < view[1]:
            view = self._open(step, dp, dp_rank)
        first, _, rows, starts = view
        i = step - first
        return np.asarray(rows[starts[i]:starts[i + 1]])

    def committed(self) -> None:
        self.view = None


class Data:
    """A source of rows tied to a job: ``rows(step)`` is this worker's part
    of the step's global batch under the job's configuration of now."""

    def __init__(self, source: Rows, where: Callable[[], tuple[int, int]]):
        self.source = source
        self._where = where  # (data-parallel degree, this worker's data rank)

    def rows(self, step: int) -> np.ndarray:
        dp, dp_rank = self._where()
        return self.source.rows(step, dp, dp_rank)

    @property
    def reads_commits(self) -> bool:
        return self.source.reads_commits

    def committed(self) -> None:
        self.source.committed()
