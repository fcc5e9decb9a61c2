"""The LLaMA of ``train_llama.py`` (FSDP2 + tensor parallelism on a
DeviceMesh) as a live job: the workers change their mesh without restarting.

Start it through the live launcher, which starts the workers and makes the
changes (see ``examples/live_llama.sh``)::

    python -m ptcfs.client.live --workers 4 --standby 1 --change 3:2 --change 6:3 -- \\
        python examples/live_llama.py --data tokens.npy --steps 12 --metrics m.jsonl

The mesh is train_llama.py's: ``("dp_shard", "tp")`` with ``tp = --tp``
when that leaves two FSDP ranks, else 1 (with ``--hsdp``:
``("dp_replicate", "dp_shard", "tp")``, the data ranks whole replicas, so
that a lost worker's state has copies); the samples of a step do not depend
on it, so ``compare_losses.py`` compares this run with any other. The first
generation starts from the module's initial values (the seed); later ones
move the state between the workers' memories. ``--die-at NAME:STEP``: worker
NAME kills itself (SIGKILL) as it starts step STEP, to show a lost worker;
``--die-at NAME:STEP:optimizer``: after the step's agreement, as its
optimizer step starts; ``--die-at NAME:STEP:save``: as the save of STEP
begins (``--save-every``), the others' saves begun, its part never put:
a save in flight when a worker is lost. ``--hold-save NAME:STEP``: worker
NAME's copy of the save of STEP is held until it trains on a later
generation (at most 60 s, then its save fails): a save in flight across
the change after it, which must not wait for it. ``--fail-optimizer NAME:STEP``: worker NAME's
optimizer step of STEP raises (as an optimizer whose own collective met a
dead peer would), leaving it between two steps. ``--fail-agreement
NAME:STEP``: worker NAME's agreement of STEP (the all-reduce before the
optimizer step) raises once it returned, as one whose all-reduce met the
dead peer would: it stays at the agreement while the others got past it.

With the launcher's ``--job NAME`` the job's state is kept in ptcfs's
stores (created, or resumed from its committed step): each change is
committed there in the background after its first step, ``--save-every N``
saves every N steps to the same job in the background, and the last step
is committed when the workers stop. ``--checksums PATH``: the first worker
writes a line per step with the sha256 of every whole tensor the workers
hold (parameters and Adam moments, by ptcfs's names, as ``ptcctl checksum``
prints them).

Metrics (JSON lines, appended): the first worker of each generation writes a
line per step; every worker writes a line per change with what it moved and
what the plan gave it (``bytes_received``, ``bytes_planned_in``), its pid,
the change's downtime (decision to the end of the first step after it),
the steps it lost (``steps_lost``; a death healed from the replicas: 0),
the survivors that took a step's optimizer step at the change
(``rolled_forward``) and how long its standby's prebuild took
(``prebuilt_s``; 0 for a worker that never waited), and, for a job kept in
the stores, the step the change's durable copy commits (``commit_step``)
and when it began (``commit_began``, after ``first_step_at``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_llama import VOCAB, Llama, parallelize  # noqa: E402

from ptcfs.client.live.worker import LiveWorker  # noqa: E402
from ptcfs.client.torch.background import InBackground, Pending  # noqa: E402
from ptcfs.client.torch.data import FileRows  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="tokens .npy [samples, seq+1]")
    p.add_argument("--tp", type=int, default=2, help="preferred tensor parallelism")
    p.add_argument("--batch", type=int, default=12, help="global batch (samples per step)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=12, help="train until this step")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hsdp", action="store_true",
                   help="data ranks are whole replicas (dp_replicate), so a lost worker's "
                   "state has copies")
    p.add_argument("--die-at", metavar="NAME:STEP[:optimizer|:save]",
                   help="worker NAME dies at step STEP (as it starts, as its optimizer "
                   "step starts, or as its save begins)")
    p.add_argument("--hold-save", metavar="NAME:STEP",
                   help="worker NAME's copy of the save of STEP waits until it trains on a "
                   "later generation")
    p.add_argument("--fail-optimizer", metavar="NAME:STEP",
                   help="worker NAME's optimizer step of STEP raises")
    p.add_argument("--fail-agreement", metavar="NAME:STEP",
                   help="worker NAME's agreement before the optimizer step of STEP raises")
    p.add_argument("--metrics", type=Path, required=True, help="JSON lines, appended")
    p.add_argument("--save-every", type=int, default=0,
                   help="save every N steps to the launcher's --job (in the background)")
    p.add_argument("--checksums", type=Path,
                   help="JSON lines: each step's sha256 of every whole tensor")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    victim, _, at = (args.die_at or "").partition(":")
    at, _, where = at.partition(":")
    failing, _, fail_at = (args.fail_optimizer or "").partition(":")
    stuck, _, stuck_at = (args.fail_agreement or "").partition(":")
    holder, _, hold_at = (args.hold_save or "").partition(":")
    held = Held()

    def layout(world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        tp = args.tp if world % args.tp == 0 and world // args.tp >= 2 else 1
        if args.hsdp:
            return (world // tp, 1, tp), ("dp_replicate", "dp_shard", "tp")
        return (world // tp, tp), ("dp_shard", "tp")

    def build(mesh: Any) -> torch.nn.Module:
        torch.manual_seed(args.seed)  # the values every rank's shards are cut from
        return parallelize(Llama(), mesh)

    def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0)
        opt.register_step_pre_hook(faults)
        return opt

    def faults(*_: Any) -> None:  # as an optimizer step starts (after the agreement)
        if w.name == victim and where == "optimizer" and w.step + 1 == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        if w.name == failing and w.step + 1 == int(fail_at):
            raise RuntimeError(f"worker {w.name}: the optimizer step of step {fail_at} failed")

    def emit(obj: dict) -> None:
        with open(args.metrics, "a") as f:
            f.write(json.dumps(obj) + "\n")

    source = FileRows(args.data, args.batch, args.seed)

    def warm(m: torch.nn.Module) -> None:  # a standby's step while it waits (its values unused)
        ids = torch.from_numpy(source.rows(0, args.batch, 0).astype(np.int64))
        F.cross_entropy(m(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()

    class Worker(LiveWorker):
        def agree_to_step(self, loss: float) -> float:
            mean = super().agree_to_step(loss)
            if self.name == stuck and self.step + 1 == int(stuck_at):
                raise RuntimeError(f"worker {self.name}: the agreement of step {stuck_at} failed")
            return mean

    w = Worker(build, optimizer, layout, warm=warm)
    if w.durable is not None and w.name == holder:
        w.durable.saver = HoldingSaver(int(hold_at), held)
    if not w.join():
        return 0  # a standby worker the job did not need
    trained: dict = {}  # the step's samples and mesh, gathered before its agreement
    reported = 0

    def train_step(w: LiveWorker) -> float:
        assert w.gen is not None
        held.release(w.gen.number)
        if w.name == victim and not where and w.step + 1 == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        tp = w.mesh["tp"].size()
        data_rank = w.rank // tp
        rows = source.rows(w.step, w.world // tp, data_rank)  # dp * fsdp data ranks
        ids = torch.from_numpy(rows.astype(np.int64))
        assert w.module is not None
        logits = w.module(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        seen: list = [None] * w.world
        dist.all_gather_object(seen, [zlib.crc32(r.tobytes()) for r in rows]
                               if w.rank % tp == 0 else [])
        trained.update(samples=sorted(i for s in seen for i in s),
                       config=w.config.degrees_text(), world=w.world)
        return float(loss.detach())

    def on_step(w: LiveWorker, loss: float) -> None:
        # loss: the step's mean over the workers (the tp ranks of a data rank hold the same)
        nonlocal reported
        for c in w.changes[reported:]:
            emit({"event": c.kind, "worker": w.name, "pid": os.getpid(),
                  "generation": c.generation, "world": c.world, "step": c.step,
                  "steps_lost": c.steps_lost, "rolled_forward": list(c.rolled_forward),
                  "downtime_s": c.downtime, "reform_s": c.reformed_s, "move_s": c.moved_s,
                  "rebuild_s": c.rebuilt_s, "prebuilt_s": w.prebuilt_s,
                  "bytes_kept": c.move.bytes_kept,
                  "bytes_received": c.move.bytes_received, "bytes_sent": c.move.bytes_sent,
                  "bytes_planned_in": c.move.bytes_planned_in, "time": time.time(),
                  "first_step_at": c.first_step_at, "commit_step": c.commit_step,
                  "commit_began": c.commit_began})
        reported = len(w.changes)
        if w.rank == 0:
            emit({"step": w.step, "loss": loss, **trained, "time": time.time()})
        if args.checksums is not None:
            sums = checksums(w)
            if w.rank == 0:
                with open(args.checksums, "a") as f:
                    f.write(json.dumps({"step": w.step, "sums": sums}) + "\n")
        if args.save_every and w.step % args.save_every == 0:
            if w.name == victim and where == "save" and w.step == int(at):
                assert w.durable is not None and w.durable.job is not None
                w.durable.job.wait()  # the save's collective part, with the others
                os.kill(os.getpid(), signal.SIGKILL)  # the others' saves begun, its own not
            assert w.gen is not None
            held.generation = w.gen.number
            w.save()

    w.run(train_step, args.steps, on_step)
    if w.gen is not None and w.name in w.gen.workers:
        w.close()
    return 0


class Held:
    """``--hold-save``: a copy that waits until its worker trains on a
    generation after the one it was saved in (at most ``HOLD_S``)."""

    HOLD_S = 60.0

    def __init__(self) -> None:
        self.generation = 0
        self.released = threading.Event()

    def release(self, generation: int) -> None:
        if self.generation and generation > self.generation:
            self.released.set()

    def hold(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        held = self

        class Waiting(Mapping[str, torch.Tensor]):  # the saver's copy reads items()
            def __getitem__(self, k: str) -> torch.Tensor:
                return tensors[k]

            def __iter__(self) -> Iterator[str]:
                return iter(tensors)

            def __len__(self) -> int:
                return len(tensors)

            def items(self) -> Any:
                if not held.released.wait(held.HOLD_S):
                    raise RuntimeError(f"the held save was not released within {held.HOLD_S} s "
                                       "(the change waited for it)")
                return tensors.items()

        return Waiting()


class HoldingSaver(InBackground):
    """The background saver whose save of one step has its copy held."""

    def __init__(self, step: int, held: Held) -> None:
        super().__init__()
        self.step, self.held = step, held

    def begin(self, cluster: Any, state: Any, rank: int, step: int,
              tensors: Mapping[str, torch.Tensor], late: bool = False) -> Pending:
        if step == self.step:
            tensors = self.held.hold(tensors)
        return super().begin(cluster, state, rank, step, tensors, late)


def checksums(w: LiveWorker) -> dict[str, str]:
    """sha256 of every whole parameter and Adam moment (collective)."""
    from ptcfs.client.torch.dtensor_spec import module_parameters

    assert w.module is not None and w.opt is not None
    out = {}
    for n, p in module_parameters(w.module).items():
        whole = {n: p.full_tensor()}
        for k in ("exp_avg", "exp_avg_sq"):
            whole[f"optim/{k}/{n}"] = w.opt.state[p][k].full_tensor()
        for name, t in whole.items():
            out[name] = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
    return out


if __name__ == "__main__":
    sys.exit(main())
