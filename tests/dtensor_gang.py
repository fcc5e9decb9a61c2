"""A tiny LLaMA in plain torch, parallelized with FSDP2 and tensor parallelism
on a gloo DeviceMesh, and a way to run a function on N gloo processes.

The module's parameter names are those of Hugging Face ``LlamaForCausalLM``
(the ``llama:...,names=hf`` preset): ``model.embed_tokens``, per layer
``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, then
``model.norm`` and ``lm_head``. :func:`gang` starts the processes from a
fork server that imported torch once.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN = 2, 32, 4, 2, 126, 40
PRESET = (f"llama:layers={LAYERS},hidden={HIDDEN},heads={HEADS},kv_heads={KV_HEADS},"
          f"vocab={VOCAB},ffn={FFN},names=hf")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hd = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.hd, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.hd, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.hd, bias=False)
        self.o_proj = nn.Linear(HEADS * self.hd, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # heads of this rank: -1 (tensor parallelism splits them)
        q, k, v = (f(x).view(b, t, -1, self.hd).transpose(1, 2)
                   for f in (self.q_proj, self.k_proj, self.v_proj))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = nn.RMSNorm(HIDDEN)


class TinyLlama(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.model = Body(layers)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def parallel_llama(mesh: Any, seed: int) -> TinyLlama:
    """A TinyLlama initialised from ``seed`` (the same on every rank), with
    tensor parallelism on the mesh's ``tp`` dimension when it has one
    (column-parallel q/k/v/gate/up/lm_head, row-parallel o/down, the
    embedding split by rows) and FSDP2 on its ``dp_shard``/``fsdp`` one."""
    torch.manual_seed(seed)
    return _parallelize(TinyLlama(), mesh)


def stage_llama(mesh: Any, seed: int, layers: int, keep: list[int], first: bool,
                last: bool) -> TinyLlama:
    """One pipeline stage of a ``layers``-layer TinyLlama initialised from
    ``seed``, as torchtitan's pipeline split leaves it: the layers ``keep``
    under their global numbers (a ModuleDict), the embedding only when
    ``first``, the final norm and ``lm_head`` only when ``last``;
    parallelized on ``mesh``'s other dimensions as :func:`parallel_llama`
    does. No forward: the test needs its state only."""
    torch.manual_seed(seed)
    m = TinyLlama(layers)
    m.model.layers = nn.ModuleDict({str(i): m.model.layers[i] for i in keep})  # type: ignore[assignment]
    if not first:
        m.model.embed_tokens = None  # type: ignore[assignment]
    if not last:
        m.model.norm = m.lm_head = None  # type: ignore[assignment]
    return _parallelize(m, mesh)


def _parallelize(m: TinyLlama, mesh: Any) -> TinyLlama:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    names = mesh.mesh_dim_names
    layers = m.model.layers
    ids = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    if "tp" in names:
        plan: dict[str, Any] = {}
        if m.model.embed_tokens is not None:
            plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                                         output_layouts=Replicate())
        if m.lm_head is not None:
            plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        for i in ids:
            p = f"model.layers.{i}."
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "mlp.gate_proj", "mlp.up_proj"):
                plan[p + n] = ColwiseParallel()
            plan[p + "self_attn.o_proj"] = RowwiseParallel()
            plan[p + "mlp.down_proj"] = RowwiseParallel()
        parallelize_module(m, mesh["tp"], plan)
    shard = next((n for n in names if n in ("dp_shard", "fsdp")), None)
    if shard is not None:
        for layer in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
            fully_shard(layer, mesh=mesh[shard])
        fully_shard(m, mesh=mesh[shard])
    return m


def train_step(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One AdamW step on a batch fixed by ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g).to(next(m.parameters()).device)
    logits = m(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def _run(fn: Callable[..., None], rank: int, world: int, store: str, args: tuple,
         backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


#: numbers each gang's rendezvous file: a second gang of one function in one
#: folder must not find the first one's (gloo then connects to ranks gone)
_GANGS = itertools.count()


def gang(fn: Callable[..., None], world: int, tmp: Path, *args: Any,
         timeout_s: float = 180, daemon: bool = True, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes (or of
    ``backend``) and wait for them; AssertionError naming the exit codes
    when any fails. ``fn`` must be a module-level function of a module the
    fork server can import; ``daemon=False`` lets it start processes of its
    own (killed all the same when the gang ends)."""
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo too: a torch optimizer imports it when it is built, seconds
    # of CPU in every rank otherwise
    ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", "torch._dynamo",
                                "torch.distributed.fsdp", __name__, fn.__module__])
    store = tmp / f"store-{fn.__name__}-{world}-{os.getpid()}-{next(_GANGS)}"  # one per gang
    procs = [ctx.Process(target=_run, args=(fn, r, world, str(store), args, backend),
                         daemon=daemon)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"{fn.__name__} on {world} ranks exited with {codes}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
