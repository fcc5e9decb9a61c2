"""A small GPT with Megatron-style tensor parallelism, on torch.distributed.

Parameters carry the names ptcfs's GPT preset uses (global layer indices),
so a rank's state from ptcfs goes straight in (``load_into``) and comes
straight out (``state_of``):

- ``embedding.word_embeddings.weight`` ``[Vp/tp, H]``: vocabulary-parallel
  rows (``Vp`` = vocabulary padded to ``128·tp``); the output layer is tied
  to it, and the loss is computed across the vocabulary shards.
- ``self_attention.query_key_value`` ``[3H/tp, H]`` (column parallel, rows
  head by head: ``[heads/tp, 3, H/heads]``), ``self_attention.dense``
  ``[H, H/tp]`` (row parallel, bias added after the all-reduce); the MLP
  likewise (``dense_h_to_4h`` column, ``dense_4h_to_h`` row parallel).

Data parallelism averages gradients over the data-parallel group after
each backward pass. Pipeline parallelism runs each step's batch through
the stages one after another (send/recv of the hidden states forward and
their gradients backward; no micro-batch overlap) and sums the gradients
of the two copies of the tied embedding (first and last stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Groups", "GPT", "GPTShape", "make_groups", "train_step", "average_gradients",
           "init_value"]


@dataclass
class Groups:
    """This rank's place: its tensor-, data- and pipeline-parallel coordinates,
    groups (None when of size 1), pipeline neighbours and layers."""

    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    pp: int
    pp_rank: int
    layers: range  # global indices of this stage's layers
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    emb_group: dist.ProcessGroup | None  # first and last stage: the tied embedding
    prev: int | None  # global rank of the previous stage's peer
    next: int | None

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1


def make_groups(tp: int, dp: int, pp: int, layers: int) -> Groups:
    """Megatron order: rank = tp_rank + tp * (dp_rank + dp * pp_rank); the
    first ``layers % pp`` stages take one layer more. Every rank creates
    every group, in the same order, as torch.distributed requires."""
    rank = dist.get_rank()

    def at(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    def make(lists: list[list[int]], size: int) -> dist.ProcessGroup | None:
        mine = None
        for ranks in lists:
            g = dist.new_group(ranks) if size > 1 else None
            if rank in ranks:
                mine = g
        return mine

    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    tp_group = make([[at(x, y, z) for x in range(tp)] for z in range(pp) for y in range(dp)], tp)
    dp_group = make([[at(x, y, z) for y in range(dp)] for z in range(pp) for x in range(tp)], dp)
    emb_group = make([[at(x, y, 0), at(x, y, pp - 1)] for x in range(tp) for y in range(dp)],
                     2 if pp > 1 else 1)
    base, extra = divmod(layers, pp)
    start = p * base + min(p, extra)
    return Groups(tp, t, dp, d, pp, p, range(start, start + base + (p < extra)), tp_group,
                  dp_group, emb_group, at(t, d, p - 1) if p > 0 else None,
                  at(t, d, p + 1) if p < pp - 1 else None)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tp group."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[no-untyped-def,override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward over the tp group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[no-untyped-def,override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        return g, None


def copy_to_tp(x: torch.Tensor, g: Groups) -> torch.Tensor:
    return _CopyToTP.apply(x, g.tp_group) if g.tp_group is not None else x


def reduce_from_tp(x: torch.Tensor, g: Groups) -> torch.Tensor:
    return _ReduceFromTP.apply(x, g.tp_group) if g.tp_group is not None else x


@dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int

    @classmethod
    def parse(cls, text: str) -> GPTShape:
        """From a ptcfs preset text, ``gpt:layers=..,hidden=..,heads=..,vocab=..,seq=..``."""
        kv = dict(item.split("=") for item in text.partition(":")[2].split(",") if item)
        h = int(kv["hidden"])
        return cls(int(kv["layers"]), h, int(kv["heads"]), int(kv["vocab"]),
                   int(kv.get("seq", 2048)), int(kv.get("ffn", 4 * h)))


class _Weights(nn.Module):
    """A ``weight`` under a Megatron name."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class _Linear(_Weights):
    """A ``weight`` and a ``bias`` of ``bias`` elements."""

    def __init__(self, shape: tuple[int, ...], bias: int):
        super().__init__(shape)
        self.bias = nn.Parameter(torch.empty(bias))


class _Attention(nn.Module):
    def __init__(self, s: GPTShape, g: Groups):
        super().__init__()
        self.g = g
        self.heads = s.heads // g.tp
        self.head_dim = s.hidden // s.heads
        self.query_key_value = _Linear((3 * s.hidden // g.tp, s.hidden), 3 * s.hidden // g.tp)
        self.dense = _Linear((s.hidden, s.hidden // g.tp), s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = F.linear(copy_to_tp(x, self.g), self.query_key_value.weight,
                       self.query_key_value.bias)
        qkv = qkv.view(b, n, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return reduce_from_tp(F.linear(a, self.dense.weight), self.g) + self.dense.bias


class _MLP(nn.Module):
    def __init__(self, s: GPTShape, g: Groups):
        super().__init__()
        self.g = g
        self.dense_h_to_4h = _Linear((s.ffn // g.tp, s.hidden), s.ffn // g.tp)
        self.dense_4h_to_h = _Linear((s.hidden, s.ffn // g.tp), s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(copy_to_tp(x, self.g), self.dense_h_to_4h.weight,
                            self.dense_h_to_4h.bias))
        out = reduce_from_tp(F.linear(h, self.dense_4h_to_h.weight), self.g)
        return out + self.dense_4h_to_h.bias


class _Layer(nn.Module):
    def __init__(self, s: GPTShape, g: Groups):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(s.hidden)
        self.self_attention = _Attention(s, g)
        self.post_attention_layernorm = nn.LayerNorm(s.hidden)
        self.mlp = _MLP(s, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Embedding(nn.Module):
    def __init__(self, local_vocab: int, s: GPTShape):
        super().__init__()
        self.word_embeddings = _Weights((local_vocab, s.hidden))
        self.position_embeddings = _Weights((s.seq, s.hidden))


class _Encoder(nn.Module):
    def __init__(self, s: GPTShape, g: Groups):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Layer(s, g) for i in g.layers})
        if g.last:
            self.final_layernorm = nn.LayerNorm(s.hidden)


class GPT(nn.Module):
    """One rank of the model: its pipeline stage's layers, its tensor-parallel
    part of each (uninitialised: load it). The first stage has the
    embedding; the last the final layer norm and the output layer, tied to
    the embedding (its own ``word_embeddings_for_head`` when pp > 1)."""

    def __init__(self, s: GPTShape, g: Groups):
        super().__init__()
        self.s, self.g = s, g
        step = 128 * g.tp
        self.padded = -(-s.vocab // step) * step
        self.local_vocab = self.padded // g.tp
        if g.first:
            self.embedding = _Embedding(self.local_vocab, s)
        self.encoder = _Encoder(s, g)
        if g.last and not g.first:
            self.word_embeddings_for_head = _Weights((self.local_vocab, s.hidden))

    def tied(self) -> nn.Parameter:
        """This stage's copy of the tied embedding."""
        if self.g.first:
            return self.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The first stage takes tokens ``[b, n]``, the others the previous
        stage's hidden states; the last returns the mean next-token cross
        entropy, the others their hidden states."""
        lo = self.g.tp_rank * self.local_vocab
        if self.g.first:
            w = self.embedding.word_embeddings.weight
            inside = (x >= lo) & (x < lo + self.local_vocab)
            emb = F.embedding(torch.where(inside, x - lo, 0), w) * inside[..., None]
            x = reduce_from_tp(emb, self.g)
            x = x + self.embedding.position_embeddings.weight[: x.shape[1]]
        for layer in self.encoder.layers.values():
            x = layer(x)
        if not self.g.last:
            return x
        x = self.encoder.final_layernorm(x)
        logits = F.linear(copy_to_tp(x, self.g), self.tied())
        return self._loss(logits, targets, lo)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, lo: int) -> torch.Tensor:
        """Cross entropy over vocabulary shards; padding columns count as -inf."""
        cols = torch.arange(lo, lo + self.local_vocab)
        logits = logits.masked_fill(cols >= self.s.vocab, float("-inf"))
        top = logits.detach().amax(-1)
        if self.g.tp_group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.g.tp_group)
        shifted = logits - top[..., None]
        total = reduce_from_tp(shifted.exp().sum(-1), self.g)
        inside = (targets >= lo) & (targets < lo + self.local_vocab)
        picked = shifted.gather(-1, torch.where(inside, targets - lo, 0)[..., None])[..., 0]
        target = reduce_from_tp(torch.where(inside, picked, 0.0), self.g)
        return (total.log() - target).mean()


def train_step(model: GPT, g: Groups, rows: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one batch of token rows ``[b, n+1]`` through
    the pipeline (one micro-batch: stage by stage forward, then backward);
    the loss on the last stage, 0 elsewhere."""
    tokens, targets = rows[:, :-1], rows[:, 1:]
    x: torch.Tensor = tokens
    if not g.first:
        x = torch.empty(*tokens.shape, model.s.hidden)
        dist.recv(x, g.prev)
        x.requires_grad_()
    out = model(x, targets)
    if g.last:
        out.backward()
        loss = out.detach()
    else:
        dist.send(out.detach().contiguous(), g.next)
        grad = torch.empty_like(out)
        dist.recv(grad, g.next)
        out.backward(grad)
        loss = torch.zeros(())
    if not g.first and x.grad is not None:
        dist.send(x.grad.contiguous(), g.prev)
    if g.emb_group is not None:  # both copies of the tied embedding take the summed gradient
        w = model.tied()
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=g.emb_group)
    return loss


def average_gradients(model: nn.Module, g: Groups) -> None:
    """Average gradients over the data-parallel group, in one all-reduce."""
    if g.dp_group is None:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([x.reshape(-1) for x in grads])
    dist.all_reduce(flat, group=g.dp_group)
    flat /= g.dp
    at = 0
    for x in grads:
        x.copy_(flat[at:at + x.numel()].view_as(x))
        at += x.numel()


def init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic initial value of a logical tensor: normal(0, 0.02)
    weights (scaled down for output projections), unit layer-norm weights,
    zero biases."""
    if name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)) * 7919
                                        + len(name))
    std = 0.02
    if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
        std /= math.sqrt(2.0)
    return torch.randn(shape, generator=gen) * std
