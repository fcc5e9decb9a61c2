"""One worker of a live job: it trains, and changes its mesh when told, in place.

A worker is started by the launcher (:mod:`ptcfs.client.live.agent`) with
``PTC_LIVE_STORE`` (the launcher's store) and ``PTC_LIVE_NAME`` (its name)
and gives :class:`LiveWorker` three functions of the training script:
``build(mesh)`` (the module parallelized on ``mesh``), ``optimizer(module)``
and ``layout(world)`` (the mesh shape and dimension names for a world
size, the same rule on every worker), and optionally ``warm(module)`` (a
forward and backward of a small batch, which a standby runs while it waits).

Call order of a worker (:meth:`LiveWorker.run`):

1. join: wait (warm: torch and the script imported) for a generation that
   names it; the first generation builds the module with its initial
   values, a later one makes the worker a joiner (step 3). A worker that
   the first generation does not name is a standby: while it waits it
   builds the module once on the meta device over a mesh of itself alone
   (:meth:`LiveWorker.prebuild`), so that the imports and first-build costs
   of the parallelizing code are paid before it is called, not while the
   survivors wait for it;
2. every step boundary: the group's rank 0 looks in the store for the next
   generation and tells the others (one broadcast); a step is trained,
   and the optimizer steps only after every worker agreed it may (one
   all-reduce, which also sums the step's loss), so a worker that dies
   mid-step leaves each survivor at one step or the next;
3. a change (the next generation, or a peer's death, which the launcher
   turns into a generation that names it lost): the workers of
   :attr:`~ptcfs.types.Generation.movers` re-form the group
   (:func:`~ptcfs.client.live.group.reform`), report their step and where
   in it they were (a joiner takes the step, and the model spec, from the
   survivors) and settle where to go on (:mod:`ptcfs.client.live.heal`: a
   death between the agreement and the optimizer step is healed at the
   step after it, the survivors that had not stepped taking the optimizer
   step now), move the state on the plan from the memories that hold that
   step (:func:`~ptcfs.client.live.mover.move`); leaving workers exit;
   the others build the module on the new mesh on the meta device, give it
   the moved tensors, make a new optimizer with the moved moments, and go
   on at that step. No process restarts, nothing is read from a store.
   When the previous generation's first worker survived but had not
   reported the step the job goes on at (it took the step in the heal),
   every worker calls ``on_step`` for it (with the agreed loss), so the
   step's report is not lost with the group.

With ``PTC_LIVE_JOB`` (the launcher's ``--job``) the stores follow the
workers in the background: :mod:`ptcfs.client.live.durable`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ptcfs import settings
from ptcfs.client.live.durable import Durable
from ptcfs.client.live.generation import Change, Layout, layout_config, read_generation
from ptcfs.client.live.group import await_key, connect, leave, mesh_of, reform
from ptcfs.client.live.heal import AGREE, OPTIMIZER, REPORT, TRAIN, Report, Said, Settle, go_on
from ptcfs.client.live.mover import move
from ptcfs.client.torch.dtensor import load_into, state_of
from ptcfs.client.torch.dtensor_spec import spec_from_module
from ptcfs.client.torch.state import RankState
from ptcfs.errors import LiveError
from ptcfs.jobstate import JobState
from ptcfs.model.specfile import encode_spec
from ptcfs.types import Generation, ModelSpec, ParallelConfig, Plan

__all__ = ["LiveWorker", "Change", "read_generation", "layout_config"]

#: The longest a worker waits for the launcher's next generation.
_WAIT_S = 24 * 3600.0


class LiveWorker:
    """The training loop's side of a live job (see the module docstring)."""

    def __init__(self, build: Callable[[Any], torch.nn.Module],
                 optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
                 layout: Layout, *, store: str | None = None, name: str | None = None,
                 device: str = "cpu", backend: str = "gloo",
                 warm: Callable[[torch.nn.Module], None] | None = None,
                 job: str | None = None, cluster: str | None = None) -> None:
        address = settings.get("PTC_LIVE_STORE", store)
        self.name = settings.get("PTC_LIVE_NAME", name) or ""
        if not address or not self.name:
            raise LiveError("a live worker needs PTC_LIVE_STORE and PTC_LIVE_NAME (start it "
                            "with python -m ptcfs.client.live.agent)")
        self.store = connect(address)
        self.build, self.make_optimizer, self.layout = build, optimizer, layout
        self.warm = warm
        self.device, self.backend = device, backend
        self.gen: Generation | None = None
        self.module: torch.nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.mesh: Any = None
        self.model: ModelSpec | None = None
        self.step = 0
        #: the mean loss over the workers of the last step agreed ((step, loss))
        self.agreed: tuple[int, float] = (0, float("nan"))
        self.changes: list[Change] = []
        self._fresh = False  # changed outside the loop's look (joined, recovered)
        self._phase = TRAIN  # where in the step after self.step (ptcfs.client.live.heal)
        self._reported = 0  # the last step on_step returned for
        self._replay: tuple[int, float] | None = None  # a step to report again
        self.prebuilt_s = 0.0  # a standby's warm-up build (prebuild)
        job = settings.get("PTC_LIVE_JOB", job)
        #: the job's durable copy in ptcfs's stores (None: the job lives in memory only)
        self.durable = Durable(job, self.name, cluster) if job else None
        self.store.set(f"ready/{self.name}", str(os.getpid()))

    # -- the generations -------------------------------------------------
    @property
    def rank(self) -> int:
        return self.gen.workers.index(self.name) if self.gen else -1

    @property
    def world(self) -> int:
        return len(self.gen.workers) if self.gen else 0

    @property
    def config(self) -> ParallelConfig:
        if self.gen is None:
            raise LiveError(f"worker {self.name} has not joined")
        return layout_config(self.layout, self.gen.workers)

    def _wait_generation(self, number: int) -> Generation | None:
        """Generation ``number`` once the launcher posts it; None when it says stop."""
        if await_key(self.store, f"gen/{number}", _WAIT_S,
                     lambda: bool(self.store.check(["stop"]))):
            return read_generation(self.store, number)
        return None

    def join(self) -> bool:
        """Step 1: wait for a generation that names this worker and take part
        in it; False when the launcher stopped the job first."""
        number = int(self.store.add("gen", 0))
        while True:
            gen = self._wait_generation(max(number, 1))
            if gen is None:
                return False
            if self.name in gen.workers:
                break
            if not self.prebuilt_s:
                self.prebuild()
            number = gen.number + 1
        if gen.number == 1:
            self._start(gen)
        else:
            self._change(gen, "change")
            self._fresh = True
        return True

    def prebuild(self) -> float:
        """A standby's warm-up (step 1): the module built on the meta device
        over a mesh of this worker alone (``layout(1)``, a one-rank group of
        its own), given storage and an optimizer, then dropped; with
        ``warm`` (the worker's argument: a forward and backward of a small
        batch on the module), one step trained on it too. What a build and a
        first step on the real mesh cost the first time only (imports, the
        parallelizing and sharding code's first runs) is paid here. Returns
        the seconds."""
        t0 = time.perf_counter()
        leave()
        dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            mesh = mesh_of(*self.layout(1), device=self.device)
            with torch.device("meta"):
                module = self.build(mesh)
            module.to_empty(device=self.device)
            opt = self.make_optimizer(module)
            if self.warm is not None:
                self.warm(module)
                opt.step()
        finally:
            leave()
        self.prebuilt_s = time.perf_counter() - t0
        return self.prebuilt_s

    def _start(self, gen: Generation) -> None:
        rec = Change(gen.number, "start", len(gen.workers), 0, gen.decided)
        rec.reformed_s = reform(self.store, f"{gen.number}/run", self.name, gen.workers,
                                self.backend)
        self.gen = gen
        self.mesh = mesh_of(*self.layout(self.world), device=self.device)
        self.module = self.build(self.mesh)
        self.opt = self.make_optimizer(self.module)
        self.model = spec_from_module(self.module, self.mesh, optimizer=self.opt)[0]
        if self.durable is not None:  # created from these values, or resumed from the stores
            self.step = rec.step = self.durable.attach(self.module, self.opt, self.mesh)
        self.changes.append(rec)
        self._applied(gen)

    def _applied(self, gen: Generation) -> None:
        self.store.set(f"pid/{gen.number}/{self.name}", str(os.getpid()))
        if self.rank == 0:
            self.store.set(f"applied/{gen.number}", str(self.step))

    def poll(self) -> Generation | None:
        """Step 2's look: the next generation when it is due (collective)."""
        assert self.gen is not None
        flag = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            key = f"gen/{self.gen.number + 1}"
            if self.store.check([key]) and read_generation(
                    self.store, self.gen.number + 1).at_step <= self.step:
                flag[0] = 1
        dist.broadcast(flag, 0)
        return read_generation(self.store, self.gen.number + 1) if flag.item() else None

    # -- a change --------------------------------------------------------
    def _held(self) -> dict[str, torch.Tensor]:
        if self.module is None or self.gen is None or self.model is None:
            return {}
        st = self._state(self.config, self.step)
        return state_of(self.module, self.opt, st, self.rank)

    def _state(self, cfg: ParallelConfig, step: int) -> JobState:
        assert self.model is not None
        key = (cfg, step)
        if self._state_cache[0] != key:
            self._state_cache = (key, JobState("live", 1, "module", "fp32", "adamw", cfg, step,
                                               spec=encode_spec(self.model)))
        return self._state_cache[1]

    _state_cache: tuple[Any, Any] = (None, None)

    def _change(self, gen: Generation, kind: str, whole: bool = False) -> bool:
        """Step 3; False for a worker that left. ``whole``: the old group
        can still run a collective (the change was seen at a step boundary)."""
        joining = self.name in gen.joining
        # a planned change takes effect at this step boundary; a loss when the launcher saw it
        decided = gen.decided if joining or gen.lost else max(gen.decided, time.time())
        rec = Change(gen.number, kind, len(gen.workers), self.step, decided)
        if self.durable is not None and not joining:  # a save in flight: its end, or given up
            self.durable.before_change(whole)
        rec.reformed_s = reform(self.store, f"{gen.number}/move", self.name, gen.movers,
                                self.backend)
        t0 = time.perf_counter()
        assert self.model is not None or joining
        old = layout_config(self.layout, gen.previous)
        new = layout_config(self.layout, gen.workers)
        p, way = self._settle(gen, joining, old, new)
        if self.name in way.roll_forward:
            assert self.opt is not None
            self.opt.step()  # its gradients of this step are complete (the heal's proof)
        self.step, self._phase = way.step, TRAIN
        rec.step, rec.steps_lost, rec.rolled_forward = way.step, way.steps_lost, tuple(
            sorted(way.roll_forward))
        held = {} if joining or self.name in way.no_copy else self._held()
        assert self.model is not None
        tensors, slices, specs, rec.move = move(p, self.name, held, self.model, gen.movers,
                                                self.device)
        rec.moved_s = time.perf_counter() - t0
        del held
        if self.name not in gen.workers:
            leave()
            self.gen = gen
            if self.durable is not None:
                self.durable.leave()
            return False
        if gen.leaving:
            rec.reformed_s += reform(self.store, f"{gen.number}/run", self.name, gen.workers,
                                     self.backend)
        t0 = time.perf_counter()
        self.gen = gen
        self.mesh = mesh_of(*self.layout(self.world), device=self.device)
        with torch.device("meta"):
            module = self.build(self.mesh)
        module.to_empty(device=self.device)
        opt = self.make_optimizer(module)
        rs = RankState(self._state(new, self.step), self.rank, tensors, slices, self.step, specs)
        load_into(rs, module, opt)
        self.module, self.opt = module, opt
        if self.durable is not None:  # committed in the background after the first step
            self.durable.after_change(module, opt, self.mesh, self.step)
        rec.rebuilt_s = time.perf_counter() - t0
        self.changes.append(rec)
        self._applied(gen)
        return True

    def _settle(self, gen: Generation, joining: bool, old: ParallelConfig,
                new: ParallelConfig) -> tuple[Plan, Settle]:
        """Every mover's report (:mod:`ptcfs.client.live.heal`): the plan and
        the way to go on. A joiner takes the model spec from the survivors.
        When the previous generation's first worker survived without having
        reported the step the job goes on at, every worker reports it again."""
        mine = None if joining else (Report(self.name, self.step, self._phase), self.model,
                                     self.agreed, self._reported)
        seen: list[Any] = [None] * len(gen.movers)
        dist.all_gather_object(seen, mine)
        said: list[Said] = [x for x in seen if x is not None]
        self.model = said[0][1]
        p, way, replay = go_on(said, gen, old, new)
        if replay is not None:
            self._replay = replay
        return p, way

    def recover(self, error: BaseException) -> bool:
        """A collective failed (a peer died): wait for the launcher's next
        generation and change to it. False when this worker is to stop. An
        error that no peer's death explains (no new generation within
        ``PTC_LIVE_TIMEOUT_S``) is raised."""
        assert self.gen is not None
        print(f"worker {self.name}: step {self.step + 1} failed: "
              f"{str(error).splitlines()[0] if str(error) else type(error).__name__}; "
              "waiting for the launcher", file=sys.stderr, flush=True)
        number = self.gen.number + 1
        leave()  # closes this worker's connections: peers blocked on it fail now, not at a timeout
        try:
            posted = await_key(self.store, f"gen/{number}", settings.get("PTC_LIVE_TIMEOUT_S"),
                               lambda: bool(self.store.check(["stop"])))
        except LiveError:
            raise error from None
        if not posted:
            raise LiveError(f"worker {self.name}: the group failed ({error}) and the "
                            "launcher stopped the job") from error
        gen = read_generation(self.store, number)
        self._fresh = self._change(gen, "loss" if gen.lost else "change")
        return self._fresh

    def agree_to_step(self, loss: float) -> float:
        """Step 2's barrier before the optimizer steps (collective): the mean
        of ``loss`` over the workers."""
        both = torch.tensor([1.0, loss], dtype=torch.float64)
        dist.all_reduce(both)
        return float(both[1] / both[0])

    # -- the loop --------------------------------------------------------
    def run(self, train_step: Callable[[LiveWorker], float],
            until: int, on_step: Callable[[LiveWorker, float], None] | None = None) -> None:
        """Steps 2 and 3 until step ``until``: ``train_step(self)`` does the
        forward and backward of step ``self.step + 1`` and returns its loss;
        this loop agrees (the loss's mean over the workers), steps the
        optimizer, counts the step and calls ``on_step(self, mean_loss)``
        (collectives allowed there; after a change it may be called once more
        for the step the job went on at, see step 3)."""
        while self.step < until:
            try:
                if self._replay is not None and on_step is not None:
                    step, loss = self._replay
                    self._replay = None
                    on_step(self, loss)
                    self._reported = step
                # a worker that just joined or recovered trains at once: its peers took
                # this boundary's look already (or are in the same recovery)
                self._phase = TRAIN
                gen = None if self._fresh else self.poll()
                self._fresh = False
                if gen is not None and not self._change(gen, "loss" if gen.lost else "change",
                                                        whole=True):
                    return
                assert self.opt is not None
                self.opt.zero_grad(set_to_none=True)
                loss = train_step(self)
                self._phase = AGREE
                mean = self.agree_to_step(loss)
                self._phase = OPTIMIZER
                self.agreed = (self.step + 1, mean)
                self.opt.step()
                self.step += 1
                self._phase = REPORT
                if self.changes and not self.changes[-1].first_step_at:
                    self.changes[-1].first_step_at = time.time()
                if self.durable is not None:
                    self._commit_after_step()
                if on_step is not None:
                    on_step(self, mean)
                self._reported = self.step
            except (RuntimeError, dist.DistBackendError) as e:
                if isinstance(e, LiveError):
                    raise
                if not self.recover(e):
                    return

    def _commit_after_step(self) -> None:
        """Step 2's end: the durable copy of a change begins after its first step."""
        assert self.durable is not None
        began = self.durable.after_step(self.step)
        if began is not None and self.changes:
            self.changes[-1].commit_step = began.step
            self.changes[-1].commit_began = began.timings["began"]

    def save(self) -> None:
        """Save this step to the job in the background (collective; a job
        without a store: nothing). Call it from ``on_step``."""
        if self.durable is not None:
            self.durable.save(self.step)

    def close(self) -> None:
        """Commit the last step to the job's store (a job without one:
        nothing), then leave the group (after a last barrier, so no peer is
        left talking)."""
        if self.durable is not None:
            self.durable.close(self.step)
        if dist.is_initialized():
            dist.barrier()
        leave()

