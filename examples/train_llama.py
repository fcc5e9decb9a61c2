"""Train a small LLaMA parallelized with FSDP2 and tensor parallelism on a
DeviceMesh, its state in ptcfs through the training face.

Launch with torchrun, one process per worker; every worker needs
``PTC_CLUSTER`` (the cluster file) and ``PTC_HOST`` (its host's name in
it)::

    PTC_CLUSTER=cluster.toml PTC_HOST=h0 torchrun --nproc-per-node=4 \\
        examples/train_llama.py --job llama --data tokens.npy --steps 40

The mesh is ``("dp_shard", "tp")``: ``tp = --tp`` when that leaves at
least two FSDP ranks (4 workers: fsdp=2,tp=2), else 1 (2 workers: fsdp=2;
3: fsdp=3). The tensor-parallel plan is applied even when ``tp`` is 1, so
every start derives the same spec from the module. ptcfs is one import
(``ptcfs.client.torch``) and three calls: on every start (and elastic
restart) ``ptc.attach`` creates the job from the module's own initial
values, or resumes it, or reconfigures it to the mesh of this start, and
loads every worker's shards; every ``--save-every`` steps ``job.save(step)``
saves the step, committed in the background (which also moves the dataset's
read position), the next save and ``job.close()`` waiting for it;
``job.data`` gives each worker its samples of a step.

Data and metrics as in ``train_gpt.py`` (``--data FILE`` or ``--data-view
DIR`` with ``{host}``; ``--metrics`` JSON lines of rank 0): the samples of a
step are dealt to the ``fsdp`` data ranks and do not depend on the
configuration, so ``compare_losses.py`` compares two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ptcfs.client.torch as ptc

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN = 2, 64, 4, 2, 256, 128


class Block(nn.Module):
    """One decoder layer, Hugging Face names: attention with grouped
    key/value heads (heads of this rank: ``-1``, tensor parallelism splits
    them) and a SwiGLU MLP, each after an RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.hd = HIDDEN // HEADS
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.self_attn = nn.Module()
        for n, rows in (("q_proj", HEADS), ("k_proj", KV_HEADS), ("v_proj", KV_HEADS)):
            self.self_attn.add_module(n, nn.Linear(HIDDEN, rows * self.hd, bias=False))
        self.self_attn.add_module("o_proj", nn.Linear(HEADS * self.hd, HIDDEN, bias=False))
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.add_module("gate_proj", nn.Linear(HIDDEN, FFN, bias=False))
        self.mlp.add_module("up_proj", nn.Linear(HIDDEN, FFN, bias=False))
        self.mlp.add_module("down_proj", nn.Linear(FFN, HIDDEN, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, h = self.self_attn, self.input_layernorm(x)
        b, t, _ = x.shape
        q, k, v = (f(h).view(b, t, -1, self.hd).transpose(1, 2)
                   for f in (a.q_proj, a.k_proj, a.v_proj))
        rep = q.shape[1] // k.shape[1]
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
        x = x + a.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        m, h = self.mlp, self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.add_module("embed_tokens", nn.Embedding(VOCAB, HIDDEN))
        self.model.add_module("layers", nn.ModuleList(Block() for _ in range(LAYERS)))
        self.model.add_module("norm", nn.RMSNorm(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def parallelize(m: Llama, mesh: Any) -> Llama:
    """torchtitan's plan: column-parallel q/k/v/gate/up/lm_head, row-parallel
    o/down, the embedding split by rows; then FSDP2 per layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(LAYERS):
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{n}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(m, mesh["tp"], plan)
    names = mesh.mesh_dim_names or ()
    data = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
    for layer in m.model.layers:
        fully_shard(layer, mesh=data)  # HSDP where the mesh has replicas
    fully_shard(m, mesh=data)
    return m


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True)
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", type=Path, help="tokens .npy [samples, seq+1]")
    data.add_argument("--data-view", metavar="DIR",
                      help="a /ptc mount ({host}: this worker's PTC_HOST) with the job's dataset")
    p.add_argument("--tp", type=int, default=2, help="preferred tensor parallelism")
    p.add_argument("--batch", type=int, default=12, help="global batch (samples per step)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--exit-after", type=int, help="stop after this step without saving it")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--metrics", type=Path, help="JSON lines, appended by rank 0")
    p.add_argument("--cluster", default=os.environ.get("PTC_CLUSTER"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    log = open(args.metrics, "a") if args.metrics and dist.get_rank() == 0 else None  # noqa: SIM115

    def emit(obj: dict) -> None:
        if log is not None:
            log.write(json.dumps(obj) + "\n")
            log.flush()

    from torch.distributed.device_mesh import init_device_mesh

    tp = args.tp if world % args.tp == 0 and world // args.tp >= 2 else 1
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(args.seed)
    model = parallelize(Llama(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    job = ptc.attach(args.job, model, opt, mesh, cluster=args.cluster)
    emit({"event": "resume", "step": job.step, "world": world, "config": job.describe(),
          **job.attached.to_dict(), "since_start_s": time.perf_counter() - started,
          "time": time.time()})
    data = job.data(view=args.data_view, file=args.data, batch=args.batch, seed=args.seed)
    tp_rank = dist.get_rank() % tp
    step = job.step
    while step < args.steps:
        rows = data.rows(step)
        ids = torch.from_numpy(rows.astype(np.int64))
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the tp ranks of a data rank hold the same loss
        seen: list = [None] * world
        dist.all_gather_object(seen, [zlib.crc32(r.tobytes()) for r in rows]
                               if tp_rank == 0 else [])
        emit({"step": step, "loss": float(mean) / world,
              "samples": sorted(i for s in seen for i in s), "config": job.describe(),
              "world": world, "time": time.time()})
        if args.exit_after is not None and step >= args.exit_after:
            break
        if step % args.save_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            job.save(step)  # returns once the state is copied; committed in the background
            emit({"event": "save", "step": step, "committed": job.step,
                  "seconds": time.perf_counter() - t0, "time": time.time()})
    job.close()
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # all is saved and the process group destroyed: leave without the interpreter's
    # teardown, where torch's gloo threads now and then abort the process ("terminate
    # called without an active exception"; seen with DeepSpeed's engine alone too)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
