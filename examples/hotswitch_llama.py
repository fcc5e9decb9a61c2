"""The LLaMA of ``train_llama.py`` hot-switching between the meshes the
sequence-length chooser picks, within every step (HotSPa): each step trains
``--batch`` sequences of half the data's length and ``--batch`` of its full
length, one sequence per data-parallel rank and micro-batch. The meshes come
from :func:`~ptcfs.suggest.lengths.plan_groups` (what ``ptcctl suggest
--seq-lengths`` prints) on this model, these workers and the device the
example states: a CPU (50 GFLOP/s, 2 GB/s between workers) with
``--device-memory`` bytes, 1.1 MB by default, as small as this tiny model
needs for its full-length sequences not to fit at ``tp=1`` (as 32K-token
sequences of a 7B model do not fit an 80 GB GPU there). With it the chooser
gives the short sequences ``fsdp=4`` and the long ones ``fsdp=2,tp=2``, the
home mesh where the optimizer steps; parameters move to the other mesh
before its micro-batches and its gradients back after them, device to
device on ptcfs's plan (cached per direction). ``--single``: every
micro-batch on the home mesh, the run to compare with.

    torchrun --standalone --nproc-per-node=4 examples/hotswitch_llama.py \\
        --data tokens.npy --steps 6 --metrics m.jsonl

Metrics (JSON lines, rank 0): per step the loss (each length's mean loss,
summed), the seconds of the step and of its switches, and the meshes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_llama import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, Llama, parallelize  # noqa: E402,I001

from ptcfs.client.live.hotswitch import MeshSwitch  # noqa: E402
from ptcfs.client.torch.data import FileRows  # noqa: E402
from ptcfs.client.torch.dtensor_spec import config_of, spec_from_module  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from ptcfs.suggest import Device, Query  # noqa: E402
from ptcfs.suggest.device import parse_bytes  # noqa: E402
from ptcfs.suggest.lengths import MeshRouting, plan_groups, routing  # noqa: E402
from ptcfs.types import Host  # noqa: E402

#: train_llama's model as the chooser's preset (fp32 parameters, AdamW's state)
MODEL = (f"llama:layers={LAYERS},hidden={HIDDEN},heads={HEADS},kv_heads={KV_HEADS},"
         f"vocab={VOCAB},ffn={FFN}")


def choose(world: int, seq: int, batch: int, memory: str) -> MeshRouting:
    """The chooser's meshes for a step of ``batch`` sequences of ``seq // 2``
    tokens and ``batch`` of ``seq``, on ``world`` workers of the stated CPU
    (meshes this example builds: tensor parallelism and FSDP, ``tp`` at most
    the key/value heads)."""
    model = parse_model(MODEL, dtype="fp32", optimizer="adam")
    cpu = Device("cpu", parse_bytes(memory), 50e9, 2e9, 2e9)
    q = Query(model, (Host("any", world),), 2 * batch, seq, cpu, micro=1,
              allow=("tp", "fsdp"), max_tp=KV_HEADS)
    return routing(plan_groups(q, [seq // 2] * batch + [seq] * batch, min_bound=1))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="tokens .npy [samples, seq+1]")
    p.add_argument("--batch", type=int, default=8, help="sequences of each length a step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--single", action="store_true", help="every micro-batch on the home mesh")
    p.add_argument("--device-memory", default="1100kB", metavar="BYTES",
                   help="the device memory the chooser plans for (default 1100kB)")
    p.add_argument("--metrics", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh

    source = FileRows(args.data, args.batch, args.seed)
    seq = source.rows(0, 1, 0).shape[1] - 1
    r = choose(world, seq, args.batch, args.device_memory)
    home = r.home
    groups = [(r.mesh_for(seq // 2), True), (r.mesh_for(seq), False)]
    meshes = {k: init_device_mesh("cpu", (c.fsdp, c.tp), mesh_dim_names=("dp_shard", "tp"))
              for k, c in r.configs.items()}
    torch.manual_seed(args.seed)
    modules: dict[str, Any] = {home: parallelize(Llama(), meshes[home])}
    for k in meshes:
        if k != home:
            with torch.device("meta"):
                modules[k] = parallelize(Llama(), meshes[k])
            modules[k].to_empty(device="cpu")
    opt = torch.optim.AdamW(modules[home].parameters(), lr=args.lr, weight_decay=0.0)
    configs = {}
    for k, mesh in meshes.items():
        spec, degrees = spec_from_module(modules[k], mesh)
        configs[k] = config_of(degrees, (Host("any", world),))
    sw = MeshSwitch(spec, configs, rank)

    def micro_batches(where: str, index: int, short: bool) -> torch.Tensor:
        """One sequence per data-parallel rank and micro-batch, as the chooser
        planned; the losses add up to this rank's mean."""
        tp = meshes[where]["tp"].size()
        rows = source.rows(index, world // tp, rank // tp)
        total = torch.zeros(())
        for i in range(len(rows)):
            ids = torch.from_numpy(rows[i:i + 1].astype(np.int64))
            if short:
                ids = ids[:, : seq // 2 + 1]
            logits = modules[where](ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) / len(rows)
            loss.backward()
            total += loss.detach()
        return total

    for step in range(args.steps):
        t0 = time.perf_counter()
        switch_s = 0.0
        loss = torch.zeros(())
        for i, (name, short) in enumerate(groups):
            where = home if args.single else name
            if where != home:
                t1 = time.perf_counter()
                sw.params(home, where, modules)
                switch_s += time.perf_counter() - t1
            loss += micro_batches(where, 2 * step + i, short)
            if where != home:
                t1 = time.perf_counter()
                sw.grads(where, home, modules)
                switch_s += time.perf_counter() - t1
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        if rank == 0:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": float(loss) / world,
                                    "step_s": time.perf_counter() - t0,
                                    "switch_s": switch_s, "single": args.single,
                                    "home": home,
                                    "meshes": {k: c.degrees_text()
                                               for k, c in r.configs.items()},
                                    "routes": [n for n, _ in groups]}) + "\n")
    dist.barrier()
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
