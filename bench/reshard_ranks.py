"""One rank of the resharding benchmark (run by :class:`ranks.Ranks`).

Each timed command is measured from a barrier before the work to a barrier
after it (:func:`ranks.timed`), so a figure is the time until the slowest
rank is done. Commands (every rank runs each one):

- ``save_dcp(degrees, path)``: load this rank's state from ptcfs (the job's
  current version, which must have layout ``degrees``: the same bytes for
  both systems), wrap each sub-tensor as a DTensor on a ``(dp, tp)`` device
  mesh (``Shard(dim)`` on ``tp`` for split tensors, ``Replicate()``
  otherwise) and ``dcp.save`` them;
- ``load_dcp(degrees, path)``: allocate this rank's DTensors under the new
  layout and ``dcp.load`` them from the checkpoint (DCP reshards);
- ``load_ptc()``: :func:`ptcfs.client.torch.state.load_rank` from the rank's
  host daemon.

Loads report the bytes the process read (``rchar`` of ``/proc/self/io``)
and, with ``verify``, a CRC of every tensor, so the parent can check that
both systems hand each new rank the same bytes.
"""

from __future__ import annotations

import gc
import warnings
import zlib
from pathlib import Path
from typing import Any

from ranks import timed

__all__ = ["JOB", "ReshardRank"]

JOB = "reshard"


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


class ReshardRank:
    """One rank's side: its device meshes and its ptcfs connection."""

    def __init__(self, rank: int, world: int, cluster_file: str):
        from ptcfs.client.control.conn import Cluster

        self.rank, self.world = rank, world
        self.cluster = Cluster.load(cluster_file)
        self.meshes: dict[tuple[int, int], Any] = {}

    def _mesh(self, dp: int, tp: int) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if (dp, tp) not in self.meshes:
            self.meshes[(dp, tp)] = init_device_mesh("cpu", (dp, tp),
                                                     mesh_dim_names=("dp", "tp"))
        return self.meshes[(dp, tp)]

    def _dtensors(self, degrees: str, tensors: dict[str, Any] | None) -> dict[str, Any]:
        """This rank's DTensors under ``degrees`` (pp=1): ``tensors`` wrapped,
        or fresh empty ones when ``tensors`` is None."""
        import torch
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from ptcfs.client.torch.state import TORCH_DTYPES
        from ptcfs.sharding import parse_config, rank_tensors

        st = self._state()
        cfg = parse_config(degrees, ",".join(f"{h.name}:{h.gpus}" for h in st.config.hosts))
        tp, dp = cfg.tp, cfg.dp
        if cfg.world != tp * dp or tp * dp != self.world:
            raise ValueError(f"layout {degrees} does not fit {self.world} ranks as tp x dp")
        mesh = self._mesh(dp, tp)
        out = {}
        for spec, sl in rank_tensors(st.model_spec(), cfg, self.rank):
            c = sl.cuts[0] if sl.cuts else None
            if c is not None and c.padded not in (None, spec.shape[c.dim]):
                raise ValueError(f"{spec.name} is padded under tp={tp}; pick a vocabulary "
                                 f"that is a multiple of 128*tp")
            local = tensors[spec.name] if tensors is not None else torch.empty(
                sl.local_shape(spec.shape), dtype=TORCH_DTYPES[spec.dtype])
            place = [Replicate(), Shard(c.dim) if c is not None else Replicate()]
            stride = torch.empty(spec.shape, device="meta").stride()
            out[spec.name.replace("/", ".")] = DTensor.from_local(
                local, mesh, place, run_check=False, shape=torch.Size(spec.shape), stride=stride)
        return out

    def _state(self) -> Any:
        from ptcfs.client.control.coordinator import Coordinator

        return Coordinator(self.cluster).state(JOB)

    @staticmethod
    def _crcs(tensors: dict[str, Any]) -> dict[str, int]:
        import torch

        out = {}
        for k, t in tensors.items():
            local = t.to_local() if hasattr(t, "to_local") else t
            out[k.replace("/", ".")] = zlib.crc32(local.contiguous().reshape(-1).view(
                torch.uint8).numpy())
        return out

    # --- commands ---------------------------------------------------------------
    def save_dcp(self, degrees: str, path: str) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        from ptcfs.client.torch.state import load_rank

        own = load_rank(self.cluster, JOB, self.rank, device="cpu", progress=False)
        sd = self._dtensors(degrees, own.tensors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seconds, _ = timed(lambda: dcp.save(sd, checkpoint_id=path))
        sd.clear()
        own.tensors.clear()
        gc.collect()
        return {"seconds": seconds}

    def load_dcp(self, degrees: str, path: str, verify: bool) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        before = _rchar()

        def work() -> dict[str, Any]:
            sd = self._dtensors(degrees, None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, checkpoint_id=path)
            return sd

        seconds, sd = timed(work)
        out = {"seconds": seconds, "read": _rchar() - before,
               "crc": self._crcs(sd) if verify else {}}
        del sd
        gc.collect()
        return out

    def load_ptc(self, verify: bool) -> dict[str, Any]:
        from ptcfs.client.torch.state import load_rank

        before = _rchar()
        seconds, rs = timed(lambda: load_rank(self.cluster, JOB, self.rank, device="cpu",
                                                    progress=False))
        out = {"seconds": seconds, "read": _rchar() - before, "bytes": rs.nbytes,
               "crc": self._crcs(rs.tensors) if verify else {}}
        del rs
        gc.collect()
        return out


    def close(self) -> None:
        self.cluster.close()
