"""Train the small tensor-parallel GPT of gpt_tp.py with its state in ptcfs.

Launch with torchrun, one process per worker; every worker needs
``PTC_CLUSTER`` (the cluster file) and ``PTC_HOST`` (its host's name in
it)::

    PTC_CLUSTER=cluster.toml PTC_HOST=h0 torchrun --nproc-per-node=4 \\
        examples/train_gpt.py --job gpt --data tokens.npy --steps 40

On every start (and every elastic restart) ``ptc.start`` picks the
configuration from the world size, ``--tp`` and ``--pp`` (``--policy``),
creates or reconfigures the job, and reads every worker's state of the last
committed step (model, Adam state and data position); the script builds
the model for that configuration and ``job.load`` hands the state to it.
Every ``--save-every`` steps ``job.save(step)`` saves the state: it returns
once the tensors are copied, and the step is committed in the background
(the next save and ``job.close()`` wait for it).

Data: ``[samples, seq+1]`` token rows (``make_tokens.py``), in the order
and deal of the dataset library (``ptcfs.data``): step ``s`` takes the
global batch at stream positions ``[s*B, (s+1)*B)`` of the seeded epoch
order (``B`` = ``--batch``) and data-parallel rank ``d`` its contiguous
part, so the samples of a step do not depend on the configuration. With
``--data-view DIR`` each worker reads its rank's view of the job's dataset
(``ptcctl data ingest JOB tokens.npy --format npy --global-batch B --seed
K``) under ``DIR/<job>/data/`` (``{host}`` in DIR becomes ``PTC_HOST``: one
mount per host); with ``--data FILE`` it reads the rows from the file.
Rank 0 appends one JSON line per step to ``--metrics``: ``{"step", "loss",
"samples", "config"}`` (``samples``: the crc32 of each row of the step,
sorted), and ``{"event": ...}`` lines for resumes and saves (a save's
``seconds``: how long ``save`` held training up; ``committed``: the step
committed when it returned, the save before it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_tp import (  # noqa: E402
    GPT,
    GPTShape,
    average_gradients,
    init_value,
    make_groups,
    train_step,
)

import ptcfs.client.torch as ptc  # noqa: E402
from ptcfs.suggest import PROFILES  # noqa: E402

MODEL = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True)
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", type=Path, help="tokens .npy [samples, seq+1]")
    data.add_argument("--data-view", metavar="DIR",
                      help="a /ptc mount ({host}: this worker's PTC_HOST) with the job's dataset")
    p.add_argument("--model", default=MODEL, help=f"ptcfs GPT preset (default {MODEL})")
    p.add_argument("--tp", type=int, default=2, help="preferred tensor parallelism")
    p.add_argument("--pp", type=int, default=1, help="preferred pipeline parallelism")
    p.add_argument("--batch", type=int, default=12, help="global batch (samples per step)")
    p.add_argument("--policy", default="fastest-that-fits", choices=ptc.POLICIES,
                   help="how a restart picks the mesh (default fastest-that-fits; the cost "
                   "policies take --tp and --pp as the most this script runs, fixed-rule as "
                   "the preferred degrees)")
    p.add_argument("--gpu", default="h100-sxm", choices=tuple(PROFILES),
                   help="the GPU the cost policies estimate for (default h100-sxm)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--exit-after", type=int, help="stop after this step without saving it "
                   "(a crash, for tests)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--metrics", type=Path, help="JSON lines, appended by rank 0")
    p.add_argument("--cluster", default=os.environ.get("PTC_CLUSTER"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = open(args.metrics, "a") if args.metrics and rank == 0 else None  # noqa: SIM115

    def emit(obj: dict) -> None:
        if log is not None:
            log.write(json.dumps(obj) + "\n")
            log.flush()

    shape = GPTShape.parse(args.model)
    job = ptc.start(args.job, args.model, tp=args.tp, pp=args.pp, batch=args.batch,
                    init=lambda s: init_value(s.name, s.shape, args.seed), device="cpu",
                    policy=args.policy, gpu=args.gpu, cluster=args.cluster)
    cfg = job.config
    g = make_groups(cfg.tp, cfg.dp, cfg.pp, shape.layers)
    model = GPT(shape, g)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    job.load(model, opt)
    emit({"event": "resume", "step": job.step, "world": world, "config": job.describe(),
          **job.attached.to_dict(), "since_start_s": time.perf_counter() - started,
          "time": time.time()})
    data = job.data(view=args.data_view, file=args.data, batch=args.batch, seed=args.seed)
    step = resumed = job.step
    resumed_at = time.perf_counter()
    while step < args.steps:
        rows = data.rows(step)
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, g, torch.from_numpy(rows.astype(np.int64)))
        average_gradients(model, g)
        opt.step()
        step += 1
        mean = loss.clone()  # the last stage's ranks hold each data-parallel rank's loss
        dist.all_reduce(mean)
        mean /= g.tp * g.dp
        seen: list = [None] * world
        dist.all_gather_object(seen, [zlib.crc32(r.tobytes()) for r in rows]
                               if g.tp_rank == 0 and g.first else [])
        emit({"step": step, "loss": float(mean), "samples": sorted(i for s in seen for i in s),
              "config": job.describe(), "world": world})
        if step == resumed + 1:
            emit({"event": "first_step", "step": step,
                  "since_resume_s": time.perf_counter() - resumed_at,
                  "since_start_s": time.perf_counter() - started, "time": time.time()})
        if args.exit_after is not None and step >= args.exit_after:
            break
        if step % args.save_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            job.save(step)  # returns once the state is copied; committed in the background
            emit({"event": "save", "step": step, "committed": job.step,
                  "seconds": time.perf_counter() - t0, "time": time.time()})
    job.close()
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
