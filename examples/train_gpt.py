"""Train the small tensor-parallel GPT of gpt_tp.py with its state in ptcfs.

Launch with torchrun, one process per worker; every worker needs
``PTC_CLUSTER`` (the cluster file) and ``PTC_HOST`` (its host's name in
it)::

    PTC_CLUSTER=cluster.toml PTC_HOST=h0 torchrun --nproc-per-node=4 \\
        examples/train_gpt.py --job gpt --data tokens.npy --steps 40

On every start (and every elastic restart) the workers pick their
configuration from the world size and ``--tp`` (the rule of
:mod:`ptcfs.client.elastic`), rank 0 creates or reconfigures the job, and
all resume from the last committed step: model, Adam state and data
position (the step). Every ``--save-every`` steps the state is committed.

Data: ``--data`` is a ``[samples, seq+1]`` token array (``make_tokens.py``).
Global step ``s`` uses the samples at positions ``s*B .. s*B+B-1`` of an
epoch-wise shuffled order (``B`` = ``--batch``), and data-parallel rank
``d`` takes the ``d``-th ``B/dp`` of them, so the samples of a step do not
depend on the configuration. Rank 0 appends one JSON line per step to
``--metrics``: ``{"step", "loss", "samples", "config"}``, and ``{"event": ...}``
lines for resumes and saves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_tp import GPT, GPTShape, average_gradients, init_value, make_groups  # noqa: E402

from ptcfs.client.conn import Cluster  # noqa: E402
from ptcfs.client.elastic import resume, save  # noqa: E402
from ptcfs.client.torchmodule import load_into, state_of  # noqa: E402

MODEL = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--data", required=True, type=Path, help="tokens .npy [samples, seq+1]")
    p.add_argument("--model", default=MODEL, help=f"ptcfs GPT preset (default {MODEL})")
    p.add_argument("--tp", type=int, default=2, help="preferred tensor parallelism")
    p.add_argument("--batch", type=int, default=12, help="global batch (samples per step)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--exit-after", type=int, help="stop after this step without saving it "
                   "(a crash, for tests)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--metrics", type=Path, help="JSON lines, appended by rank 0")
    p.add_argument("--cluster", default=os.environ.get("PTC_CLUSTER"))
    return p.parse_args(argv)


def samples_for(step: int, batch: int, n: int, seed: int) -> np.ndarray:
    """The sample indices of global step ``step`` (epoch-wise shuffled)."""
    pos = np.arange(step * batch, (step + 1) * batch)
    out = np.empty(batch, dtype=np.int64)
    for epoch in np.unique(pos // n):
        order = np.random.default_rng([seed, int(epoch)]).permutation(n)
        sel = pos // n == epoch
        out[sel] = order[pos[sel] % n]
    return out


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

    cluster = Cluster.load(args.cluster)
    shape = GPTShape.parse(args.model)
    r = resume(cluster, args.job, args.model, tp=args.tp, batch=args.batch,
               init=lambda s: init_value(s.name, s.shape, args.seed), device="cpu")
    st = r.rank_state.state
    cfg = st.config
    g = make_groups(cfg.tp, cfg.dp)
    model = GPT(shape, g)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    load_into(r.rank_state, model, opt)
    emit({"event": "resume", "step": st.step, "world": world, "config": st.describe(),
          "created": r.created, "reconfigured": r.reconfigured,
          "reconfigure_s": r.reconfigure_seconds, "load_s": r.load_seconds,
          "bytes_loaded": r.bytes_loaded, "since_start_s": time.perf_counter() - started,
          "time": time.time()})
    data = np.load(args.data, mmap_mode="r")
    per = args.batch // cfg.dp
    step = st.step
    resumed_at = time.perf_counter()
    while step < args.steps:
        ids = samples_for(step, args.batch, len(data), args.seed)[g.dp_rank * per:
                                                                   (g.dp_rank + 1) * per]
        batch = torch.from_numpy(np.asarray(data[np.sort(ids)], dtype=np.int64))
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model, g)
        opt.step()
        step += 1
        mean = loss.detach().clone()
        if g.dp_group is not None:
            dist.all_reduce(mean, group=g.dp_group)
            mean /= g.dp
        seen: list = [None] * world
        dist.all_gather_object(seen, ids.tolist() if g.tp_rank == 0 else [])
        emit({"step": step, "loss": float(mean), "samples": sorted(i for s in seen for i in s),
              "config": st.describe(), "world": world})
        if step == r.rank_state.step + 1:
            emit({"event": "first_step", "step": step,
                  "since_resume_s": time.perf_counter() - resumed_at,
                  "since_start_s": time.perf_counter() - started, "time": time.time()})
        if args.exit_after is not None and step >= args.exit_after:
            break
        if step % args.save_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            st = save(cluster, st, step, state_of(model, opt, st, rank))
            emit({"event": "save", "step": step, "version": st.version,
                  "seconds": time.perf_counter() - t0, "time": time.time()})
    cluster.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
