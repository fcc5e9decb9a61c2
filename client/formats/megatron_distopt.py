"""The distributed optimizer's state in legacy Megatron-LM checkpoints:
``iter_N/mp_rank_TT[_PPP]/distrib_optim.pt`` next to ``model_optim_rng.pt``.

Layout (megatron-core's ``DistributedOptimizer.save_parameter_state`` →
``get_parameter_state_dp_zero``, the coalesced form of Megatron-Core 0.7 and
later, checked against 0.16.1)::

    {"buckets_coalesced": True,
     <buffer index>: {(<param dtype>, <grad dtype>): {
         "param": fp32[n], "exp_avg": fp32[n], "exp_avg_sq": fp32[n],
         "numel_unpadded": n}}}

(a list of such dicts when the optimizer is chained, e.g. dense and expert
parameters). With virtual pipeline stages each model chunk has its own
buffers, numbered chunk after chunk. Each buffer is the model's gradient buffer
(``_ParamAndGradBuffer``) of one dtype gathered over the data-parallel
ranks: its parameters in reverse order of registration, each starting at a
multiple of 64 elements from its bucket's start, the buckets one after the
other with the padding at each bucket's end left out. A new bucket starts
after a parameter that makes the bucket reach ``bucket_size`` elements
(``--ddp-bucket-size``, else ``max(40M, 1M × dp)``; only with
``--overlap-grad-reduce``, only on the first pipeline stage, and with
virtual stages only in its first model chunk, as Megatron-LM's training
builds the chunks' DDP wrappers) and around
a shared embedding (the word embeddings and the output copy on the last
stage when pp > 1). ``param`` is the fp32 master copy.

:func:`buffer_layout` computes the offsets; the length it gives must equal
the saved ``numel_unpadded``, or the file is refused with a message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ptcfs.client.formats.common import torch_load
from ptcfs.errors import CheckpointError

__all__ = ["DISTRIB_OPTIM", "buffer_layout", "bucket_size_of", "distributed_entry",
           "read_distrib_optim", "write_distrib_optim"]

DISTRIB_OPTIM = "distrib_optim.pt"
_ALIGN = 64
_KINDS = (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
_SHARED = ("embedding.word_embeddings.weight", "word_embeddings_for_head.weight")


def buffer_layout(numels: Sequence[int], bucket_size: int | None = None,
                  shared: Sequence[bool] = ()) -> tuple[list[int], int]:
    """Offsets in the saved flat state of parameters of ``numels`` elements,
    given in buffer order (reverse registration), and its whole length."""
    offsets: list[int] = []
    done = 0  # elements of the buckets already closed
    start = 0  # next parameter's start, from the open bucket's start
    in_bucket = 0
    end = 0
    for k, numel in enumerate(numels):
        is_shared = k < len(shared) and shared[k]
        start = -(-start // _ALIGN) * _ALIGN
        if is_shared and in_bucket:
            done, start, in_bucket = done + start, 0, 0
        offsets.append(done + start)
        end = start + numel
        in_bucket += 1
        if (bucket_size is not None and end >= bucket_size) or is_shared:
            done, start, in_bucket = done + end, 0, 0
        else:
            start = end
    if in_bucket:
        done += end
    return offsets, done


def _arg(args: Any, name: str) -> Any:
    return getattr(args, name, None) if isinstance(args, argparse.Namespace) else (
        args.get(name) if isinstance(args, dict) else None)


def bucket_size_of(args: Any, first_stage: bool) -> int | None:
    """The gradient buffer's bucket size on this stage (module docstring)."""
    if not _arg(args, "overlap_grad_reduce") or not first_stage:
        return None
    dp = int(_arg(args, "data_parallel_size") or 1)
    return int(_arg(args, "ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))


def _shared(names: Sequence[str], pp: int) -> list[bool]:
    return [pp > 1 and n in _SHARED for n in names]


def _buffers(obj: Any, where: str) -> list[tuple[Any, dict[str, Any]]]:
    """(dtype key, flat state) of each buffer, in order."""
    if isinstance(obj, list):
        if len(obj) != 1:
            raise CheckpointError(f"{where}: the optimizer state of {len(obj)} chained "
                                  "optimizers (expert parameters) is not read")
        obj = obj[0]
    if not isinstance(obj, dict) or not obj.get("buckets_coalesced"):
        raise CheckpointError(f"{where}: not the coalesced distributed-optimizer layout of "
                              "Megatron-Core 0.7 or later (buckets_coalesced)")
    out = []
    for idx in sorted(k for k in obj if isinstance(k, int)):
        if not isinstance(obj[idx], dict) or len(obj[idx]) != 1:
            raise CheckpointError(f"{where}: buffer {idx} is not one dtype's state")
        ((key, world),) = obj[idx].items()
        out.append((key, world))
    return out


class _Laid(NamedTuple):
    """One gradient buffer of a rank: its parameters' dtype, their names in
    buffer order, where each starts in the saved flat state, its length and
    the bucket size it was laid out with."""

    dtype: torch.dtype
    order: list[str]
    offsets: list[int]
    total: int
    bucket_size: int | None


def _layout(by_chunk: Sequence[dict[str, torch.Tensor]], pp: int,
            bucket_size: Callable[[bool], int | None]) -> Iterator[_Laid]:
    """Each buffer of a rank, chunk after chunk, a buffer per parameter dtype
    in module order; ``bucket_size(first)``: the bucket size of a chunk (first:
    the one with the word embeddings, the only one that may have buckets)."""
    for named in by_chunk:
        params = [n for n in named if not n.startswith("optim/")]
        size = bucket_size("embedding.word_embeddings.weight" in named)
        for dtype in dict.fromkeys(named[n].dtype for n in params):
            order = [n for n in params if named[n].dtype == dtype][::-1]
            offsets, total = buffer_layout([named[n].numel() for n in order], size,
                                           _shared(order, pp))
            yield _Laid(dtype, order, offsets, total, size)


def read_distrib_optim(path: Path, by_chunk: Sequence[dict[str, torch.Tensor]], args: Any,
                       trust: bool = False) -> dict[str, torch.Tensor]:
    """One (tp, pp) rank's Adam state by job name (``optim/exp_avg/<name>``,
    ``optim/exp_avg_sq/<name>``, and ``optim/master/<name>`` for fp16/bf16
    parameters) from its ``distrib_optim.pt``; ``by_chunk``: the rank's model
    tensors in module order, per model chunk (one per virtual stage, whose
    buffers follow each other)."""
    where = str(path)
    pp = int(_arg(args, "pipeline_model_parallel_size") or 1)
    buffers = iter(_buffers(torch_load(path, trust), where))
    named = {n: t for c in by_chunk for n, t in c.items()}
    out: dict[str, torch.Tensor] = {}
    for laid in _layout(by_chunk, pp, lambda first: bucket_size_of(args, first)):
        key, world = next(buffers, (None, None))
        if world is None:
            raise CheckpointError(f"{where}: too few gradient buffers for the parameters' "
                                  "dtypes of each model chunk")
        saved = int(world.get("numel_unpadded", world["exp_avg"].numel()))
        if saved != laid.total or any(world[k].numel() != laid.total for k, _ in _KINDS):
            raise CheckpointError(
                f"{where}: buffer {key} holds {saved} elements; this rank's {len(laid.order)} "
                f"parameters laid out as Megatron-Core does (bucket size {laid.bucket_size}) "
                f"take {laid.total}")
        for name, at in zip(laid.order, laid.offsets):
            t = named[name]
            for kind, job_kind in _KINDS:
                if kind == "param" and t.dtype == torch.float32:
                    continue  # an fp32 model's master is the parameter itself
                out[f"optim/{job_kind}/{name}"] = world[kind][at:at + t.numel()].view(t.shape)
    if next(buffers, None) is not None:
        raise CheckpointError(f"{where}: more gradient buffers than the parameters' dtypes of "
                              "each model chunk")
    return out


def distributed_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """The optimizer entry of ``model_optim_rng.pt`` as ``DistributedOptimizer.
    state_dict`` saves it, from a non-distributed optimizer's: the parameter
    groups without their parameters, no state (that is in ``distrib_optim.pt``)."""
    inner = entry.get("optimizer", entry)
    return {"optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                           for g in inner["param_groups"]]}}


def write_distrib_optim(path: Path, by_chunk: Sequence[dict[str, torch.Tensor]],
                        pp: int) -> None:
    """``distrib_optim.pt`` of one (tp, pp) rank from its tensors by job name
    in module order (parameters, ``optim/exp_avg/*``, ``optim/exp_avg_sq/*``,
    ``optim/master/*`` where kept), per model chunk: one bucket per buffer,
    as Megatron-LM without ``--overlap-grad-reduce`` lays it out, the
    chunks' buffers one after the other."""
    values = {n: t for c in by_chunk for n, t in c.items()}
    state: dict[Any, Any] = {"buckets_coalesced": True}
    for idx, laid in enumerate(_layout(by_chunk, pp, lambda first: None)):
        world: dict[str, Any] = {k: torch.zeros(laid.total) for k, _ in _KINDS}
        for name, at in zip(laid.order, laid.offsets):
            n = values[name].numel()
            master = values.get(f"optim/master/{name}", values[name])
            world["param"][at:at + n] = master.reshape(-1).float()
            for kind in ("exp_avg", "exp_avg_sq"):
                world[kind][at:at + n] = values[f"optim/{kind}/{name}"].reshape(-1)
        world["numel_unpadded"] = laid.total
        state[idx] = {(laid.dtype, torch.float32): world}
    torch.save(state, path)
