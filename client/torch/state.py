"""A rank's state in device memory: load it from the local daemon, put it back.

Call order of a rank (every rank does the same, in any order):

1. :func:`load_rank` reads the sub-tensors the rank holds under the job's
   current committed version from the daemon of the rank's host. To CUDA:
   each sub-tensor streams through two pinned host buffers, and the copy
   of one piece to the device (non-blocking, on a side stream) overlaps
   the read of the next. To CPU: the bytes land straight in the tensors'
   memory, several sub-tensors at a time. The result is a
   :class:`RankState`: tensor name → tensor of the sub-tensor's local shape
   (vocabulary padding included).
2. Training changes the tensors (see :mod:`ptcfs.client.torch.module` to
   hand them to a module and an optimizer and to take them back).
3. :func:`put_rank` writes the rank's sub-tensors into the version opened
   for saving (:func:`ptcfs.client.control.saving.begin_save`), on the rank's own
   host; :func:`ptcfs.client.control.saving.commit_step` then commits the step.

torch is needed here (``pip install ptcfs[torch]``); nothing in ``ptcfs``
or ``ptcfs.server`` imports this module.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ptcfs import settings
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.torch.localread import ByteSource, LocalStore, source_for
from ptcfs.data.deal import balanced_ranks
from ptcfs.errors import InvalidRequest, PtcError
from ptcfs.jobstate import JobState
from ptcfs.pages import HUGE_PAGE, huge_pages
from ptcfs.sharding import owned_tensors, rank_coords, rank_tensors
from ptcfs.types import Slice, TensorSpec, gc_paused

__all__ = [
    "DTYPE_NAMES",
    "TORCH_DTYPES",
    "RankState",
    "default_device",
    "load_rank",
    "new_tensor",
    "put_rank",
    "to_numpy",
    "progress_bar",
]

#: A save's sub-tensors below this many bytes go to the daemon together, up
#: to this many bytes a request (one round trip, not one each).
SMALL_PUT_BYTES = 1 << 20

#: The torch dtype of each ptcfs dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
}
#: The ptcfs dtype of each torch dtype.
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass
class RankState:
    """The sub-tensors one rank holds, on one device.

    ``state`` is the committed version they were loaded from; ``step`` the
    training step they are at (it moves on when the caller trains and
    saves); ``slices`` says which slice of its logical tensor each is.
    """

    state: JobState
    rank: int
    tensors: dict[str, torch.Tensor]
    slices: dict[str, Slice]
    step: int = 0
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    #: a mover's commit of ``state`` still to come (a ``Saved``; None: committed)
    commit: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor to load into. On the CPU, the whole 2 MiB
    pages of a big one are advised huge pages before anything writes them
    (:func:`ptcfs.pages.huge_pages`): the load then faults them in 2 MiB at a
    time, not 4 KiB."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu" and nbytes >= 2 * HUGE_PAGE:
        huge_pages(t.data_ptr(), nbytes)
    return t


def default_device(local_rank: int | None = None) -> torch.device:
    """``cuda:<local rank>`` when CUDA is present (``LOCAL_RANK`` from
    torchrun when not given), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    lr = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", lr % torch.cuda.device_count())


@contextmanager
def progress_bar(total: int, what: str, show: bool | None) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar on stderr; ``show=None``: only for
    ``total`` of at least PROGRESS_MIN_BYTES on a terminal."""
    if show is None:
        show = total >= settings.get("PTC_CLIENT_PROGRESS_BYTES") and sys.stderr.isatty()
    bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
               disable=not show, file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a writable numpy uint8 array."""
    return t.reshape(-1).view(torch.uint8).numpy()


@gc_paused()
def load_rank(cluster: Cluster, job: str, rank: int, device: torch.device | str | None = None,
              state: JobState | None = None, host: str | None = None,
              progress: bool | None = None) -> RankState:
    """The current committed state of ``rank`` of ``job`` on ``device``
    (default: :func:`default_device`), read from ``host`` (default: the
    rank's own host under the current configuration). ``state``: the job's
    current version, when the caller has it already. The cyclic garbage
    collector is paused meanwhile: a training process holds hundreds of
    thousands of objects, and the records a load reads would set off its
    passes over them."""
    st = state if state is not None else Coordinator(cluster).state(job)
    cfg = st.config
    if not 0 <= rank < cfg.world:
        raise InvalidRequest(f"rank {rank} is not a rank of job {job!r} "
                             f"({st.describe()}, ranks 0..{cfg.world - 1})")
    dev = torch.device(device) if device is not None else default_device()
    src = host or rank_coords(cfg)[rank].host
    peer = source_for(cluster, src)
    items = rank_tensors(st.model_spec(), cfg, rank)
    pin = dev.type == "cuda"
    tensors: dict[str, torch.Tensor] = {}
    for spec, sl in items:
        tensors[spec.name] = new_tensor(sl.local_shape(spec.shape), TORCH_DTYPES[spec.dtype], dev)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    where = f"job {job!r} version {st.version} rank {rank} on {src}"
    with progress_bar(total, f"load rank {rank}", progress) as tick:
        try:
            if pin:
                _load_cuda(peer, st, items, tensors, tick)
            else:
                _load_cpu(peer, st, items, tensors, tick)
        except PtcError as e:
            raise type(e)(f"loading {where}: {e}") from e
    return RankState(st, rank, tensors, {s.name: sl for s, sl in items}, st.step,
                     {s.name: s for s, _ in items})


def _load_cpu(peer: ByteSource, st: JobState, items: list[tuple[TensorSpec, Slice]],
              tensors: dict[str, torch.Tensor], tick: Callable[[int], None]) -> None:
    """Each sub-tensor read straight into its tensor, ``PTC_CLIENT_READ_THREADS``
    at once; from a local store, each thread takes its share (the largest
    first, each to the least loaded) through one reader."""
    reads = [(spec.name, sl.key(), _byte_view(tensors[spec.name])) for spec, sl in items]
    reads = [r for r in reads if r[2].size]
    threads = max(1, min(settings.get("PTC_CLIENT_READ_THREADS"), len(reads)))
    if isinstance(peer, LocalStore):
        shares: list[list[tuple[str, str, np.ndarray]]] = [[] for _ in range(threads)]
        for r, i in zip(reads, balanced_ranks(np.array([r[2].size for r in reads]), threads)):
            shares[int(i)].append(r)
        jobs = [partial(peer.read_many, st.job, st.version, share, progress=tick)
                for share in shares if share]
    else:
        jobs = [partial(peer.read_into, st.job, st.version, name, part, 0, out.size, out,
                        progress=tick) for name, part, out in reads]
    if len(jobs) == 1:
        jobs[0]()
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()


def _load_cuda(peer: ByteSource, st: JobState, items: list[tuple[TensorSpec, Slice]],
               tensors: dict[str, torch.Tensor], tick: Callable[[int], None]) -> None:
    """Read the sub-tensors piece by piece into pinned host buffers and copy
    each piece to the device without blocking: ``PTC_CLIENT_READ_THREADS``
    readers at once, each alternating between two buffers on its own
    stream, so that the device takes one piece while the reader reads the
    next. The buffers hold ``2 * PTC_CLIENT_STAGING_BYTES`` in all."""
    pieces = [(spec, sl, tensors[spec.name].reshape(-1).view(torch.uint8)) for spec, sl in items]
    if not pieces:
        return
    largest = max(dest.numel() for _, _, dest in pieces)
    threads = max(1, min(settings.get("PTC_CLIENT_READ_THREADS"), len(pieces)))
    size = max(1, min(settings.get("PTC_CLIENT_STAGING_BYTES") // threads, largest))
    work = iter([(spec, sl, dest, off, min(size, dest.numel() - off))
                 for spec, sl, dest in pieces for off in range(0, dest.numel(), size)])
    taking = threading.Lock()
    device = pieces[0][2].device
    allocated = torch.cuda.current_stream(device)  # where the tensors were made

    def reader() -> None:
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done: list[torch.cuda.Event | None] = [None, None]
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(allocated)
        k = 0
        while True:
            with taking:
                piece = next(work, None)
            if piece is None:
                break
            spec, sl, dest, off, n = piece
            ev = done[k]
            if ev is not None:
                ev.synchronize()  # the device has taken this buffer's last piece
            host = bufs[k][:n]
            peer.read_into(st.job, st.version, spec.name, sl.key(), off, n, host.numpy(),
                           progress=tick)
            with torch.cuda.stream(stream):
                dest[off:off + n].copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            done[k] = ev
            k ^= 1
        stream.synchronize()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for f in [pool.submit(reader) for _ in range(threads)]:
            f.result()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy array with the tensor's bytes (bf16 as uint16 bit patterns)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def put_rank(cluster: Cluster, state: JobState, version: int, rank: int,
             tensors: Mapping[str, torch.Tensor], host: str | None = None,
             progress: bool | None = None, owned: bool = False) -> int:
    """Step 3 of the module docstring: put every sub-tensor of ``rank``
    (under ``state``'s configuration) into the open ``version``, on ``host``
    (default: the rank's own host). With ``owned``, only those that no lower
    rank holds (:func:`ptcfs.sharding.owned_tensors`): every rank of the job
    calls it, and each entry is written once. Returns the bytes written."""
    cfg = state.config
    items = (owned_tensors if owned else rank_tensors)(state.model_spec(), cfg, rank)
    arrays: list[tuple[TensorSpec, Slice, torch.Tensor]] = []
    for spec, sl in items:
        t = tensors.get(spec.name)
        if t is None:
            raise InvalidRequest(f"cannot save rank {rank} of job {state.job!r}: no tensor "
                                 f"{spec.name!r} given")
        want = sl.local_shape(spec.shape)
        if tuple(t.shape) != want or t.dtype != TORCH_DTYPES[spec.dtype]:
            raise InvalidRequest(
                f"cannot save rank {rank} of job {state.job!r}: {spec.name} is "
                f"{tuple(t.shape)} {t.dtype}, expected {want} {TORCH_DTYPES[spec.dtype]}")
        arrays.append((spec, sl, t))
    peer = cluster.client(host or rank_coords(cfg)[rank].host).peer
    total = sum(t.numel() * t.element_size() for _, _, t in arrays)

    def one(item: tuple[TensorSpec, Slice, torch.Tensor]) -> None:
        spec, sl, t = item
        peer.put(state.job, version, spec.name, sl.key(), to_numpy(t), spec.dtype)
        tick(t.numel() * t.element_size())

    small = [it for it in arrays if it[2].numel() * it[2].element_size() < SMALL_PUT_BYTES]
    large = [it for it in arrays if it[2].numel() * it[2].element_size() >= SMALL_PUT_BYTES]
    with progress_bar(total, f"save rank {rank}", progress) as tick:
        for batch in _batches(small):  # one request for many small ones
            peer.put_many(state.job, version, [(spec.name, sl.key(), to_numpy(t), spec.dtype)
                                               for spec, sl, t in batch])
            tick(sum(t.numel() * t.element_size() for _, _, t in batch))
        threads = min(settings.get("PTC_CLIENT_READ_THREADS"), len(large))
        if threads <= 1:
            for it in large:
                one(it)
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                for f in [pool.submit(one, it) for it in large]:
                    f.result()
    return total


def _batches(items: list[tuple[TensorSpec, Slice, torch.Tensor]]
             ) -> Iterator[list[tuple[TensorSpec, Slice, torch.Tensor]]]:
    """``items`` in runs of at most SMALL_PUT_BYTES together."""
    batch: list[tuple[TensorSpec, Slice, torch.Tensor]] = []
    size = 0
    for it in items:
        n = it[2].numel() * it[2].element_size()
        if batch and size + n > SMALL_PUT_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(it)
        size += n
    if batch:
        yield batch

