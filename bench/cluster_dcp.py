"""PyTorch DCP's side of ``bench_cluster.py``: a checkpoint on the storage
host, loaded over HTTP by every destination host through its own link.

- :class:`HttpReader`: DCP's ``FileSystemReader`` reading from an HTTP
  server (:mod:`ptcfs.server.testing.httpstore`): the metadata file whole, then one
  ``Range`` request per stored item a rank needs, on one kept-alive
  connection; it counts the bytes it received.
- :class:`SaveRank` (run by :class:`ranks.Ranks`, gloo on loopback): each
  rank of the old layout ``dcp.save``\\ s its DTensors of the job's initial
  values (what ``Coordinator.create`` stored), so the checkpoint is chunked
  the way that layout's job would have saved it.
- ``python bench/cluster_dcp.py URL`` (run by the benchmark in a host's
  network namespace): a loader that imports torch once, then for each
  ``load`` line on stdin loads the given ranks of a new layout (one after
  another, each under a fake process group of that rank, ``no_dist``: DCP
  plans each rank locally), and answers one JSON line: seconds, bytes
  received, and whether every tensor equals the job's values.
"""

from __future__ import annotations

import http.client
import io
import json
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ptcfs.client.control.coordinator import init_values
from ptcfs.model.presets import parse_model
from ptcfs.plan.reshard import cut
from ptcfs.sharding import parse_config, rank_tensors
from ptcfs.types import ModelSpec, ParallelConfig

__all__ = ["HttpReader", "SaveRank", "rank_dtensors", "expected"]


def expected(model: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """The job's logical tensors as ``Coordinator.create`` made them."""
    out: dict[str, np.ndarray] = {}
    for spec in model.tensors:
        src = spec.same_as if spec.same_as else spec.name
        out[spec.name] = out[src] if src in out else init_values(spec, seed)
    return out


def rank_dtensors(model: ModelSpec, cfg: ParallelConfig, rank: int, mesh: Any,
                  values: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """One rank's state as DTensors on a ``(dp, tp)`` mesh (pp = 1): the
    sub-tensors of ``values``, or empty ones to load into."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ptcfs.client.torch.state import TORCH_DTYPES

    out = {}
    for spec, sl in rank_tensors(model, cfg, rank):
        c = sl.cuts[0] if sl.cuts else None
        if values is not None:
            local = torch.from_numpy(np.ascontiguousarray(cut(spec, sl, values[spec.name])))
        else:
            local = torch.empty(sl.local_shape(spec.shape), dtype=TORCH_DTYPES[spec.dtype])
        place = [Replicate(), Shard(c.dim) if c is not None else Replicate()]
        stride = torch.empty(spec.shape, device="meta").stride()
        out[spec.name.replace("/", ".")] = DTensor.from_local(
            local, mesh, place, run_check=False, shape=torch.Size(spec.shape), stride=stride)
    return out


def _mesh(cfg: ParallelConfig) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))


class SaveRank:
    """A rank of the old layout, saving its part of the checkpoint."""

    def __init__(self, rank: int, world: int, model: str, degrees: str, hosts: str, seed: int,
                 path: str):
        import torch.distributed.checkpoint as dcp

        spec = parse_model(model, dtype="fp32", optimizer="adam")
        cfg = parse_config(degrees, hosts)
        if cfg.world != world or cfg.pp != 1:
            raise ValueError(f"{degrees} on {hosts} is not {world} ranks of pp=1")
        sd = rank_dtensors(spec, cfg, rank, _mesh(cfg), expected(spec, seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=path)


def _reader_class() -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):  # type: ignore[misc,valid-type]
        """DCP's file reader with every file read over HTTP."""

        def __init__(self, url: str):
            super().__init__(url)
            self.url = url.rstrip("/")
            parts = urlsplit(self.url)
            self.base = parts.path
            self.conn = http.client.HTTPConnection(parts.netloc, timeout=600)
            self.received = 0
            self.fs = _HttpFs(self)

        def get(self, rel: str, start: int | None = None, length: int | None = None) -> bytes:
            headers = {} if start is None or length is None else {
                "Range": f"bytes={start}-{start + length - 1}"}
            self.conn.request("GET", f"{self.base}/{rel}", headers=headers)
            r = self.conn.getresponse()
            data = r.read()
            if r.status not in (200, 206):
                raise OSError(f"GET {self.url}/{rel}: HTTP {r.status}")
            self.received += len(data)
            return data

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            md = pickle.loads(self.get(".metadata"))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            return io.BytesIO(self.get(file.rel, sinfo.offset, sinfo.length))

    return Reader


class _HttpFs:
    """The part of DCP's FileSystem the reader uses: names, and a 'stream'
    that only remembers which file the ranges are of."""

    def __init__(self, reader: Any):
        self.reader = reader

    def init_path(self, path: str) -> str:
        return path

    def concat_path(self, path: str, suffix: str) -> str:
        return suffix  # relative to the reader's URL

    def create_stream(self, path: str, mode: str) -> Any:
        return _Named(path)


class _Named:
    def __init__(self, rel: str):
        self.rel = rel

    def __enter__(self) -> _Named:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def HttpReader(url: str) -> Any:  # noqa: N802 - a class, built once torch is imported
    """A DCP StorageReader of the checkpoint at ``url``."""
    return _reader_class()(url)


def _load(url: str, model_text: str, degrees: str, hosts: str, ranks: list[int],
          seed: int | None) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = parse_model(model_text, dtype="fp32", optimizer="adam")
    cfg = parse_config(degrees, hosts)
    t0 = time.perf_counter()
    received, loaded, states = 0, 0, []
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=cfg.world, store=FakeStore())
        try:
            sd = rank_dtensors(model, cfg, rank, _mesh(cfg), None)
            reader = HttpReader(url)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, storage_reader=reader, no_dist=True)
            received += reader.received
            loaded += sum(t.to_local().nbytes for t in sd.values())
            states.append((rank, sd))
        finally:
            dist.destroy_process_group()
    seconds = time.perf_counter() - t0
    same = None
    if seed is not None:
        values = expected(model, seed)
        same = all(
            np.array_equal(states_sd[spec.name.replace("/", ".")].to_local().numpy(),
                           cut(spec, sl, values[spec.name]))
            for rank, states_sd in states for spec, sl in rank_tensors(model, cfg, rank))
    return {"seconds": seconds, "received": received, "loaded": loaded, "same": same}


def main() -> int:
    """The loader: ``load URL MODEL DEGREES HOSTS RANKS SEED`` lines on stdin
    (RANKS comma-separated, SEED ``-`` for no check), one JSON line each."""
    import torch  # noqa: F401 - imported before 'ready', so loads time DCP only

    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "load":
            break
        url, model, degrees, hosts, ranks, seed = parts[1:7]
        try:
            out = _load(url, model, degrees, hosts, [int(r) for r in ranks.split(",")],
                        None if seed == "-" else int(seed))
        except Exception as e:  # noqa: BLE001 - the parent reports it
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
