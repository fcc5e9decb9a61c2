"""Bytes one GPU sends between hosts in one training step, per kind of traffic.

The chooser's third objective, beside step time and memory: a mesh whose
collectives cross hosts loads the shared network (other jobs' traffic, the
fabric's oversubscription, a slow or failing link), which a step-time
estimate on an idle fabric does not show. Llama 3 orders its parallelism
dimensions for this reason, the ones that move the most bytes innermost
(tensor parallelism inside a host, pipeline and FSDP outermost; Dubey et
al., "The Llama 3 Herd of Models", 2024, §3.3.2, "network-aware parallelism
configuration"). A pipeline sends only activations between stages, so its
meshes move far fewer bytes across hosts than FSDP over every host.

The count is the bytes :func:`~ptcfs.suggest.steptime.step_time` prices at
the inter-host bandwidth (a group whose ranks span hosts), per GPU and step,
with the same collectives: a ring all-gather or reduce-scatter of ``S``
bytes over ``n`` ranks sends ``(n - 1)/n · S`` from each rank, an
all-reduce twice that.

- **fsdp**: each gather of the parameters and each reduction of the
  gradients (per micro-batch without a pipeline, two gathers; under one,
  once a step with ``fsdp_pipeline="step"``, once per micro-batch with
  ``"micro"``).
- **dp** and **cp_grad**: the replicas' gradient all-reduce.
- **cp**: the ring's keys and values, ``3(cp - 1)`` hops per layer and
  micro-batch.
- **ep**: the routed tokens' 4 all-to-alls per layer and micro-batch.
- **pp**: each micro-batch's activations and their gradients, once per
  virtual stage.
- **tp**: its collectives, should a group span hosts (the search keeps it
  in one).
"""

from __future__ import annotations

from ptcfs.sharding import stage_chunks
from ptcfs.suggest.steptime import ACT_BYTES, StepInput, spans_hosts, tp_passes
from ptcfs.types import ParallelConfig

__all__ = ["inter_host_bytes"]


def _ring_sent(nbytes: float, n: int, factor: float = 1.0) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter (factor
    1) or all-reduce (2) of ``nbytes``."""
    return factor * (n - 1) / n * nbytes if n > 1 else 0.0


def inter_host_bytes(x: StepInput, cfg: ParallelConfig, stage_params: list[int],
                     stage_grads: list[int]) -> dict[str, float]:
    """Bytes a GPU of the busiest stage sends between hosts in one step, by
    kind (see the module docstring); ``stage_params`` and ``stage_grads`` as
    :func:`~ptcfs.suggest.steptime.step_time` takes them."""
    d = x.dims
    m = x.batch // (cfg.data_parallel * x.micro)
    layers = max(sum(map(len, rs)) for rs in stage_chunks(x.model.layers, cfg.pp,
                                                            cfg.pp_layers, cfg.vpp))
    out: dict[str, float] = {}
    if d is not None:
        act = x.seq / cfg.cp * x.micro * d.hidden * ACT_BYTES
        if spans_hosts(cfg, 1, cfg.tp):
            passes = tp_passes(x.recompute)
            out["tp"] = m * layers * passes * _ring_sent(act, cfg.tp, 2)
        if cfg.cp > 1 and spans_hosts(cfg, cfg.tp, cfg.cp):
            kv = act * 2 * d.kv_heads / d.heads / cfg.tp
            out["cp"] = m * layers * 3 * (cfg.cp - 1) * kv
        if cfg.ep > 1 and d.topk and spans_hosts(cfg, cfg.tp * cfg.cp, cfg.ep):
            out["ep"] = m * layers * 4 * (cfg.ep - 1) / cfg.ep * act * d.topk / cfg.tp
        if cfg.pp > 1 and spans_hosts(cfg, cfg.world // cfg.pp, 2):
            out["pp"] = m * 2 * act / cfg.tp * cfg.vpp
    shards = cfg.fsdp_shards
    if shards > 1 and spans_hosts(cfg, cfg.tp if cfg.cp_shard else cfg.tp * cfg.cp, shards):
        whole_p, whole_g = max(stage_params) * shards, max(stage_grads) * shards
        if cfg.pp == 1:
            times, gathers = m, 2
        else:
            times, gathers = (m if x.fsdp_pipeline == "micro" else 1), 1
        out["fsdp"] = times * (gathers * _ring_sent(whole_p, shards) +
                               _ring_sent(whole_g, shards))
    if cfg.dp > 1 and spans_hosts(cfg, cfg.tp * cfg.cp * cfg.fsdp, cfg.dp):
        out["dp"] = _ring_sent(max(stage_grads), cfg.dp, 2)
    if cfg.cp > 1 and not cfg.cp_shard and spans_hosts(cfg, cfg.tp, cfg.cp):
        out["cp_grad"] = _ring_sent(max(stage_grads), cfg.cp, 2)
    return out
