"""The distributed optimizer's state in a ``torch_dist`` checkpoint's
bucket space (``dp_reshardable``): what Megatron-LM saves by default with
``--use-distributed-optimizer``.

Layout (checked against megatron-core 0.16.1's
``DistributedOptimizer.sharded_state_dict``, written by its own optimizer
in the tests)::

    [chained_<C>.]optimizer.distributed.dp_group_idx_<G>.gbuf_idx_<B>
        .dtype_(<param dtype>, <grad dtype>).bucket_idx_<K>.<kind>    (one key)

- ``C``: with expert parallelism (``ep > 1``) megatron-core chains two
  optimizers: 0 holds the dense parameters, 1 the experts (of its ep rank);
  otherwise there is one optimizer of every parameter and no prefix;
- ``G``: the rank in the tensor × pipeline model-parallel group
  (``pp_rank · tp + tp_rank``), for the expert optimizer in the tensor ×
  expert × pipeline group (``(pp_rank · ep + ep_rank) · tp + tp_rank``);
- ``B``: the gradient buffer of that rank: megatron-core's
  ``DistributedDataParallel`` makes one per model chunk (i.e. virtual
  stage; a chunk holds its layers, the first chunk of the first stage the
  embedding, the last of the last the final norm and output layer) and
  parameter dtype, the chunk's in the order their dtypes first appear in
  it (registration order), chunk after chunk; the key's dtype is the
  (parameter, gradient) dtype pair of its buffer;
- ``K``: its bucket; each key is the bucket's fp32 ``param`` (the master;
  an fp32 parameter is its own), ``exp_avg`` or ``exp_avg_sq``, 1-D, as
  long as the bucket without the padding at its end;
- a buffer holds its parameters in reverse order of registration
  (Megatron-Core's ``GPTModel`` registers them in the order of ptcfs's
  ``names=mcore`` presets), each starting at a multiple of 64 elements
  from its bucket's start; a bucket ends with the parameter that fills it
  (:func:`bucket_places`).

Each parameter's state is read from its range of its bucket on every
tensor-parallel rank and merged into the logical tensor. Before any of it
is given out, each parameter's fp32 master is checked against its weight
(the master rounded to the weight's dtype is the weight, as the optimizer
leaves them): a checkpoint whose buffers hold the parameters in another
order is refused, not imported wrongly. Each parameter's dtype is its
weight's in the checkpoint. Not read (the import says so and leaves the
moments at zero): buffers whose dtypes are not the weights' (fp8
parameters under Transformer Engine have a ``torch.uint8`` buffer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.formats.common import Entry, tp_merged
from ptcfs.client.formats.dcp_box import read_box
from ptcfs.errors import CheckpointError
from ptcfs.sharding import chunk_of, rank_of, rank_tensors, stage_chunks
from ptcfs.types import Host, ModelSpec, ParallelConfig, Slice, TensorSpec

__all__ = ["bucket_places", "has_bucket_space", "read_dp_reshardable"]

_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)"
                  r"\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_SPACE = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.")
_ALIGN = 64
_KINDS = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

#: a gradient buffer's (chain C, G, B)
Buffer = tuple[int, int, int]
#: buffer → bucket K → kind → (key, length)
Buckets = dict[Buffer, dict[int, dict[str, tuple[str, int]]]]


def has_bucket_space(keys: Any) -> bool:
    """Whether a checkpoint's keys hold optimizer state in bucket space."""
    return any(_SPACE.match(str(k)) for k in keys)


def bucket_places(numels: list[int], buckets: list[int]) -> list[tuple[int, int]] | None:
    """Each parameter's ``(bucket, offset in it)`` for parameters of
    ``numels`` elements in buffer order and buckets of ``buckets`` elements
    (each up to its last parameter's end); None where they do not fit."""
    out: list[tuple[int, int]] = []
    k, start = 0, 0
    for numel in numels:
        if k == len(buckets):
            return None
        start = -(-start // _ALIGN) * _ALIGN
        out.append((k, start))
        end = start + numel
        if end > buckets[k]:
            return None
        if end == buckets[k]:
            k, start = k + 1, 0
        else:
            start = end
    return out if k == len(buckets) and start == 0 else None


def _buckets(md: dict[str, Any]) -> tuple[Buckets, dict[Buffer, str], bool]:
    """The bucket-space keys of ``md``, each buffer's parameter dtype (as
    ``str(torch.dtype)``) and whether they are a chain's."""
    out: Buckets = {}
    dtypes: dict[Buffer, str] = {}
    chained = False
    for key, meta in md.items():
        m = _KEY.match(key)
        if m is None or not hasattr(meta, "size"):
            continue
        chained = chained or m.group(1) is not None
        c, g, b, k = int(m.group(1) or 0), int(m.group(2)), int(m.group(3)), int(m.group(5))
        out.setdefault((c, g, b), {}).setdefault(k, {})[m.group(6)] = (key, int(meta.size[0]))
        dtypes[(c, g, b)] = m.group(4).strip("()").split(",")[0].strip()
    return out, dtypes, chained


Held = list[tuple[TensorSpec, Slice]]


def _optimizer_ranks(model: ModelSpec, tp: int, pp: int, ep: int, vpp: int, chained: bool,
                     dtypes: dict[str, torch.dtype]
                     ) -> dict[Buffer, tuple[int, torch.dtype, Held]]:
    """Each gradient buffer's ``(chain C, G, B)`` → its tensor-parallel
    rank, parameter dtype and parameters in buffer order, for parameters
    of ``dtypes``. One optimizer of every parameter, or with experts over
    ``ep > 1`` ranks a chain of the dense one (G = pp_rank · tp + tp_rank)
    and the expert one (G = (pp_rank · ep + ep_rank) · tp + tp_rank, the
    rank in megatron-core's expert tp-ep-pp group); a buffer per model
    chunk (the rank's virtual stage) and dtype, as megatron-core's
    ``DistributedDataParallel`` makes them (module docstring)."""
    mp = ParallelConfig(tp, pp, ep, (Host("any", tp * pp * ep),), ep=ep, vpp=vpp)
    chunked: dict[tuple[int, int], tuple[int, list[Held]]] = {}  # (C, G) → t, chunks
    for p in range(pp):
        chunks = stage_chunks(model.layers, pp, (), vpp)[p]
        for t in range(tp):
            for e in range(ep):
                held = [(s, sl) for s, sl in rank_tensors(model, mp, rank_of(mp, t, e, p))
                        if not s.is_optim][::-1]
                for v in range(vpp):
                    mine = [x for x in held if chunk_of(x[0].rule.stage, chunks) == v]
                    if e == 0:  # the dense parameters are the same on every ep rank
                        chunked.setdefault((0, p * tp + t), (t, []))[1].append(
                            [x for x in mine if not chained or x[0].rule.expert is None])
                    if chained:
                        chunked.setdefault((1, (p * ep + e) * tp + t), (t, []))[1].append(
                            [x for x in mine if x[0].rule.expert is not None])
    out: dict[Buffer, tuple[int, torch.dtype, Held]] = {}
    for (c, g), (t, per_chunk) in chunked.items():
        # a buffer per dtype of each chunk, in the order it registers their first parameters
        bufs = [(d, [x for x in mine if dtypes[x[0].name] == d]) for mine in per_chunk
                for d in dict.fromkeys(dtypes[s.name] for s, _ in reversed(mine))]
        for b, (d, items) in enumerate(bufs):
            out[(c, g, b)] = (t, d, items)
    return out


def read_dp_reshardable(it: Path, md: dict[str, Any], model: ModelSpec, tp: int, pp: int,
                        ep: int, vpp: int, params: dict[str, Entry], notes: list[str]
                        ) -> dict[str, Entry]:
    """The Adam state (and fp32 masters, where ``model`` keeps them) of the
    bucket-space keys of ``md``, saved at ``tp``, ``pp``, expert parallelism
    ``ep`` and ``vpp`` virtual stages, as job tensors (module docstring);
    ``params``: the model's tensors, whose dtypes say their buffers and
    against which the masters are checked."""
    buckets, held_dtypes, chained = _buckets(md)
    why = None
    experts = ep > 1 and model.experts > 0
    if chained != experts:
        why = ("it is a chained optimizer without experts over several ranks" if chained
               else f"it holds no expert optimizer for ep={ep}")
    dtypes = {name: e.dtype for name, e in params.items()}
    ranks = {} if why else _optimizer_ranks(model, tp, pp, ep if experts else 1, vpp, chained,
                                             dtypes)
    wants = {k: str(dtype) for k, (_, dtype, _) in ranks.items()}
    if why is None and held_dtypes != wants:
        odd = next(x for x in sorted(held_dtypes.keys() | wants.keys())
                   if held_dtypes.get(x) != wants.get(x))
        have, want = (f"a buffer of {d[odd]} parameters" if odd in d else "no buffer"
                      for d in (held_dtypes, wants))
        c, g, b = odd
        why = (f"in its group {g}{' (expert optimizer)' if c else ''} it has {have} as "
               f"buffer {b}, where tp={tp}, pp={pp}, ep={ep}, vpp={vpp} and the weights' "
               f"dtypes make {want} (a buffer per model chunk and parameter dtype; fp8 "
               "parameters have one of torch.uint8)")
    if why is not None:
        notes.append(f"the distributed optimizer's bucket-space state (dp_reshardable) is not "
                     f"imported: {why}; Adam moments start at zero")
        return {}
    names = {t.name for t in model.tensors}
    pieces: dict[str, dict[int, tuple[dict[str, str], int, tuple[int, ...]]]] = {}
    for (c, g, b), (t, _, items) in sorted(ranks.items()):
        shapes = [sl.local_shape(s.shape) for s, sl in items]
        bucket = buckets[(c, g, b)]
        sizes = [bucket[k]["param"][1] for k in sorted(bucket)]
        places = bucket_places([math.prod(x) for x in shapes], sizes)
        if places is None or sorted(bucket) != list(range(len(sizes))):
            raise CheckpointError(
                f"{it}: the distributed optimizer's buckets of its group {g}"
                f"{' (expert optimizer)' if c else ''}, buffer {b} "
                f"({', '.join(map(str, sizes))} elements) "
                f"do not hold this model's parameters in Megatron-Core's order ({model.name}, "
                f"{sum(map(math.prod, shapes))} elements); import with --optimizer none")
        for (s, _), shape, (k, off) in zip(items, shapes, places, strict=True):
            keys = {kind: bucket[k][kind][0] for kind in _KINDS if kind in bucket[k]}
            pieces.setdefault(s.name, {})[t] = (keys, off, shape)
    checked: set[str] = set()
    out: dict[str, Entry] = {}
    for spec in model.tensors:
        if spec.is_optim or spec.name not in pieces or spec.name not in params:
            continue
        parts = pieces[spec.name]
        for kind, ours in _KINDS.items():
            name = f"optim/{ours}/{spec.name}"
            if name not in names or any(kind not in keys for keys, _, _ in parts.values()):
                continue
            where = f"{it} [{spec.name} in the optimizer's buckets]"
            get = tp_merged(spec, {t: _piece(it, keys[kind], off, shape)
                                   for t, (keys, off, shape) in parts.items()}, tp, where)
            master = tp_merged(spec, {t: _piece(it, keys["param"], off, shape)
                                      for t, (keys, off, shape) in parts.items()}, tp, where)
            out[name] = Entry(spec.shape, torch.float32,
                              _checked(None if kind == "param" else get, master, spec.name,
                                       params[spec.name], checked, it), where)
    return out


def _piece(it: Path, key: str, off: int, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    return lambda: read_box(it, key, (off,), (math.prod(shape),), torch.float32).view(shape)


def _checked(get: Callable[[], torch.Tensor] | None, master: Callable[[], torch.Tensor],
             name: str, param: Entry, checked: set[str], it: Path
             ) -> Callable[[], torch.Tensor]:
    """``get`` (None: the master itself, read once for the check and the
    answer), once parameter ``name``'s master was seen to be its weight."""
    def run() -> torch.Tensor:
        seen = None
        if name not in checked:
            weight = param.get()
            seen = master()
            if not torch.equal(seen.to(weight.dtype), weight):
                raise CheckpointError(
                    f"{it}: the distributed optimizer's fp32 master of {name} is not its "
                    "weight: its buckets hold the parameters in another order than "
                    "Megatron-Core's GPTModel registers them; import with --optimizer none")
            checked.add(name)
        if get is None:
            return seen if seen is not None else master()
        return get()

    return run
