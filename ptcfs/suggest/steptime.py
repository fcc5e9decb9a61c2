"""Time of one training step of a mesh, as a sum of named terms (seconds).

- **compute**: the step's FLOPs over the GPUs' throughput. FLOPs are
  ``6·N·tokens`` (forward and backward of every matrix multiplication; ``N``
  counts 2-D weights, the output layer but not the embedding lookup, and of
  a mixture-of-experts layer only the ``topk`` experts a token visits) plus
  causal attention as flash kernels run it, ``7·L·h·s²`` per sequence
  (``2Lhs²`` forward over half the scores, 2.5 times that backward, which
  forms the scores again). Recomputation adds a forward: all of it (full),
  the attention's (selective) or every other matrix multiplication's of a
  layer (op, torchtitan's). Matrix multiplications run at the peak times
  :data:`UTILIZATION`, times ``d/(d + GEMM_HALF_DIM)`` where ``d = h/tp``
  (narrow tensor-parallel parts run slower); attention at the device's
  ``attn_util`` of the peak, less on short blocks.
- **elementwise**: the layers' norms, rotary embedding, residual adds and
  activation, :func:`elementwise_bytes` per token and layer over the GPU's
  memory bandwidth (divided as the tokens are), :data:`EAGER_ELEMENTWISE`
  times that unfused; a small model moves the most bytes per FLOP.
- **tensor parallel**: per layer and micro-batch, 4 ring
  all-reduce-sized collectives of the layer's ``2sbh`` activation bytes
  (two forward, two backward; 6 with full recomputation, 4.5 with op's,
  :func:`tp_passes`), ``2(t-1)/t`` of
  the bytes over the tensor-parallel group's link, not overlapped; with
  async tensor parallelism (``StepInput.async_tp``: the collectives
  decomposed and overlapped with the adjacent matrix multiplications)
  :data:`ASYNC_TP_HIDDEN` of that time is hidden.
- **context parallel** (ring attention, load-balanced causal, as
  torch's ``context_parallel`` runs it): each layer passes its keys and
  values (``2gh`` per token: grouped-query attention's smaller traffic)
  around the ring ``cp - 1`` times in the forward (again in its
  recomputation, with ``selective`` or ``full``) and in the backward, which
  also passes the fp32 ``dK``, ``dV`` (twice the bytes); each hop
  overlapped with its pass's attention of one block of ``s/cp`` queries by
  ``s/cp`` keys; what a hop does not hide, and :data:`CP_HOP_SECONDS` per
  hop and pass, are exposed, as is each hop's elementwise work, which no
  overlap hides and which weighs most where blocks are short:
  :data:`CP_MERGE_BYTES` per query and per key/value element at the GPU's
  memory bandwidth (the forward merges its partial attention into the fp32
  running output; the backward accumulates ``dQ``, ``dK``, ``dV`` in fp32
  and packs the buffers it passes on). Attention
  on blocks of ``n`` tokens runs at ``n/(n + ATTN_HALF_LEN)`` of the
  matrix rate, so context parallelism costs the most at short sequences.
  The ranks of a ring hold replicas of the state (``cp_shard=0``,
  Megatron-Core's layout), so their gradients are all-reduced once per
  step; with ``cp_shard=1`` (torchtitan's) they hold different chunks of
  it, FSDP sharding over ``fsdp·cp`` ranks, and their gradients are FSDP's
  reduce-scatters, below.
- Expert parallelism: 4 all-to-alls of the ``topk`` routed tokens per layer.
- **pipeline**: each micro-batch's time on the slowest stage times
  ``m + (pp - 1)/vpp`` for ``m`` micro-batches (1F1B, interleaved with
  ``vpp`` virtual stages: the bubble is ``(pp-1)/vpp`` micro-batches), and
  the activations sent between stages (``vpp`` times as often); with
  asynchronous sends and receives (``StepInput.async_p2p``, as Llama 3
  states in §3.3.2) only the fill's and the drain's ``pp - 1`` hops each,
  and what a micro-batch's compute does not hide, are exposed.
- **data parallel**: FSDP (over ``fsdp·cp`` ranks with ``cp_shard=1``) all-gathers each
  micro-batch's parameters twice and reduce-scatters its gradients; with a
  pipeline (``StepInput.fsdp_pipeline``) once a step each
  (``"step"``: torch.distributed.pipelining keeps a stage's parameters
  gathered and its gradients whole until the last backward, as torchtitan
  runs it) or once per micro-batch each (``"micro"``: Llama 3 keeps the
  parameters gathered from forward to backward and shards the gradients),
  overlapped with the micro-batch's compute (FSDP2
  prefetches one layer ahead): what compute does not hide, and the first
  layer's gather and last layer's reduction, are exposed. Replicas (``dp``)
  all-reduce gradients once per step, after the last micro-batch (ZeRO-1:
  reduce-scatter and all-gather, the same bytes), not overlapped. A group's
  link is the inter-host one when it spans hosts.
- **network hierarchy**: a group's link is NVLink within a host, the NIC
  between hosts, and the NIC over the device's ``pod_oversubscription``
  when the group spans pods of ``pod_gpus`` GPUs (Llama 3's fabric: full
  bisection within 3,072 GPUs, 1:7 above; Dubey et al. 2024, §3.3.1), so
  FSDP or replicas over thousands of GPUs cost more than over 64 hosts.
- Every ring collective also pays :data:`HOP_SECONDS` per hop, so a group
  of many ranks costs more than its bytes say; the last pipeline stage
  also runs the output layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptcfs.sharding import stage_chunks
from ptcfs.suggest.device import Device
from ptcfs.suggest.memory import Dims, layer_matmuls
from ptcfs.types import ModelSpec, ParallelConfig

__all__ = ["UTILIZATION", "GEMM_HALF_DIM", "FLOAT8_SPEEDUP", "ASYNC_TP_HIDDEN", "ATTN_HALF_LEN",
           "EAGER_ELEMENTWISE", "elementwise_bytes", "tp_passes",
           "CP_HOP_SECONDS", "CP_MERGE_BYTES", "HOP_SECONDS", "group_bandwidth", "spans_pods",
           "ACT_BYTES", "matmul_params", "step_flops", "step_time", "spans_hosts", "StepInput"]

#: Fraction of peak FLOP/s that large matrix multiplications reach in training.
UTILIZATION = 0.6
#: The tensor-parallel width h/tp at which matrix multiplications run at half speed.
GEMM_HALF_DIM = 128
#: How much faster the dense matrix multiplications run in Float8 (tensorwise
#: scaling, casts included) than in bf16. H100's Float8 peak is twice its bf16
#: one; torchtitan measured Llama 3.1 8B with FSDP 1.28x faster end to end on 8
#: GPUs and 1.29x on 128 with Float8 (benchmarks/llama3_h100_202412_torchtitan.md,
#: Tables 1 and 3, both with torch.compile), which this model gives with the
#: dense FLOPs 1.5x faster (the elementwise work unchanged).
FLOAT8_SPEEDUP = 1.5
#: The share of tensor-parallel collective time async TP overlaps with matrix
#: multiplications. torchtitan's Llama 3.1 70B at FSDP 32 x TP 8 in Float8
#: (ibid., Table 4) ran 829 TPS/GPU and 876 with async TP: 1.07 s of a 19.8 s
#: step, a quarter of the 4.0 s this model gives that step's TP collectives.
ASYNC_TP_HIDDEN = 0.25
#: HBM traffic of a layer's elementwise operations in eager PyTorch over that
#: of fused kernels (torch.compile, or a framework's fused norm, rotary and
#: activation kernels). torchtitan's Llama 3.1 8B with FSDP on 8 GPUs ran
#: 5,762 TPS eager and 6,667 with torch.compile (Table 1): with the step's
#: matrix work as this model prices it, that gain is the elementwise traffic
#: falling 3.0-fold.
EAGER_ELEMENTWISE = 3.0
#: The block length (tokens) at which attention kernels run at half the matrix rate.
ATTN_HALF_LEN = 256
#: Fixed cost of one hop of a context-parallel ring (launch and synchronisation).
CP_HOP_SECONDS = 30e-6
#: Bytes one context-parallel hop reads and writes, per query element and
#: per key/value element, in the forward and in the backward, as torch's
#: ring attention (``_templated_ring_attention``, ``convert_to_f32``) runs:
#: the forward converts the block's output to fp32 (6) and merges it into
#: the running output (``out - sigmoid(lse') * (out - block)``: 12, 8, 12);
#: on the half of the hops that attend half the queries, half that and the
#: output put back together (8): 32.5 on the mean; it packs K and V to pass
#: on (read and written in bf16: 8 per element). The backward adds the
#: block's bf16 ``dQ`` into the fp32 one (10; half and a re-join on half
#: the hops: 11.5), likewise ``dK`` and ``dV`` (23 per key/value element),
#: packs them in fp32 (16) and K and V (8).
CP_MERGE_BYTES = {"forward": (32.5, 8.0), "backward": (11.5, 47.0)}
#: Latency of one hop of a ring collective: over links as fast as
#: :data:`INTRA_MIN` (NVLink) and over slower ones (the network).
HOP_SECONDS = {True: 1e-6, False: 10e-6}
INTRA_MIN = 100e9
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
    token), ``attention`` (its kernels', forward and backward), and what
    recomputation runs again of each (``recompute_dense``,
    ``recompute_attention``)."""
    tokens = batch * seq
    # causal attention as flash kernels run it: the forward's two products over
    # half the scores, the backward's five (it forms the scores again)
    forward = 2.0 * d.layers * d.hidden * seq * seq * batch if d else 0.0
    op = 2.0 * tokens * d.layers * sum(p for _, p in _op_recomputed(d)) if d else 0.0
    dense = {"none": 0.0, "selective": 0.0, "op": op, "full": 2 * n * tokens}[recompute]
    return {"dense": 6 * n * tokens, "attention": 3.5 * forward, "recompute_dense": dense,
            "recompute_attention": forward if recompute in ("selective", "full") else 0.0}


def _op_recomputed(d: Dims) -> list[tuple[float, float]]:
    """The matrix multiplications torchtitan's per-op selective checkpointing
    recomputes: every second one of a layer (its ``mm_count % 2 == 0``)."""
    return layer_matmuls(d)[1::2]


def tp_passes(recompute: str) -> float:
    """Tensor parallelism's collectives per layer and micro-batch, in units of
    one all-gather and one reduce-scatter of the activations: forward and
    backward 4; full recomputation runs the forward's again, torchtitan's
    per-op one the all-gather before the recomputed up projection."""
    return {"full": 6.0, "op": 4.5}.get(recompute, 4.0)


def elementwise_bytes(d: Dims, recompute: str, eager: bool = False) -> float:
    """HBM bytes one token moves through one layer's elementwise operations
    in a step (before tensor and sequence parallelism divide them): per
    forward, with fused kernels, the two norms (``4h``: read and write),
    rotary embedding on the queries and keys (``2(h + kv)``), the residual
    adds (``6h``) and the MLP's activation (``3f`` gated: read gate and up,
    write; ``2f`` otherwise), in 16 bits; the backward moves twice that,
    and recomputation (selective or full) runs the forward's again;
    :data:`EAGER_ELEMENTWISE` times that without fusion."""
    h, f = d.hidden, d.ffn or 4 * d.hidden
    f = f * d.topk if d.experts and d.topk else f
    kv = h * d.kv_heads / d.heads
    forward = 12 * h + 2 * kv + (3 * f if d.gated else 2 * f)
    passes = 3 + (recompute != "none")
    return 2.0 * forward * passes * (EAGER_ELEMENTWISE if eager else 1.0)


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


def spans_pods(cfg: ParallelConfig, stride: int, size: int, pod_gpus: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart spans pods of
    ``pod_gpus`` GPUs (ranks fill the hosts, and the hosts the pods, in order)."""
    if size <= 1 or pod_gpus <= 0 or cfg.world <= pod_gpus:
        return False
    block = stride * size
    return block > pod_gpus or pod_gpus % block != 0


def group_bandwidth(cfg: ParallelConfig, dev: Device, stride: int, size: int) -> float:
    """Per-GPU bandwidth of a group's collectives: NVLink inside a host, the
    NIC across hosts, less the oversubscription across pods."""
    if not spans_hosts(cfg, stride, size):
        return dev.intra_host
    if spans_pods(cfg, stride, size, dev.pod_gpus):
        return dev.inter_host / max(1.0, dev.pod_oversubscription)
    return dev.inter_host


def _ring(nbytes: float, n: int, bw: float, factor: float = 2.0) -> float:
    """A ring all-reduce (factor 2) or all-gather/reduce-scatter (1) of
    ``nbytes``: its bytes over ``bw``, and :data:`HOP_SECONDS` for each of
    its ``factor·(n - 1)`` hops."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) * (nbytes / n / bw + HOP_SECONDS[bw >= INTRA_MIN])


def _imbalance(x: StepInput, cfg: ParallelConfig, layers: list[int]) -> float:
    """The slowest stage's matrix work over the average stage's: its layers,
    and on the last stage the output layer (``V·h``), which is why Llama 3
    gave its first and last stages a layer less."""
    d = x.dims
    head = float(d.vocab * d.hidden) if d is not None and d.vocab else 0.0
    head = min(head, x.matmul_params / 2)
    per_layer = (x.matmul_params - head) / x.model.layers
    work = [n * per_layer for n in layers]
    work[-1] += head
    return max(work) * cfg.pp / x.matmul_params if x.matmul_params else 1.0


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
    float8: bool = False
    async_tp: bool = False
    fsdp_pipeline: str = "step"
    async_p2p: bool = False
    eager: bool = False


def step_time(x: StepInput, cfg: ParallelConfig, stage_params: list[int],
              stage_grads: list[int]) -> dict[str, float]:
    """The step's terms in seconds (their sum is the estimate). ``stage_params``
    and ``stage_grads``: each stage's largest rank's parameter and gradient
    bytes (parameters without optimizer state)."""
    dev, d = x.device, x.dims
    m = x.batch // (cfg.data_parallel * x.micro)
    fl = step_flops(x.matmul_params, d, x.batch, x.seq, x.recompute)
    width = d.hidden / cfg.tp if d else float(GEMM_HALF_DIM * 8)
    rate = dev.flops * UTILIZATION * width / (width + GEMM_HALF_DIM)
    block = x.seq / cfg.cp
    attn_rate = dev.flops * dev.attn_util * block / (block + ATTN_HALF_LEN)
    attn = fl["attention"] + fl["recompute_attention"]
    dense = fl["dense"] + fl["recompute_dense"]
    layers = [sum(map(len, rs)) for rs in stage_chunks(x.model.layers, cfg.pp, cfg.pp_layers,
                                                        cfg.vpp)]
    imbalance = _imbalance(x, cfg, layers)
    attn_mb = attn / cfg.world / attn_rate / m * imbalance
    dense_rate = rate * (FLOAT8_SPEEDUP if x.float8 else 1.0)
    ew_mb = (x.batch * x.seq * d.layers * elementwise_bytes(d, x.recompute, x.eager) /
             cfg.world / dev.hbm / m * imbalance) if d else 0.0
    compute_mb = dense / cfg.world / dense_rate / m * imbalance + attn_mb
    out: dict[str, float] = {}
    tp_mb = cp_mb = ep_mb = pp_mb = 0.0
    if d is not None:
        s_local = x.seq / cfg.cp
        act = s_local * x.micro * d.hidden * ACT_BYTES
        passes = tp_passes(x.recompute)
        tp_bw = group_bandwidth(cfg, dev, 1, cfg.tp)
        tp_mb = max(layers) * passes * _ring(act, cfg.tp, tp_bw) if cfg.tp > 1 else 0.0
        if x.async_tp:
            tp_mb *= 1 - ASYNC_TP_HIDDEN
        if cfg.cp > 1:
            cp_bw = group_bandwidth(cfg, dev, cfg.tp, cfg.cp)
            kv = act * 2 * d.kv_heads / d.heads / cfg.tp  # one block's K and V, bf16
            q_el, kv_el = act / ACT_BYTES / cfg.tp, kv / ACT_BYTES
            forwards = 1 + (x.recompute in ("selective", "full"))
            # one block's attention in one forward (backward: 2.5 times it), one layer
            block_attn = attn_mb / max(layers) / (forwards + 2.5) / cfg.cp

            def cp_hop(ring_bytes: float, attn_s: float, merge: tuple[float, float]) -> float:
                work = (merge[0] * q_el + merge[1] * kv_el) / dev.hbm
                return max(0.0, ring_bytes / cp_bw - attn_s) + CP_HOP_SECONDS + work

            per_hop = (forwards * cp_hop(kv, block_attn, CP_MERGE_BYTES["forward"]) +
                       cp_hop(3 * kv, 2.5 * block_attn, CP_MERGE_BYTES["backward"]))
            cp_mb = max(layers) * (cfg.cp - 1) * per_hop
        if cfg.ep > 1 and d.topk:
            ep_bw = group_bandwidth(cfg, dev, cfg.tp * cfg.cp, cfg.ep)
            ep_mb = max(layers) * 4 * (cfg.ep - 1) / cfg.ep * act * d.topk / cfg.tp / ep_bw
        if cfg.pp > 1:
            stage_size = cfg.world // cfg.pp
            pp_bw = group_bandwidth(cfg, dev, stage_size, 2)
            pp_mb = 2 * act / cfg.tp / pp_bw * cfg.vpp
    ticks = m + (cfg.pp - 1) / cfg.vpp
    out["compute"] = compute_mb * m
    out["elementwise"] = ew_mb * m
    compute_mb += ew_mb  # what hides transfers, and what a bubble leaves idle
    out["bubble"] = compute_mb * (cfg.pp - 1) / cfg.vpp
    out["fsdp_exposed"] = 0.0
    shards = cfg.fsdp_shards
    if shards > 1:  # the group's stride: tp, or tp*cp past context-parallel replicas
        bw = group_bandwidth(cfg, dev, cfg.tp if cfg.cp_shard else cfg.tp * cfg.cp, shards)
        whole_p, whole_g = max(stage_params) * shards, max(stage_grads) * shards
        gathers = 2 if cfg.pp == 1 else 1
        per = max(1, max(layers))  # one gather and one reduction per layer
        ag = gathers * per * _ring(whole_p / per, shards, bw, 1)
        rs = per * _ring(whole_g / per, shards, bw, 1)
        edge = 1 / max(1, max(layers))
        if cfg.pp == 1:
            out["fsdp_exposed"] = m * (max(0.0, ag + rs - compute_mb) + (ag + rs) * edge)
        else:  # "step": one gather and one reduction a step; "micro": each micro-batch's,
            # the last reduction's tail exposed once
            times = ticks if x.fsdp_pipeline == "micro" else 1.0
            out["fsdp_exposed"] = times * (max(0.0, ag - compute_mb) + ag * edge +
                                           max(0.0, rs - compute_mb)) + rs * edge
    out["tp_comm"] = tp_mb * ticks
    out["cp_comm"] = cp_mb * ticks
    out["ep_comm"] = ep_mb * ticks
    if x.async_p2p and cfg.pp > 1:  # steady-state sends hide behind the chunks' compute;
        # the fill's and the drain's (pp - 1 hops each way) are on the critical path
        hop = pp_mb / (2 * cfg.vpp)
        out["pp_p2p"] = 2 * (cfg.pp - 1) * hop + ticks * max(0.0, pp_mb - compute_mb)
    else:
        out["pp_p2p"] = pp_mb * ticks
    dp_bw = group_bandwidth(cfg, dev, cfg.tp * cfg.cp * cfg.fsdp, cfg.dp)
    out["dp_allreduce"] = _ring(max(stage_grads), cfg.dp, dp_bw) if cfg.dp > 1 else 0.0
    replicas = cfg.cp if not cfg.cp_shard else 1  # context-parallel replicas all-reduce
    out["cp_grad_allreduce"] = _ring(max(stage_grads), replicas,
                                     group_bandwidth(cfg, dev, cfg.tp, cfg.cp))
    return out
