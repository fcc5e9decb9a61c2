"""Every valid mesh for a job, each with its estimated memory, step time and
bytes sent between hosts; the Pareto front of the three, and the mesh a
policy picks.

The search, in order:

1. :func:`meshes` enumerates degrees (``tp`` dividing every host's GPUs, so
   a tensor-parallel group stays in one host; ``pp·dp·fsdp·cp·tp`` = all the
   GPUs; the global batch splitting into whole micro-batches
   (:func:`micro_size`); ``cp`` dividing half
   the sequence; with ``cp > 1`` the layouts ``Query.cp_shard`` allows
   (context-parallel replicas, ``cp_shard=0``, as Megatron-Core keeps them,
   or FSDP over ``fsdp·cp``, ``cp_shard=1``, as torchtitan shards; None:
   both); ``ep`` dividing the experts and ``dp·fsdp``; ``zero=1``
   where there are replicas and optimizer state; with ``pp > 1`` the
   virtual stages ``vpp`` of :data:`VPP_CHOICES` that leave every chunk a
   layer, where the micro-batches are a multiple of ``pp`` (the interleaved
   schedule's rule in Megatron-LM and torchtitan)), and keeps what
   :func:`~ptcfs.sharding.validate` accepts;
2. :func:`estimate` gives each its memory per GPU
   (:mod:`ptcfs.suggest.memory`: state exact, one layout per group of
   tensors), step time (:mod:`ptcfs.suggest.steptime`) and the bytes a
   GPU sends between hosts per step (:mod:`ptcfs.suggest.traffic`);
3. with the job's current mesh (``Query.old``), the reconfiguration's
   cross-host bytes (:func:`~ptcfs.plan.planner.min_cross_host_bytes`) over the
   inter-host bandwidth of every receiving host, amortised over
   ``horizon`` steps, is added to the step time of the meshes within
   :data:`MOVE_WINDOW` of the fastest that fits;
4. :func:`pareto` keeps the meshes no other :func:`dominates` in
   :data:`OBJECTIVES`, and :func:`pick` chooses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ptcfs.errors import InvalidConfig
from ptcfs.plan.planner import min_cross_host_bytes
from ptcfs.sharding import stage_chunks, validate
from ptcfs.suggest.device import Device
from ptcfs.suggest.memory import RECOMPUTE, StateClasses, activation_bytes, dims_of
from ptcfs.suggest.steptime import StepInput, matmul_params, step_time
from ptcfs.suggest.traffic import inter_host_bytes
from ptcfs.types import DTYPE_SIZES, Host, ModelSpec, ParallelConfig

__all__ = ["DEGREES", "VPP_CHOICES", "POLICIES", "FSDP_PIPELINE", "RUNTIMES", "GRAD_DTYPES",
           "MEMORY_RESERVE", "MOVE_WINDOW",
           "OBJECTIVES", "MICROBATCHING", "Query", "Estimate", "Suggestion", "meshes",
           "micro_size", "estimate", "objectives", "dominates", "pareto", "pick", "suggest"]

DEGREES = ("tp", "pp", "dp", "fsdp", "cp", "ep", "zero", "vpp")
#: Virtual stages per pipeline stage the search tries (interleaved 1F1B).
VPP_CHOICES = (1, 2, 4, 8)
POLICIES = ("fastest-that-fits", "least-moved")
#: How FSDP runs under a pipeline (see :attr:`Query.fsdp_pipeline`).
FSDP_PIPELINE = ("step", "micro")
#: The training runtimes whose memory differs (see :attr:`Query.runtime`).
RUNTIMES = ("torch", "megatron")
#: The gradients' dtypes a run may keep (see :attr:`Query.grad_dtype`).
GRAD_DTYPES = ("bf16", "fp32")
#: Fraction of GPU memory left for the framework, allocator and buffers.
MEMORY_RESERVE = 0.1
#: Reconfiguration costs are computed for meshes at most this much slower
#: than the fastest that fits (the others cannot win).
MOVE_WINDOW = 2.0
#: How a data-parallel rank's batch splits into micro-batches (see
#: :attr:`Query.pp_microbatches`).
MICROBATCHING = ("size", "stages")
#: What the front trades, each the less the better (see :func:`objectives`).
OBJECTIVES = ("amortised step seconds", "memory bytes per GPU", "inter-host bytes per GPU")


@dataclass(frozen=True)
class Query:
    """A job: its model, the GPUs it has, its batch and what it may use."""

    model: ModelSpec
    hosts: tuple[Host, ...]
    batch: int
    seq: int
    device: Device
    micro: int = 1
    recompute: str = "none"
    allow: tuple[str, ...] = DEGREES
    max_tp: int = 0
    max_pp: int = 0
    old: ParallelConfig | None = None
    horizon: int = 1000
    #: attention without stored scores (FlashAttention, SDPA's fused kernels)
    flash: bool = True
    #: the layout where ``cp > 1``: 0, context-parallel replicas (Megatron-Core);
    #: 1, FSDP over ``fsdp·cp`` (torchtitan's ``dp_shard_cp``); None: try both
    cp_shard: int | None = None
    #: linear layers trained in Float8 (torchao), their matrix multiplications faster
    float8: bool = False
    #: tensor parallelism's collectives overlapped with its matrix multiplications
    async_tp: bool = False
    #: FSDP under a pipeline: "step", torch.distributed.pipelining's (torchtitan):
    #: a stage's parameters gathered at its first forward and kept for the step,
    #: its gradients accumulated whole in fp32 and reduced once after the last
    #: backward; "micro", Llama 3's: parameters kept gathered from each
    #: micro-batch's forward to its backward, gradients reduced per micro-batch.
    #: With virtual stages and one round of micro-batches (``m < 2·pp``, as
    #: torchtitan's ``m = pp``) the interleaved schedule runs each chunk's
    #: backwards together, last chunk first, and reduces its gradients after
    #: its last (torch.distributed.pipelining's REDUCE_GRAD): one chunk's are whole
    fsdp_pipeline: str = "step"
    #: the pipeline's sends and receives posted asynchronously (Llama 3, §3.3.2)
    async_p2p: bool = False
    #: how each data-parallel rank's batch splits into micro-batches: "size",
    #: micro-batches of ``micro`` sequences; "stages", torchtitan's default
    #: (2024: ``--experimental.pipeline_parallel_microbatches`` unset "will be the
    #: number of pipeline stages"; no gradient accumulation): as many as the
    #: pipeline has stages, and one without a pipeline
    pp_microbatches: str = "size"
    #: elementwise operations unfused (eager PyTorch, no torch.compile): they
    #: move :data:`~ptcfs.suggest.steptime.EAGER_ELEMENTWISE` times the bytes
    eager: bool = False
    #: the runtime that trains the model, where it changes what a GPU holds:
    #: "torch" (torchtitan: torch.distributed.pipelining keeps a receive
    #: buffer per micro-batch; autograd keeps SwiGLU's gate, up, activation
    #: and product; torchao's Float8 keeps the linear layers' inputs in
    #: 16 bits); "megatron" (Megatron-Core with Transformer Engine: its
    #: pipeline allocates each receive as it comes; its fused SwiGLU keeps its
    #: input only; under FP8 the linear layers keep their inputs in FP8)
    runtime: str = "torch"
    #: the gradients' dtype ("bf16", "fp32"); "" as the optimizer keeps its
    #: master copy (fp32 with one: FSDP2's fp32 reduction, Megatron-LM's
    #: default under bf16). Megatron-Core's ``grad_reduce_in_fp32`` off: "bf16"
    grad_dtype: str = ""


@dataclass
class Estimate:
    """One mesh's estimates: bytes per GPU (its fullest stage) and seconds."""

    config: ParallelConfig
    memory: float
    memory_terms: dict[str, float]
    step: float
    step_terms: dict[str, float]
    fits: bool
    move_bytes: int | None = None
    move_seconds: float | None = None
    #: bytes a GPU sends between hosts per step, by kind (:mod:`ptcfs.suggest.traffic`)
    inter_host_terms: dict[str, float] = field(default_factory=dict)

    @property
    def amortised(self) -> float:
        """Step time plus the reconfiguration's time over the horizon's steps."""
        return self.step + self.step_terms.get("move_amortised", 0.0)

    @property
    def inter_host(self) -> float:
        """Bytes a GPU sends between hosts per step."""
        return sum(self.inter_host_terms.values())


@dataclass
class Suggestion:
    """Every estimate, the front (fastest first) and the fastest that fits."""

    query: Query
    estimates: list[Estimate]
    front: list[Estimate]
    best: Estimate | None
    notes: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_size(q: Query, data: int, pp: int) -> int:
    """Sequences per micro-batch with ``data`` data-parallel ranks (``dp·fsdp``)
    and ``pp`` stages, by ``q.pp_microbatches``; 0 where the batch does not
    split into whole ones."""
    if q.pp_microbatches == "size":
        return q.micro if q.batch % (data * q.micro) == 0 else 0
    count = data * pp
    return q.batch // count if q.batch % count == 0 else 0


def meshes(q: Query) -> Iterator[ParallelConfig]:
    """Step 1: every valid mesh over all of ``q.hosts``' GPUs."""
    model, world = q.model, sum(h.gpus for h in q.hosts)
    allowed = set(q.allow)
    per_host = math.gcd(*(h.gpus for h in q.hosts))
    has_optim = any(t.is_optim for t in model.tensors)
    checked: dict[tuple[int, int], bool] = {}
    for tp in _divisors(per_host):
        if tp > 1 and ("tp" not in allowed or (q.max_tp and tp > q.max_tp)):
            continue
        for pp in _divisors(world // tp):
            if pp > 1 and ("pp" not in allowed or pp > model.layers or
                           (q.max_pp and pp > q.max_pp)):
                continue
            rest = world // (tp * pp)
            for cp in _divisors(rest):
                if cp > 1 and ("cp" not in allowed or q.seq % (2 * cp)):
                    continue
                data = rest // cp
                if not micro_size(q, data, pp):
                    continue
                yield from _data_meshes(q, tp, pp, cp, data, has_optim, checked)


def _data_meshes(q: Query, tp: int, pp: int, cp: int, data: int, has_optim: bool,
                 checked: dict[tuple[int, int], bool]) -> Iterator[ParallelConfig]:
    allowed, model = set(q.allow), q.model
    for fsdp in _divisors(data):
        dp = data // fsdp
        if (fsdp > 1 and "fsdp" not in allowed) or (dp > 1 and "dp" not in allowed):
            continue
        eps = [1] + ([e for e in _divisors(math.gcd(model.experts, data)) if e > 1]
                     if model.experts and "ep" in allowed else [])
        for ep in eps:
            if fsdp % ep and ep % fsdp:
                continue
            zeros = (0, 1) if dp > 1 and has_optim and "zero" in allowed else (0,)
            micro_batches = q.batch // (data * micro_size(q, data, pp))
            vpps = [v for v in VPP_CHOICES if v == 1 or (
                "vpp" in allowed and pp > 1 and pp * v <= model.layers and
                micro_batches % pp == 0)]
            layouts = (0,) if cp == 1 else (0, 1) if q.cp_shard is None else (q.cp_shard,)
            for zero, vpp, cs in ((z, v, c) for z in zeros for v in vpps for c in layouts):
                cfg = ParallelConfig(tp, pp, dp, q.hosts, fsdp, cp, ep, zero, vpp=vpp,
                                     cp_shard=cs)
                key = (tp, pp)
                try:
                    if key in checked:  # the per-tensor checks depend on tp and pp only
                        if not checked[key]:
                            continue
                        validate(replace(model, tensors=(), pp_only=()), cfg)
                    else:
                        checked[key] = False
                        validate(model, cfg)
                        checked[key] = True
                except InvalidConfig:
                    continue
                yield cfg


def estimate(q: Query, cfg: ParallelConfig, classes: StateClasses,
             n_matmul: float | None = None) -> Estimate:
    """Step 2 for one mesh (``classes`` and ``n_matmul``: of ``q.model``, kept
    between meshes)."""
    dims = dims_of(q.model, q.seq)
    n = matmul_params(q.model) if n_matmul is None else n_matmul
    micro = micro_size(q, cfg.data_parallel, cfg.pp)
    if not micro:
        raise InvalidConfig(f"{cfg.degrees_text()}: the batch of {q.batch} does not split "
                            f"into whole micro-batches ({q.pp_microbatches!r})")
    m = q.batch // (cfg.data_parallel * micro)
    chunks = classes.chunk_state(cfg)
    if q.grad_dtype:  # one gradient element per parameter element, in grad_dtype
        size = next(t.itemsize for t in q.model.tensors if not t.is_optim)
        chunks = [[(p, o, p * DTYPE_SIZES[q.grad_dtype] // size) for p, o, _ in cs]
                  for cs in chunks]
    state = [tuple(map(sum, zip(*cs))) for cs in chunks]
    acts = activation_bytes(dims, cfg, micro, m, q.recompute, q.flash,
                            q.runtime == "torch" and q.fsdp_pipeline == "step",
                            q.runtime, q.float8) if dims else [{} for _ in range(cfg.pp)]
    layers = [sum(map(len, rs)) for rs in stage_chunks(q.model.layers, cfg.pp, cfg.pp_layers,
                                                        cfg.vpp)]
    per_stage = []
    for (params, optim, grads), act, held, own in zip(state, acts, layers, chunks):
        terms: dict[str, float] = {"parameters": params, "optimizer": optim, "gradients": grads}
        terms.update({f"activations_{k}": v for k, v in act.items()})
        if cfg.fsdp_shards > 1 and cfg.pp > 1:  # the stage's, kept gathered (see Query)
            terms["fsdp_gathered"] = params * cfg.fsdp_shards
            if q.fsdp_pipeline == "step":  # gradients accumulated whole (their shard
                # exists once they are reduced, after the last backward); in one
                # round of the interleaved schedule a chunk's backwards all run
                # before the next chunk's, so one chunk's are whole at a time
                whole = max(c[2] for c in own) if cfg.vpp > 1 and m < 2 * cfg.pp else grads
                terms["fsdp_unsharded_grads"] = whole * (cfg.fsdp_shards - 1)
        elif cfg.fsdp_shards > 1:  # two layers' parameters gathered at a time (one prefetched)
            terms["fsdp_gathered"] = 2 * params * cfg.fsdp_shards / max(1, held)
        per_stage.append(terms)
    fullest = max(per_stage, key=lambda t: sum(t.values()))
    memory = sum(fullest.values())
    x = StepInput(q.model, dims, q.device, q.batch, q.seq, micro, q.recompute, n,
                  q.float8, q.async_tp, q.fsdp_pipeline, q.async_p2p, q.eager)
    stage_p, stage_g = [s[0] for s in state], [s[2] for s in state]
    steps = step_time(x, cfg, stage_p, stage_g)
    return Estimate(cfg, memory, fullest, sum(steps.values()), steps,
                    memory <= q.device.memory * (1 - MEMORY_RESERVE),
                    inter_host_terms=inter_host_bytes(x, cfg, stage_p, stage_g))


def _add_moves(q: Query, ests: list[Estimate]) -> None:
    """Step 3."""
    if q.old is None:
        return
    fits = [e.step for e in ests if e.fits]
    limit = min(fits) * MOVE_WINDOW if fits else math.inf
    receivers = max(1, len(q.hosts))
    for e in ests:
        if e.step > limit:
            continue
        moved = min_cross_host_bytes(q.model, q.old, e.config)
        e.move_bytes = moved
        e.move_seconds = moved / (q.device.inter_host * receivers)
        e.step_terms["move_amortised"] = e.move_seconds / max(1, q.horizon)


def objectives(e: Estimate) -> tuple[float, float, float]:
    """``e``'s values of :data:`OBJECTIVES`."""
    return (e.amortised, e.memory, e.inter_host)


def dominates(a: Estimate, b: Estimate) -> bool:
    """Whether ``a`` is no worse than ``b`` in every objective and better in one."""
    va, vb = objectives(a), objectives(b)
    return all(x <= y for x, y in zip(va, vb)) and va != vb


def pareto(ests: list[Estimate]) -> list[Estimate]:
    """The meshes no other :func:`dominates` (of meshes with equal objectives,
    the first), fastest first."""
    out: list[Estimate] = []
    for e in sorted(ests, key=objectives):
        # a mesh that dominates e sorts before it, and is on the front or
        # dominated by a mesh that is
        v = objectives(e)
        if not any(all(x <= y for x, y in zip(objectives(f), v)) for f in out):
            out.append(e)
    return out


def pick(ests: list[Estimate], policy: str) -> Estimate | None:
    """The mesh ``policy`` picks among those that fit (None: none fits)."""
    if policy not in POLICIES:
        raise InvalidConfig(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    fits = [e for e in ests if e.fits]
    if not fits:
        return None
    if policy == "least-moved":
        return min(fits, key=lambda e: (e.move_bytes if e.move_bytes is not None else math.inf,
                                        e.amortised))
    return min(fits, key=lambda e: (e.amortised, e.memory))


def suggest(q: Query, policy: str = "fastest-that-fits") -> Suggestion:
    """Steps 1-4."""
    if q.recompute not in RECOMPUTE:
        raise InvalidConfig(f"recompute={q.recompute!r}: use one of {', '.join(RECOMPUTE)}")
    for name in ("batch", "seq", "micro", "horizon"):
        if getattr(q, name) < 1:
            raise InvalidConfig(f"{name}={getattr(q, name)} must be at least 1")
    if q.fsdp_pipeline not in FSDP_PIPELINE:
        raise InvalidConfig(f"fsdp_pipeline={q.fsdp_pipeline!r}: use one of "
                            f"{', '.join(FSDP_PIPELINE)}")
    if q.runtime not in RUNTIMES:
        raise InvalidConfig(f"runtime={q.runtime!r}: use one of {', '.join(RUNTIMES)}")
    if q.grad_dtype not in ("", *GRAD_DTYPES):
        raise InvalidConfig(f"grad_dtype={q.grad_dtype!r}: use one of {', '.join(GRAD_DTYPES)}")
    if q.pp_microbatches not in MICROBATCHING:
        raise InvalidConfig(f"pp_microbatches={q.pp_microbatches!r}: use one of "
                            f"{', '.join(MICROBATCHING)}")
    if q.cp_shard not in (None, 0, 1):
        raise InvalidConfig(f"cp_shard={q.cp_shard}: use 0 (context-parallel replicas), "
                            "1 (FSDP over fsdp*cp) or None (either)")
    classes = StateClasses(q.model)
    n = matmul_params(q.model)
    ests = [estimate(q, cfg, classes, n) for cfg in meshes(q)]
    if not ests:
        raise InvalidConfig(
            f"no mesh of {sum(h.gpus for h in q.hosts)} GPUs suits this model and batch "
            f"{q.batch} (dp*fsdp*micro-batch must divide the batch"
            + (", with as many micro-batches as stages)" if q.pp_microbatches == "stages"
               else ")"))
    _add_moves(q, ests)
    notes = [] if dims_of(q.model, q.seq) else [
        "the model has no hidden/heads params (a spec file): activations are left out "
        "and attention FLOPs are not counted"]
    return Suggestion(q, ests, pareto(ests), pick(ests, policy), notes)
