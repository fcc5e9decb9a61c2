"""The files under ``/ptc/<job>/data/``, built from one host's store.

Every host holds the dataset record and the per-sample index of every
dataset (:mod:`ptcfs.data.record`), so any host builds the whole tree; the
samples themselves are byte ranges of stored chunks, with the hosts that
hold them. Nothing is read from the chunks here.

::

    position.json                 epoch, step, offset, global batch, dp, ...
    epochs/<e>/order.npy          epoch e's order (int64 sample indices), for
                                  every epoch the current views touch
    ranks/<d>/batches.npy         int64: rank d's number of samples in each
                                  step of its view, from the position's step
    ranks/<d>/samples.npy         npy: [n, L] rows of rank d, in order
    ranks/<d>/samples.jsonl       jsonl: rank d's lines, in order
    ranks/<d>/samples/<name>      files: one file per sample (see sample_name)
    ranks/<d>/index.txt           files: "<name>\\t<class>\\t<original path>" lines
    ranks/<d>/data.bin, data.idx  megatron: rank d's documents, in order
"""

from __future__ import annotations

import json

import numpy as np

from ptcfs.data.deal import RankView, deal_steps, view_steps
from ptcfs.data.formats.files import class_of, decode_names
from ptcfs.data.formats.megatron import index_bytes
from ptcfs.data.names import store_job
from ptcfs.data.npyfile import npy_bytes, npy_header
from ptcfs.data.order import epoch_order
from ptcfs.data.record import CHUNK_TENSOR, INDEX_TENSOR, DatasetRecord, chunk_part
from ptcfs.data.runs import RunFile
from ptcfs.errors import PtcError
from ptcfs.store.base import TensorStore
from ptcfs.vfile import StoreRange, VFile

__all__ = ["data_tree", "data_version", "load_record", "load_index", "sample_name"]


def data_version(job: str, store: TensorStore) -> int | None:
    """The current version of ``job``'s dataset in ``store`` (a cache key for
    :func:`data_tree`), None if it has none."""
    try:
        return store.current(store_job(job))
    except PtcError:
        return None


def load_record(job: str, store: TensorStore) -> DatasetRecord | None:
    """The current dataset record of ``job`` in ``store``."""
    v = data_version(job, store)
    if v is None:
        return None
    for info in store.versions(store_job(job)):
        if info.version == v:
            return DatasetRecord.from_meta(info.meta)
    return None


def load_index(rec: DatasetRecord, store: TensorStore) -> dict[str, np.ndarray]:
    """The per-sample index entries of a dataset (held by every host)."""
    sj = store_job(rec.job)
    return {e.part: store.get(sj, rec.base_version, INDEX_TENSOR, e.part)
            for e in store.entries(sj, rec.base_version) if e.tensor == INDEX_TENSOR}


def sample_name(seq: int, width: int, relpath: str) -> str:
    """A ``files`` sample's name in a rank's ``samples/``: its place in the
    view, zero-padded, then its original path with ``/`` as ``.``:
    ``cat/xxx.png`` 123rd → ``000123.cat.xxx.png``."""
    return f"{seq:0{width}d}.{relpath.replace('/', '.')}"


def data_tree(job: str, store: TensorStore) -> dict[str, VFile] | None:
    """Every file under ``/ptc/<job>/data/`` by relative path, None if the
    job has no dataset in ``store``."""
    rec = load_record(job, store)
    if rec is None:
        return None
    index = load_index(rec, store)
    first, stop = view_steps(rec.count, rec.global_batch, rec.position.step)
    tokens = index.get("tokens") if rec.balance == "tokens" else None
    ranks = deal_steps(rec.count, rec.seed, rec.global_batch, first, stop, rec.position.dp,
                       tokens)
    files: dict[str, VFile] = {}
    pos = {**rec.position_json(), "view_steps": [first, stop],
           "rank_samples": [int(r.counts.sum()) for r in ranks]}
    files["position.json"] = VFile.of_bytes((json.dumps(pos, indent=1) + "\n").encode())
    last_epoch = (stop * rec.global_batch - 1) // rec.count
    for e in range(rec.epoch, last_epoch + 1):
        files[f"epochs/{e}/order.npy"] = VFile.of_bytes(
            npy_bytes(epoch_order(rec.count, rec.seed, e)))
    build = _Builder(rec, index)
    for r in ranks:
        files[f"ranks/{r.rank}/batches.npy"] = VFile.of_bytes(npy_bytes(r.counts))
        files.update(build.rank_files(r))
    return files


class _Builder:
    """Files of one rank's samples, by format."""

    def __init__(self, rec: DatasetRecord, index: dict[str, np.ndarray]):
        self.rec = rec
        self.index = index
        self.offsets = index["offsets"]
        self.firsts = np.array([c.first for c in rec.chunks], dtype=np.int64)
        self.parts = tuple(chunk_part(i) for i in range(len(rec.chunks)))
        self.hosts = tuple(c.hosts for c in rec.chunks)
        self.names: list[str] | None = None

    def runs(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk, offset in chunk, length) of each sample."""
        chunk = np.searchsorted(self.firsts, ids, side="right") - 1
        start = self.offsets[ids]
        return chunk, start - self.offsets[self.firsts[chunk]], self.offsets[ids + 1] - start

    def run_file(self, head: bytes, ids: np.ndarray) -> RunFile:
        return RunFile(head, store_job(self.rec.job), self.rec.base_version, CHUNK_TENSOR,
                       self.parts, self.hosts, *self.runs(ids))

    def rank_files(self, r: RankView) -> dict[str, VFile]:
        d, ids, fmt = r.rank, r.samples, self.rec.format
        if fmt == "npy":
            head = npy_header(self.rec.dtype, (len(ids), *self.rec.sample_shape))
            return {f"ranks/{d}/samples.npy": self.run_file(head, ids)}
        if fmt == "jsonl":
            return {f"ranks/{d}/samples.jsonl": self.run_file(b"", ids)}
        if fmt == "megatron":
            return {f"ranks/{d}/data.bin": self.run_file(b"", ids),
                    f"ranks/{d}/data.idx": VFile.of_bytes(self.megatron_index(ids))}
        return self.files_view(d, ids)

    def megatron_index(self, ids: np.ndarray) -> bytes:
        seq, docs = self.index["seq_sizes"], self.index["doc_idx"]
        lo, n = docs[ids], docs[ids + 1] - docs[ids]
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        sizes = seq[np.repeat(lo, n) + within]
        doc_idx = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        return index_bytes(np.dtype(self.rec.dtype), sizes, doc_idx)

    def files_view(self, d: int, ids: np.ndarray) -> dict[str, VFile]:
        if self.names is None:
            self.names = decode_names(self.index["names"].tobytes())
        out: dict[str, VFile] = {}
        width = max(6, len(str(max(len(ids) - 1, 0))))
        lines = []
        chunk, offset, length = self.runs(ids)
        for seq, (i, c, o, n) in enumerate(zip(ids.tolist(), chunk.tolist(), offset.tolist(),
                                               length.tolist())):
            rel = self.names[i]
            name = sample_name(seq, width, rel)
            seg = (StoreRange(store_job(self.rec.job), self.rec.base_version, CHUNK_TENSOR,
                              self.parts[c], o, n, self.hosts[c]),) if n else ()
            out[f"ranks/{d}/samples/{name}"] = VFile(seg)
            lines.append(f"{name}\t{class_of(rel)}\t{rel}\n")
        out[f"ranks/{d}/index.txt"] = VFile.of_bytes("".join(lines).encode())
        return out
