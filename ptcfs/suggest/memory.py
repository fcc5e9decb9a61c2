"""Memory per GPU of a mesh: model state exactly, activations by formula.

**State** (parameters, optimizer state, gradients) comes from the layout
itself: a rank holds ``slice.local_shape(spec.shape)`` of every tensor
:func:`~ptcfs.sharding.rank_tensors` gives it, the same bytes the planner
moves. Gradients are the parameters' local elements in the parameter's
dtype, or fp32 where the optimizer keeps an fp32 master copy.
:func:`rank_state` gives every rank's bytes from one pass per distinct
holder key (:func:`~ptcfs.sharding.placement_of`); :func:`stage_state`
gives each pipeline stage's largest rank without visiting the other ranks:
within a stage the rank with ``tp_rank = 0`` and data rank 0 holds the
first (so largest) tensor-parallel part and ``torch.chunk`` chunk of every
tensor it holds, and every other rank of the stage holds tensors of the
same shapes, so its bytes are the stage's maximum.

**Activations** per layer and micro-batch of ``b`` sequences of ``s``
tokens (``s`` divided by context parallelism), hidden ``h``, ``a`` heads of
which ``g·a`` carry keys and values (grouped-query attention), MLP width
``f``, counted as the 16-bit tensors that autograd keeps, tensor and
sequence parallelism over ``t`` ranks dividing them all (the derivation of
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", without dropout masks, for the attention and MLP of the model):

- ``none``: per token the two norms' inputs and outputs (``4h``), the
  query, key and value (``h + 2gh``), the attention output (``h``) and the
  MLP's hidden tensors (``4f`` gated: gate, up, activation, product;
  ``2f`` otherwise); with ``flash=False`` the attention scores and their
  softmax as well, ``2.5as`` elements (Korthikanti's ``5as`` bytes).
- ``selective``: the matrix multiplications' inputs and outputs only
  (``3h + 2gh`` and ``h + 2f`` gated, ``h + f`` otherwise); norms,
  activations and the attention core are recomputed (Megatron's selective
  recompute).
- ``op``: torchtitan's selective (per-op) checkpointing: the layer's
  input, attention's output, and the outputs of every other matrix
  multiplication in the order they run (the fused query/key/value
  projection, the gate and the down projection: ``4h + 2gh + f`` gated);
  the others (the attention output's and the up projection) and everything
  elementwise are recomputed, attention is not.
- ``full``: each layer's input (``h``), plus one layer's whole activations,
  live during its backward.

With ``runtime="megatron"`` (Megatron-Core's layers from Transformer
Engine) and no recomputation, as Transformer Engine's ``LayerNormLinear``,
``Linear`` and fused attention and Megatron-Core's fused SwiGLU save them:
the norms' inputs (``2h``) and outputs (``2h``, the next linear layer's
inputs), the query, key and value (``h + 2gh``), the attention output
(``h``, which the output projection keeps as its input), SwiGLU's input
(``2f``) and the down projection's input (``f``); under FP8 the linear
layers keep their inputs (the norms' outputs and the down projection's) in
FP8, half the bytes (``5h + 2gh + 2.5f`` 16-bit elements in all).

GPT's shapes (``f = 4h``, ``g = 1``) give ``30sbh`` bytes without
recomputation, Korthikanti's ``34sbh`` less the dropout masks.
**Activations are held per micro-batch in flight**, never per sample of
the step: with gradient accumulation and no pipeline one micro-batch is
live at a time; pipeline stage ``i`` of ``pp`` holds ``min(pp - i, m)``
micro-batches (1F1B), ``(1 + (pp - 1 - i)/(pp·vpp))`` times that with
``vpp`` virtual stages (the interleaved schedule's warm-up), and never more
than the step's ``m`` (with ``m = pp``, torchtitan's default, the
interleaved warm-up runs every forward before the first backward, and
holds what 1F1B holds). The last stage also holds the fp32 logits and
their gradient, ``8sbV/t``. With ``recv_buffers`` (torch.distributed.pipelining,
which allocates them once per micro-batch and keeps them), each chunk but
the model's first holds a receive buffer of its input per micro-batch, and
each but the last one of its output's gradient (``2sbh/t`` bytes each);
the inputs in flight are the activations above.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ptcfs.sharding import (
    HolderKey,
    chunk_of,
    holder_key,
    layout_of,
    placement_of,
    stage_chunks,
    stage_of,
)
from ptcfs.types import ModelSpec, ParallelConfig, ShardRule, Stage, TensorSpec

__all__ = ["Dims", "StateClasses", "RECOMPUTE", "dims_of", "rank_state", "stage_state",
           "activation_bytes", "token_layer_elements", "grad_itemsizes", "layer_matmuls"]

RECOMPUTE = ("none", "selective", "op", "full")


@dataclass(frozen=True)
class Dims:
    """The transformer's sizes that activations and FLOPs need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    experts: int = 0
    topk: int = 0
    ffn: int = 0
    gated: bool = False


def dims_of(model: ModelSpec, seq: int) -> Dims | None:
    """The model's sizes from its preset's params (None: a spec file without them)."""
    p = dict(model.params)
    need = ("hidden", "heads")
    if not all(isinstance(p.get(k), int) for k in need):
        return None

    def num(key: str, default: int) -> int:
        v = p.get(key, default)
        return v if isinstance(v, int) else default

    heads = num("heads", 1)
    vocab = num("vocab", 0) or max((t.shape[0] for t in model.tensors
                                    if t.rule.pad_multiple is not None), default=0)
    hidden = num("hidden", 1)
    gated = model.name in ("llama", "moe") or bool(num("swiglu", 0))
    return Dims(model.layers, hidden, heads, num("kv_heads", heads), vocab, seq,
                model.experts, num("topk", 0), num("ffn", 4 * hidden), gated)


def grad_itemsizes(model: ModelSpec) -> dict[str, int]:
    """Parameter name → bytes per element of its gradient."""
    masters = {t.name[len("optim/master/"):] for t in model.tensors + model.pp_only
               if t.name.startswith("optim/master/")}
    return {t.name: 4 if t.name in masters else t.itemsize
            for t in model.tensors + model.pp_only if not t.is_optim}


def _elems(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def rank_state(model: ModelSpec, cfg: ParallelConfig) -> list[tuple[int, int]]:
    """Every rank's ``(parameter and optimizer bytes, gradient bytes)``."""
    grads = grad_itemsizes(model)
    weights: dict[HolderKey, list[int]] = defaultdict(lambda: [0, 0])
    for spec in model.tensors_for(cfg.pp):
        w = weights[holder_key(model, cfg, spec)]
        w[0] += spec.itemsize
        w[1] += grads.get(spec.name, 0)
    out = [[0, 0] for _ in range(cfg.world)]
    for key, (ws, wg) in weights.items():
        for sl, hosts in placement_of(cfg, key).items():
            n = _elems(sl.local_shape(key.layout.shape))
            for ranks in hosts.values():
                for r in ranks:
                    out[r][0] += n * ws
                    out[r][1] += n * wg
    return [(s, g) for s, g in out]


@dataclass(frozen=True)
class _Member:
    stage: Stage
    expert: int | None
    param: int
    optim: int
    grad: int


class StateClasses:
    """A model's tensors grouped by what decides their layout (shape, rule
    without its stage, optimizer or not), for :func:`stage_state`: one
    layout per group and mesh instead of one per tensor."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        grads = grad_itemsizes(model)
        #: pp > 1 or not → group key → (prefix sums over layers of the dense
        #: members' bytes per element, the other members)
        self.groups: dict[bool, dict[tuple[object, ...],
                                     tuple[list[list[int]], list[_Member]]]] = {}
        for pp_many in (False, True):
            groups: dict[tuple[object, ...], tuple[list[list[int]], list[_Member]]] = {}
            for spec in model.tensors_for(2 if pp_many else 1):
                r = spec.rule
                key = (spec.shape, r.split_dim, r.groups, r.pad_multiple, r.expert is not None,
                       spec.is_optim, spec.dtype, r.parts)
                per_layer, others = groups.setdefault(
                    key, ([[0, 0, 0] for _ in range(model.layers)], []))
                param, optim = (0, spec.itemsize) if spec.is_optim else (spec.itemsize, 0)
                grad = grads.get(spec.name, 0)
                if isinstance(r.stage, int) and r.expert is None and 0 <= r.stage < model.layers:
                    w = per_layer[r.stage]
                    w[0] += param
                    w[1] += optim
                    w[2] += grad
                else:
                    others.append(_Member(r.stage, r.expert, param, optim, grad))
            for per_layer, _ in groups.values():  # prefix sums: row i sums layers < i
                run = [0, 0, 0]
                sums = [list(run)]
                for w in per_layer:
                    run = [a + b for a, b in zip(run, w)]
                    sums.append(run)
                per_layer[:] = sums
            self.groups[pp_many] = groups

    def chunk_state(self, cfg: ParallelConfig) -> list[list[tuple[int, int, int]]]:
        """Each stage's largest rank: ``(parameter, optimizer, gradient)``
        bytes of each of its model chunks, in order (one chunk without
        virtual stages)."""
        model = self.model
        chunks = stage_chunks(model.layers, cfg.pp, cfg.pp_layers, cfg.vpp)
        out = [[[0, 0, 0] for _ in rngs] for rngs in chunks]
        per_ep = model.experts // cfg.ep if model.experts else 0
        for key, (per_layer, others) in self.groups[cfg.pp > 1].items():
            shape, split_dim, groups, pad, expert, optim, dtype, parts = key
            rep = TensorSpec("x" if not optim else "optim/x", shape,  # type: ignore[arg-type]
                             dtype, ShardRule(split_dim, groups, pad,  # type: ignore[arg-type]
                                              expert=0 if expert else None,
                                              parts=parts))  # type: ignore[arg-type]
            layout = layout_of(rep, cfg)
            n = _elems(layout.slice(0, 0, 0).local_shape(layout.shape))
            for s, rngs in enumerate(chunks):
                for c, rng in enumerate(rngs):
                    hi, lo = per_layer[rng.stop], per_layer[rng.start]
                    for i in range(3):
                        out[s][c][i] += n * (hi[i] - lo[i])
            for m in others:
                if m.expert is not None and cfg.ep > 1 and m.expert // per_ep != 0:
                    continue
                s = stage_of(ShardRule(stage=m.stage), model.layers, cfg.pp, cfg.pp_layers,
                             cfg.vpp)
                w = out[s][chunk_of(m.stage, chunks[s])]
                w[0] += n * m.param
                w[1] += n * m.optim
                w[2] += n * m.grad
        return [[(a, b, c) for a, b, c in stage] for stage in out]

    def stage_state(self, cfg: ParallelConfig) -> list[tuple[int, int, int]]:
        """Each stage's largest rank: ``(parameter, optimizer, gradient)`` bytes."""
        return [(sum(c[0] for c in cs), sum(c[1] for c in cs), sum(c[2] for c in cs))
                for cs in self.chunk_state(cfg)]


def stage_state(model: ModelSpec, cfg: ParallelConfig) -> list[tuple[int, int, int]]:
    """:meth:`StateClasses.stage_state` for one mesh."""
    return StateClasses(model).stage_state(cfg)


def layer_matmuls(d: Dims) -> list[tuple[float, float]]:
    """A layer's matrix multiplications in the order they run, each as
    (output elements, parameters) per token: the fused query/key/value
    projection, the attention output's, then the MLP's (gate, up, down
    gated; in and out otherwise; the ``topk`` experts a token passes)."""
    h, f = d.hidden, d.ffn or 4 * d.hidden
    f = f * d.topk if d.experts and d.topk else f
    kv = 2 * h * d.kv_heads / d.heads
    mlp = [(f, h * f), (f, h * f), (h, f * h)] if d.gated else [(f, h * f), (h, f * h)]
    return [(h + kv, h * (h + kv)), (h, h * h)] + mlp


def token_layer_elements(d: Dims, recompute: str, seq: float, flash: bool = True,
                         runtime: str = "torch", float8: bool = False) -> float:
    """16-bit elements one token keeps in one layer (before tensor
    parallelism; see the module docstring)."""
    h, f = d.hidden, d.ffn or 4 * d.hidden
    kv = 2 * h * d.kv_heads / d.heads
    # a mixture-of-experts layer: a token passes through topk experts
    f = f * d.topk if d.experts and d.topk else f
    if recompute == "full":
        return float(h)
    if recompute == "op":  # the input, attention's output, every other matmul's
        return 2 * h + sum(out for out, _ in layer_matmuls(d)[0::2])
    scores = 0.0 if flash else 2.5 * d.heads * seq
    if runtime == "megatron" and recompute == "none":
        # Transformer Engine's layers (LayerNormLinear, Linear, fused
        # attention): the norms' inputs, and their outputs as the next linear
        # layer's inputs (in FP8 under float8, current scaling: half the
        # bytes); attention's query, key, value and output (the projection
        # keeps that same output as its input); Megatron-Core's fused SwiGLU
        # keeps its input (gate and up), the down projection its own input
        lin = 0.5 if float8 else 1.0
        mlp = (2 * f if d.gated else f) + lin * f
        return 2 * h + 2 * lin * h + h + kv + h + mlp + scores
    if recompute == "selective":
        return 3 * h + kv + h + (2 * f if d.gated else f)
    return 4 * h + h + kv + h + (4 * f if d.gated else 2 * f) + scores


def activation_bytes(d: Dims, cfg: ParallelConfig, micro: int, micro_batches: int,
                     recompute: str, flash: bool = True, recv_buffers: bool = False,
                     runtime: str = "torch", float8: bool = False) -> list[dict[str, float]]:
    """Each stage's activation terms in bytes (see the module docstring;
    ``recv_buffers``: the pipeline's receive buffers, one per micro-batch;
    ``runtime`` and ``float8``: as :class:`~ptcfs.suggest.search.Query`'s)."""
    s, b, t = d.seq / cfg.cp, micro, cfg.tp
    tokens = s * b
    per_layer = 2 * tokens * token_layer_elements(d, recompute, s, flash, runtime, float8) / t
    out = []
    for i, rngs in enumerate(stage_chunks(d.layers, cfg.pp, cfg.pp_layers, cfg.vpp)):
        inflight = float(min(cfg.pp - i, micro_batches))
        if cfg.vpp > 1 and cfg.pp > 1:  # never more than the step's micro-batches
            inflight = min(inflight * (1 + (cfg.pp - 1 - i) / (cfg.pp * cfg.vpp)),
                           micro_batches)
        terms = {"layers": sum(map(len, rngs)) * per_layer * inflight}
        if recv_buffers and cfg.pp > 1:
            # each chunk but the model's first receives its input, each but the
            # last its output's gradient, into a buffer per micro-batch kept
            # for the run; the inputs in flight are counted in "layers"
            chunks = len(rngs)
            inputs = chunks - (i == 0)
            grads = chunks - (i == cfg.pp - 1)
            one = 2 * tokens * d.hidden / t
            terms["recv_buffers"] = one * (grads * micro_batches +
                                           inputs * max(0.0, micro_batches - inflight))
        if recompute == "full":
            terms["recompute_working"] = 2 * tokens * token_layer_elements(
                d, "none", s, flash, runtime, float8) / t
        if i == cfg.pp - 1:
            terms["logits"] = 8 * tokens * d.vocab / t
        out.append(terms)
    return out
