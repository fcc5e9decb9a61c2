"""A job version as DCP checkpoint files, over the store's bytes.

``/ptc/<job>/dcp/step-<N>/`` holds ``.metadata`` (DCP's ``Metadata``,
pickled by :mod:`ptcfs.dcp.pickles`) and one ``__<r>_0.distcp`` file per
rank r of the job's configuration that is the first to hold some
sub-tensor. Each chunk (:func:`ptcfs.dcp.layout.chunks`) is a
``torch.save`` archive in its file: a header in memory, the chunk's byte
range of its sub-tensor in the store (a :class:`~ptcfs.vfile.StoreRange`,
read from its holders when a reader reaches it), a trailer in memory. So
``dcp.load`` with DCP's own ``FileSystemReader`` reads, for each of its
shards, the chunks the shard meets and nothing else; on the job's own mesh,
exactly its own sub-tensors.

Non-tensor entries (the step, the optimizer's groups, ptcfs's notes; or,
for a version saved by ``dcp.save`` through the mount, what it saved) are
small archives in rank 0's file.

A job from torchtitan (imported, or saved through the mount) shows its keys
as torchtitan saved them: its fused query/key/value moments are one key
each, whose chunks are the runs of rows of the job's ``wq``/``wk``/``wv``
moments (:func:`ptcfs.dcp.titan.composite_chunks`), and its stacked experts
(parameters and moments) one key each, whose chunks are those of the job's
tensor of each expert at its index of dimension 0; each chunk in the file
of the rank that holds those rows.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from ptcfs.boxes import contiguous_range
from ptcfs.dcp import pickles as pk
from ptcfs.dcp.layout import chunks, dcp_keys, saved, small_entries
from ptcfs.dcp.titan import composite_chunks, composite_keys, composite_of
from ptcfs.dcp.zipped import object_archive, tensor_archive, tensor_archive_of
from ptcfs.jobstate import JobState
from ptcfs.sharding import rank_tensors
from ptcfs.types import Slice, TensorSpec
from ptcfs.vfile import Literal, Segment, StoreRange, VFile

__all__ = ["METADATA", "view_files", "CHUNK_BYTES"]

METADATA = ".metadata"
#: Chunks of the view are cut into blocks of rows of at most this many bytes
CHUNK_BYTES = 256 << 20
_META = "torch.distributed.checkpoint.metadata"

#: a tensor's sub-tensors → the hosts that hold each (a mapping keyed by host names)
Placed = Callable[[TensorSpec], dict[Slice, Any]]


def _flatten(d: Any, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """DCP's flattening of a nested state dict: dicts, and lists that hold
    dicts or lists, become dotted keys (list places as ints); anything else
    is a leaf."""
    out: dict[tuple[Any, ...], Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, (*prefix, str(k))))
    elif isinstance(d, list) and any(isinstance(v, dict | list) for v in d):
        for i, v in enumerate(d):
            out.update(_flatten(v, (*prefix, i)))
    else:
        out[prefix] = d
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class _File:
    def __init__(self, name: str):
        self.name = name
        self.segments: list[Segment] = []
        self.size = 0

    def add(self, segs: list[Segment]) -> tuple[int, int]:
        start = self.size
        for s in segs:
            self.segments.append(s)
            self.size += s.length
        return start, self.size - start


def view_files(state: JobState, placed: Placed) -> dict[str, VFile]:
    """``.metadata`` and the ``.distcp`` files of a version (module docstring)."""
    kept = saved(state)
    keys = dcp_keys(state, kept.keys if kept is not None else None)
    model = state.model_spec()
    owner: dict[tuple[str, str], int] = {}
    for r in range(state.config.world):
        for spec, sl in rank_tensors(model, state.config, r):
            owner.setdefault((spec.name, sl.key()), r)
    files: dict[int, _File] = {}

    def file_of(rank: int) -> _File:
        if rank not in files:
            files[rank] = _File(f"__{rank}_0.distcp")
        return files[rank]

    sd_meta: dict[str, Any] = {}
    storage: list[tuple[Any, Any]] = []
    planner: dict[str, tuple[str, ...]] = {}
    holders: dict[str, dict[Slice, Any]] = {}
    composites = [comp for k in composite_keys(kept.tensors, [s.name for s in model.tensors])
                  if (comp := composite_of(k, model, state.job)) is not None
                  ] if kept is not None else []
    for c in [*chunks(state, keys, CHUNK_BYTES),
              *(ch for co in composites for ch in composite_chunks(state, co, CHUNK_BYTES))]:
        spec = c.spec
        if spec.name not in holders:
            holders[spec.name] = placed(spec)
        entry_shape = c.slice.local_shape(spec.shape)
        isz = spec.itemsize
        run = contiguous_range(c.local, entry_shape, isz)
        if run is not None:
            lo, n = run
            size, stride, offset = c.sizes, _strides(c.sizes), 0
        else:  # the run from its first element to its last, viewed with the entry's strides
            es = _strides(entry_shape)
            lo_el = sum(a * s for (a, _), s in zip(c.local, es))
            hi_el = sum((b - 1) * s for (_, b), s in zip(c.local, es))
            lo, n = lo_el * isz, (hi_el - lo_el + 1) * isz
            lead = (0,) * (len(c.sizes) - len(es))  # a stacked expert's dimension, of size 1
            size, stride, offset = c.sizes, (*lead, *es), 0
        head, tail = tensor_archive(spec.dtype, size, stride, offset, n)
        f = file_of(owner.get((spec.name, c.slice.key()), 0))
        hosts = tuple(holders[spec.name][c.slice])
        at, length = f.add([Literal(head), StoreRange(state.job, state.version, spec.name,
                                                      c.slice.key(), lo, n, hosts),
                            Literal(tail)])
        if c.fqn not in sd_meta:
            sd_meta[c.fqn] = (spec.dtype, c.whole or spec.shape, [])
            planner[c.fqn] = tuple(c.fqn.split(".")) if kept else _path(keys, c.fqn)
        sd_meta[c.fqn][2].append(c)
        storage.append((_index(c.fqn, c.offsets), _info(f.name, at, length)))
    tensors: dict[str, Any] = {fqn: _tensor_md(dtype, shape, cs)
                               for fqn, (dtype, shape, cs) in sd_meta.items()}
    first = file_of(0)
    if kept is not None:
        blobs = {k: b for k, b in kept.blobs.items() if k not in kept.tensors}
        for fqn, (dtype, shape) in kept.tensors.items():
            at, length = first.add([Literal(kept.blobs[fqn])])
            tensors[fqn] = _tensor_md(dtype, shape, [None], shape)
            storage.append((_index(fqn, (0,) * len(shape)), _info(first.name, at, length)))
            planner[fqn] = tuple(fqn.split("."))
    else:
        blobs = {}
        for path, value in _flatten(small_entries(state, keys)).items():
            fqn = ".".join(map(str, path))
            if path[-1] == "step" and path[:2] == ("optim", "state"):  # a tensor, as torch keeps it
                blob = tensor_archive_of("fp32", (), _f32(value))
                at, length = first.add([Literal(blob)])
                tensors[fqn] = _tensor_md("fp32", (), [None], ())
                storage.append((_index(fqn, ()), _info(first.name, at, length)))
                planner[fqn] = path
                continue
            blobs[fqn] = object_archive(value)
            planner[fqn] = path
    for fqn, blob in blobs.items():
        at, length = first.add([Literal(blob)])
        tensors[fqn] = pk.Obj(pk.Global(_META, "BytesStorageMetadata"))
        storage.append((_index(fqn, None), _info(first.name, at, length)))
        planner.setdefault(fqn, tuple(fqn.split(".")))
    md = pk.Obj(pk.Global(_META, "Metadata"), {
        "state_dict_metadata": tensors, "planner_data": planner,
        "storage_data": pk.Pairs(tuple(storage)), "storage_meta": None, "version": "1.0.0"})
    out = {METADATA: VFile.of_bytes(pk.dump(md))}
    for f in sorted(files.values(), key=lambda f: f.name):
        out[f.name] = VFile(tuple(f.segments))
    return out


def _path(keys: dict[tuple[str, ...], TensorSpec], fqn: str) -> tuple[str, ...]:
    for p in keys:
        if ".".join(p) == fqn:
            return p
    return tuple(fqn.split("."))


def _f32(value: Any) -> bytes:
    return struct.pack("<f", float(value))


def _size(dims: tuple[int, ...]) -> pk.Call:
    return pk.Call(pk.TORCH_SIZE, (tuple(int(d) for d in dims),))


def _tensor_md(dtype: str, shape: tuple[int, ...], cs: list[Any],
               whole: tuple[int, ...] = ()) -> pk.Obj:
    """A key's TensorStorageMetadata; a None chunk is the whole tensor (``whole``)."""
    listed = [pk.Obj(pk.Global(_META, "ChunkStorageMetadata"),
                     {"offsets": _size(c.offsets if c is not None else (0,) * len(whole)),
                      "sizes": _size(c.sizes if c is not None else whole)}) for c in cs]
    return pk.Obj(pk.Global(_META, "TensorStorageMetadata"),
                  {"properties": pk.tensor_properties(dtype), "size": _size(shape),
                   "chunks": listed})


def _index(fqn: str, offsets: tuple[int, ...] | None) -> pk.Obj:
    state: dict[str, Any] = {"fqn": fqn}
    if offsets is not None:
        state["offset"] = _size(offsets)
    state["index"] = None
    return pk.Obj(pk.Global(_META, "MetadataIndex"), state)


def _info(path: str, offset: int, length: int) -> pk.Obj:
    return pk.Obj(pk.Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                  {"relative_path": path, "offset": offset, "length": length})

