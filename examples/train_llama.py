"""Train a small LLaMA parallelized with FSDP2 and tensor parallelism on a
DeviceMesh, its state in ptcfs (the DTensor client API only).

Launch with torchrun, one process per worker; every worker needs
``PTC_CLUSTER`` (the cluster file) and ``PTC_HOST`` (its host's name in
it)::

    PTC_CLUSTER=cluster.toml PTC_HOST=h0 torchrun --nproc-per-node=4 \\
        examples/train_llama.py --job llama --data tokens.npy --steps 40

The mesh is ``("dp_shard", "tp")``: ``tp = --tp`` when that leaves at
least two FSDP ranks (4 workers: fsdp=2,tp=2), else 1 (2 workers: fsdp=2;
3: fsdp=3). The tensor-parallel plan is applied even when ``tp`` is 1, so
every start derives the same spec from the module (``spec_from_module``).
On every start (and elastic restart): rank 0 creates the job from the
module's own initial values (``import_source``), or reconfigures it to the
mesh of this start; every worker loads its rank (``load_rank``) into its
local shards (``load_into``); every ``--save-every`` steps each worker puts
its shards (``state_of``, ``put_rank``) and rank 0 commits the step, which
also moves the dataset's read position.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_gpt import FileData, ViewData  # noqa: E402

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.control.datastate import advance_data  # noqa: E402
from ptcfs.client.control.saving import begin_save, commit_step  # noqa: E402
from ptcfs.client.formats.common import Entry, Source, import_source, new_state  # noqa: E402
from ptcfs.client.torch.dtensor import load_into, state_of  # noqa: E402
from ptcfs.client.torch.dtensor_spec import (  # noqa: E402
    config_of,
    mesh_rank,
    module_parameters,
    spec_from_module,
)
from ptcfs.client.torch.elastic import hosts_of_ranks  # noqa: E402
from ptcfs.client.torch.state import load_rank, put_rank  # noqa: E402
from ptcfs.errors import JobNotFound, PtcError  # noqa: E402
from ptcfs.model.specfile import encode_spec  # noqa: E402

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
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(m, mesh=mesh["dp_shard"])
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


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result (or its error, raised) on every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except PtcError as e:
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise SystemExit(f"rank 0: {box[0][1]}")
    return box[0][1]


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
    spec, degrees = spec_from_module(model, mesh, optimizer=opt)
    me = mesh_rank(mesh)  # this worker's rank in the job (here torchrun's)
    names: list[Any] = [None] * world
    dist.all_gather_object(names, os.environ.get("PTC_HOST"))
    cfg = config_of(degrees, hosts_of_ranks([str(n) for n in names]))
    cluster = Cluster.load(args.cluster)

    def decide() -> str:
        coord = Coordinator(cluster)
        try:
            st = coord.state(args.job)
        except JobNotFound:
            torch.manual_seed(args.seed)  # the values every rank's shards were cut from
            whole = module_parameters(Llama())
            src = Source({n: Entry(tuple(p.shape), p.dtype, p.detach, "init")
                          for n, p in whole.items()})
            state = new_state(args.job, "module:Llama", "fp32", "adamw", cfg, 0, coord)
            import_source(coord, src, state.with_(spec=encode_spec(spec)), False)
            advance_data(cluster, args.job, 0, cfg.data_parallel)
            return "created"
        if st.model_spec().tensors != spec.tensors:
            raise PtcError(f"job {args.job!r} is another model than this module")
        if st.config == cfg:
            return "resumed"
        coord.reconfigure(args.job, cfg)
        return "reconfigured"

    t0 = time.perf_counter()
    what = on_rank0(decide)
    decided = time.perf_counter() - t0
    t0 = time.perf_counter()
    rs = load_rank(cluster, args.job, me, device="cpu")
    load_into(rs, model, opt)
    st = rs.state
    emit({"event": "resume", "step": st.step, "world": world, "config": st.describe(),
          "created": what == "created", "reconfigured": what == "reconfigured",
          "reconfigure_s": decided, "load_s": time.perf_counter() - t0,
          "bytes_loaded": rs.nbytes, "since_start_s": time.perf_counter() - started,
          "time": time.time()})
    source: FileData | ViewData
    if args.data_view:
        mount = Path(args.data_view.replace("{host}", os.environ.get("PTC_HOST", "")))
        source = ViewData(mount / args.job / "data", args.batch)
    else:
        source = FileData(args.data, args.batch, args.seed)
    data_rank, tp_rank = divmod(me, tp)
    step = st.step
    while step < args.steps:
        rows = source.rows_for(step, cfg.data_parallel, data_rank)
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
              "samples": sorted(i for s in seen for i in s), "config": st.describe(),
              "world": world})
        if args.exit_after is not None and step >= args.exit_after:
            break
        if step % args.save_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            version = on_rank0(lambda: begin_save(Coordinator(cluster), args.job))
            put_rank(cluster, st, version, me, state_of(model, opt, st, me), owned=True)
            dist.barrier()
            st = on_rank0(lambda s=step: commit_step(Coordinator(cluster), args.job, s))
            source.committed()
            emit({"event": "save", "step": step, "version": st.version,
                  "seconds": time.perf_counter() - t0, "time": time.time()})
    cluster.close()
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
