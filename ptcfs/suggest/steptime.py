"""Time of one training step of a mesh, as a sum of named terms (seconds).

- **compute**: the step's FLOPs over the GPUs' throughput. FLOPs are
  ``6·N·tokens`` (forward and backward of every matrix multiplication; ``N``
  counts 2-D weights, the output layer but not the embedding lookup, and of
  a mixture-of-experts layer only the ``topk`` experts a token visits) plus
  attention, ``12·L·h·s²`` per sequence (``4Lhs²`` forward, three times for
  forward and backward). Recomputation adds a forward: all of it (full) or
  the attention's (selective). Throughput is the peak times
  :data:`UTILIZATION`, times ``d/(d + GEMM_HALF_DIM)`` where ``d = h/tp``:
  matrix multiplications whose tensor-parallel part is narrow run slower.
- **tensor/context parallel**: per layer and micro-batch, 4 ring
  all-reduce-sized collectives of the layer's ``2sbh`` activation bytes
  (two forward, two backward; 6 with full recomputation), ``2(t-1)/t`` of
  the bytes over the tensor-parallel group's link; context parallelism passes
  keys and values around its ring (3 times: forward, backward of ``K``, ``V``).
  Expert parallelism: 4 all-to-alls of the ``topk`` routed tokens per layer.
- **pipeline**: each micro-batch's time on the slowest stage times
  ``m + pp - 1`` for ``m`` micro-batches (1F1B; the bubble is
  ``(pp-1)/(m+pp-1)`` of it), and the activations sent between stages.
- **data parallel**: FSDP all-gathers each micro-batch's parameters twice
  and reduce-scatters its gradients, overlapped with compute (FSDP2
  prefetches); replicas (``dp``) all-reduce gradients once per step, after
  the last micro-batch (ZeRO-1: reduce-scatter and all-gather, the same
  bytes), not overlapped. A group's link is the inter-host one when it
  spans hosts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptcfs.sharding import stage_chunks
from ptcfs.suggest.device import Device
from ptcfs.suggest.memory import Dims
from ptcfs.types import ModelSpec, ParallelConfig

__all__ = ["UTILIZATION", "GEMM_HALF_DIM", "ACT_BYTES", "matmul_params", "step_flops",
           "step_time", "spans_hosts", "StepInput"]

#: Fraction of peak FLOP/s that large matrix multiplications reach in training.
UTILIZATION = 0.6
#: The tensor-parallel width h/tp at which matrix multiplications run at half speed.
GEMM_HALF_DIM = 128
#: Bytes of one activation element (16-bit training).
ACT_BYTES = 2


def matmul_params(model: ModelSpec) -> float:
    """``N`` of ``6·N·tokens``: 2-D+ weights a token passes through (see the
    module docstring); an embedding tied to the output layer counts once."""
    experts, topk = model.experts, dict(model.params).get("topk", 0)
    n = 0.0
    has_head = False
    first = 0.0
    for t in model.tensors:
        if t.is_optim or len(t.shape) < 2:
            continue
        size: float = math.prod(t.shape)
        if t.rule.stage == "first":
            first = max(first, size)
            continue
        if t.rule.stage == "last":
            has_head = True
        if t.rule.expert is not None and experts and isinstance(topk, int) and topk:
            size = size * topk / experts
        n += size
    return n + (0 if has_head else first)


def step_flops(n: float, d: Dims | None, batch: int, seq: int, recompute: str
               ) -> dict[str, float]:
    """The step's FLOPs for ``n`` :func:`matmul_params`: ``dense`` (6N per
    token), ``attention``, ``recompute``."""
    tokens = batch * seq
    attn = 12.0 * d.layers * d.hidden * seq * seq * batch if d else 0.0
    extra = {"none": 0.0, "selective": attn / 3, "full": (6 * n * tokens + attn) / 3}[recompute]
    return {"dense": 6 * n * tokens, "attention": attn, "recompute": extra}


def spans_hosts(cfg: ParallelConfig, stride: int, size: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart spans hosts. Such
    groups tile the ranks in aligned blocks of ``stride·size``, so one spans
    hosts exactly when a host boundary falls inside a block."""
    if size <= 1:
        return False
    block, edge = stride * size, 0
    for h in cfg.hosts[:-1]:
        edge += h.gpus
        if edge >= cfg.world:
            break
        if edge % block:
            return True
    return False


def _ring(nbytes: float, n: int, bw: float, factor: float = 2.0) -> float:
    """A ring all-reduce (factor 2) or all-gather/reduce-scatter (1) of ``nbytes``."""
    return factor * (n - 1) / n * nbytes / bw if n > 1 else 0.0


@dataclass(frozen=True)
class StepInput:
    """What :func:`step_time` needs besides the mesh."""

    model: ModelSpec
    dims: Dims | None
    device: Device
    batch: int
    seq: int
    micro: int
    recompute: str
    matmul_params: float


def step_time(x: StepInput, cfg: ParallelConfig, stage_params: list[int],
              stage_grads: list[int]) -> dict[str, float]:
    """The step's terms in seconds (their sum is the estimate). ``stage_params``
    and ``stage_grads``: each stage's largest rank's parameter and gradient
    bytes (parameters without optimizer state)."""
    dev, d = x.device, x.dims
    m = x.batch // (cfg.data_parallel * x.micro)
    flops = sum(step_flops(x.matmul_params, d, x.batch, x.seq, x.recompute).values())
    width = d.hidden / cfg.tp if d else float(GEMM_HALF_DIM * 8)
    rate = dev.flops * UTILIZATION * width / (width + GEMM_HALF_DIM)
    layers = [sum(map(len, rs)) for rs in stage_chunks(x.model.layers, cfg.pp, cfg.pp_layers,
                                                        cfg.vpp)]
    imbalance = max(layers) * cfg.pp / x.model.layers
    compute_mb = flops / cfg.world / rate / m * imbalance
    link = {True: dev.inter_host, False: dev.intra_host}
    out: dict[str, float] = {}
    tp_mb = cp_mb = ep_mb = pp_mb = 0.0
    if d is not None:
        s_local = x.seq / cfg.cp
        act = s_local * x.micro * d.hidden * ACT_BYTES
        passes = 6 if x.recompute == "full" else 4
        tp_bw = link[spans_hosts(cfg, 1, cfg.tp)]
        tp_mb = max(layers) * passes * _ring(act, cfg.tp, tp_bw) if cfg.tp > 1 else 0.0
        if cfg.cp > 1:
            kv = act * 2 * d.kv_heads / d.heads / cfg.tp
            cp_bw = link[spans_hosts(cfg, cfg.tp, cfg.cp)]
            cp_mb = max(layers) * 3 * (cfg.cp - 1) * kv / cp_bw
        if cfg.ep > 1 and d.topk:
            ep_bw = link[spans_hosts(cfg, cfg.tp * cfg.cp, cfg.ep)]
            ep_mb = max(layers) * 4 * (cfg.ep - 1) / cfg.ep * act * d.topk / cfg.tp / ep_bw
        if cfg.pp > 1:
            stage_size = cfg.world // cfg.pp
            pp_bw = link[spans_hosts(cfg, stage_size, 2)]
            pp_mb = 2 * act / cfg.tp / pp_bw
    fsdp_mb = 0.0
    if cfg.fsdp > 1:
        bw = link[spans_hosts(cfg, cfg.tp * cfg.cp, cfg.fsdp)]
        whole_p, whole_g = max(stage_params) * cfg.fsdp, max(stage_grads) * cfg.fsdp
        fsdp_mb = 2 * _ring(whole_p, cfg.fsdp, bw, 1) + _ring(whole_g, cfg.fsdp, bw, 1)
    ticks = m + cfg.pp - 1
    out["compute"] = compute_mb * m
    out["bubble"] = compute_mb * (cfg.pp - 1)
    out["fsdp_exposed"] = max(0.0, fsdp_mb - compute_mb) * ticks
    out["tp_comm"] = tp_mb * ticks
    out["cp_comm"] = cp_mb * ticks
    out["ep_comm"] = ep_mb * ticks
    out["pp_p2p"] = pp_mb * ticks
    dp_bw = link[spans_hosts(cfg, cfg.tp * cfg.cp * cfg.fsdp, cfg.dp)]
    out["dp_allreduce"] = _ring(max(stage_grads), cfg.dp, dp_bw) if cfg.dp > 1 else 0.0
    return out
