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
each backward pass. Pipeline parallelism is not implemented here (pp=1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Groups", "GPT", "GPTShape", "make_groups", "average_gradients", "init_value"]


@dataclass
class Groups:
    """This rank's tensor- and data-parallel groups (None when of size 1)."""

    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None


def make_groups(tp: int, dp: int) -> Groups:
    """Megatron order: rank = tp_rank + tp * dp_rank. Every rank creates every
    group, in the same order, as torch.distributed requires."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for d in range(dp):
        ranks = [t + tp * d for t in range(tp)]
        g = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            tp_group = g
    for t in range(tp):
        ranks = [t + tp * d for d in range(dp)]
        g = dist.new_group(ranks) if dp > 1 else None
        if rank in ranks:
            dp_group = g
    return Groups(tp, rank % tp, dp, rank // tp, tp_group, dp_group)


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
        self.layers = nn.ModuleDict({str(i): _Layer(s, g) for i in range(s.layers)})
        self.final_layernorm = nn.LayerNorm(s.hidden)


class GPT(nn.Module):
    """One tensor-parallel rank of the model (uninitialised: load it)."""

    def __init__(self, s: GPTShape, g: Groups):
        super().__init__()
        self.s, self.g = s, g
        step = 128 * g.tp
        self.padded = -(-s.vocab // step) * step
        self.local_vocab = self.padded // g.tp
        self.embedding = _Embedding(self.local_vocab, s)
        self.encoder = _Encoder(s, g)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over ``tokens`` ``[b, n]``."""
        lo = self.g.tp_rank * self.local_vocab
        w = self.embedding.word_embeddings.weight
        inside = (tokens >= lo) & (tokens < lo + self.local_vocab)
        emb = F.embedding(torch.where(inside, tokens - lo, 0), w) * inside[..., None]
        x = reduce_from_tp(emb, self.g)
        x = x + self.embedding.position_embeddings.weight[: tokens.shape[1]]
        for layer in self.encoder.layers.values():
            x = layer(x)
        x = self.encoder.final_layernorm(x)
        logits = F.linear(copy_to_tp(x, self.g), w)
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
