"""mosaicml-streaming as the data peer: writing MDS shards, and one rank of
a StreamingDataset train loop (run by :class:`ranks.Ranks`).

``import streaming`` imports its vision datasets, which import
torchvision; torchvision's PyPI builds are CUDA builds that fail to load
against torch's CPU build. A text benchmark uses none of it, so when
torchvision cannot be imported a stand-in module with the two names
streaming's vision code refers to is registered first (:func:`load`),
after transformers (which streaming's loader imports) has been imported
and has recorded that torchvision is absent.

A rank reads its per-device batches (global batch / world size) through
``torch.utils.data.DataLoader(num_workers=0)``, as a training loop does.
Samples carry their own index as token 0, so a run can be checked for
duplicates and skips.
"""

from __future__ import annotations

import gc
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["load", "write_mds", "StreamingRank"]


def _torchvision_stand_in() -> None:
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class VisionDataset:  # noqa: D401 - a placeholder base class
        """Unused: streaming's vision datasets subclass it."""

    def to_tensor(*_: Any) -> Any:
        raise RuntimeError("torchvision is not available here")

    datasets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
    functional.to_tensor = to_tensor  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = datasets, transforms  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets,
                        "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})


def load() -> Any:
    """The ``streaming`` module (see the module docstring)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a build that does not load
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        import transformers  # noqa: F401 - first, so it records torchvision as absent

        _torchvision_stand_in()
    import streaming

    return streaming


def write_mds(tokens: np.ndarray, out: Path) -> float:
    """Write ``tokens`` ([N, L] int32) as MDS shards in ``out``; seconds taken."""
    streaming = load()
    t0 = time.perf_counter()
    col = f"ndarray:{tokens.dtype.name}:{tokens.shape[1]}"
    with streaming.MDSWriter(out=str(out), columns={"tokens": col}) as w:
        for row in tokens:
            w.write({"tokens": row})
    return time.perf_counter() - t0


class StreamingRank:
    """One data-parallel rank reading an MDS dataset with StreamingDataset."""

    def __init__(self, rank: int, world: int, mds: str, seed: int):
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.streaming = load()
        self.rank, self.world, self.mds, self.seed = rank, world, mds, seed
        self.streaming.base.util.clean_stale_shared_memory()  # a collective: every rank

    def run(self, global_batch: int, steps: int | None, state: dict[str, Any] | None,
            want_ids: bool) -> dict[str, Any]:
        """Read ``steps`` global steps (None: to the end of the epoch), after
        loading ``state``. Returns timings, this rank's sample indices per
        step (with ``want_ids``) and, on rank 0, the state after them."""
        import torch.distributed as dist
        from torch.utils.data import DataLoader

        per_rank = global_batch // self.world
        dist.barrier()
        t0 = time.perf_counter()
        ds = self.streaming.StreamingDataset(local=self.mds, batch_size=per_rank, shuffle=True,
                                             shuffle_seed=self.seed)
        if state is not None:
            ds.load_state_dict(state)
        it = iter(DataLoader(ds, batch_size=per_rank, num_workers=0))
        ids: list[np.ndarray] = []
        n = 0
        t_first = 0.0
        for batch in it:
            if not n:
                t_first = time.perf_counter() - t0
            tok = batch["tokens"]
            n += 1
            if want_ids:
                ids.append(tok[:, 0].numpy().copy())
            if steps is not None and n >= steps:
                break
        t_end = time.perf_counter() - t0
        samples = sum(len(i) for i in ids) if want_ids else n * per_rank
        out: dict[str, Any] = {"first_batch_s": t_first, "end_s": t_end, "steps": n,
                               "samples": samples, "ids": ids}
        if self.rank == 0:
            out["state"] = ds.state_dict(num_samples=n * global_batch, from_beginning=False)
        del it, ds
        gc.collect()
        dist.barrier()
        return out
