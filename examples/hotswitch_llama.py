"""The LLaMA of ``train_llama.py`` hot-switching between two meshes of the
same workers within every step (HotSPa): each step's short-sequence
micro-batch runs on ``fsdp=N`` (``tp=1``), its long-sequence one on
``fsdp=N/2,tp=2``, the home mesh the optimizer steps; parameters move to
the short mesh before its micro-batch and its gradients back to the long
one after it, device to device on ptcfs's plan (cached per direction).
``--single``: both micro-batches on the long mesh, the run to compare with.

    torchrun --standalone --nproc-per-node=4 examples/hotswitch_llama.py \\
        --data tokens.npy --steps 6 --metrics m.jsonl

Metrics (JSON lines, rank 0): per step the loss (the two micro-batches'
mean losses summed), the seconds of the step and of its two switches.
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

from train_llama import VOCAB, Llama, parallelize  # noqa: E402

from ptcfs.client.live.hotswitch import MeshSwitch  # noqa: E402
from ptcfs.client.torch.data import FileRows  # noqa: E402
from ptcfs.client.torch.dtensor_spec import config_of, spec_from_module  # noqa: E402
from ptcfs.types import Host  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="tokens .npy [samples, seq+1]")
    p.add_argument("--batch", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--single", action="store_true", help="both micro-batches on one mesh")
    p.add_argument("--metrics", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"short": init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp")),
              "long": init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))}
    torch.manual_seed(args.seed)
    modules: dict[str, Any] = {"long": parallelize(Llama(), meshes["long"])}
    with torch.device("meta"):
        modules["short"] = parallelize(Llama(), meshes["short"])
    modules["short"].to_empty(device="cpu")
    opt = torch.optim.AdamW(modules["long"].parameters(), lr=args.lr, weight_decay=0.0)
    configs = {}
    for k, mesh in meshes.items():
        spec, degrees = spec_from_module(modules[k], mesh)
        configs[k] = config_of(degrees, (Host("any", world),))
    sw = MeshSwitch(spec, configs, rank)
    source = FileRows(args.data, args.batch, args.seed)

    def micro(where: str, index: int, short: bool) -> torch.Tensor:
        mesh = meshes[where]
        tp = mesh["tp"].size()
        rows = source.rows(index, world // tp, rank // tp)
        ids = torch.from_numpy(rows.astype(np.int64))
        if short:
            ids = ids[:, : ids.shape[1] // 2 + 1]
        logits = modules[where](ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach()

    for step in range(args.steps):
        t0 = time.perf_counter()
        switch_s = 0.0
        first = "long" if args.single else "short"
        if first != "long":
            t1 = time.perf_counter()
            sw.params("long", first, modules)
            switch_s += time.perf_counter() - t1
        loss = micro(first, 2 * step, True)
        if first != "long":
            t1 = time.perf_counter()
            sw.grads(first, "long", modules)
            switch_s += time.perf_counter() - t1
        loss = loss + micro("long", 2 * step + 1, False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        if rank == 0:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": float(loss) / world,
                                    "step_s": time.perf_counter() - t0,
                                    "switch_s": switch_s, "single": args.single}) + "\n")
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
