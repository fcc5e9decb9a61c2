"""Elastic training with torchrun: pick the configuration, resume, save.

**The rule** (:func:`choose_config`). Given the workers torchrun started
(world size ``W``; each worker's host, from ``PTC_HOST``; ranks of a host
contiguous, as torchrun numbers them) and a preferred ``tp`` and ``pp``:
candidates are taken with ``tp`` from the preferred value down to 1, and
for each ``tp``, ``pp`` from the preferred value down to 1; the first one
where

- ``tp`` divides the number of workers on every host (a tensor-parallel
  group never spans hosts) and the model's heads,
- ``pp`` divides ``W / tp`` and is at most the number of layers,
- ``dp = W / (tp * pp)`` divides the global batch,

is the configuration, on the hosts in rank order. So with tp=2 preferred,
4 workers give tp=2,dp=2; 2 give tp=2,dp=1; 3 give tp=1,dp=3.

**Interleaved pipelines.** A script that builds ``vpp`` virtual stages per
pipeline rank (Megatron's virtual pipeline, torchtitan's interleaved
schedules) says so with ``vpp``: every policy's mesh with ``pp >= 2`` then
has ``vpp`` virtual stages where the layers split into ``pp * vpp`` chunks
(else it stays a plain pipeline, ``vpp=1``). The script reads what was
chosen from the resumed state's configuration.

**Policies** (:func:`pick_config`). ``"fixed-rule"`` is the rule above.
``"fastest-that-fits"`` (the default) and ``"least-moved"`` search every
mesh of the workers with the degrees the training script supports
(``degrees``, by default tp, pp and dp; ``tp`` and ``pp`` are then the
largest it supports) and estimate each on ``device``
(:mod:`ptcfs.suggest`): the first takes the fastest step that fits in GPU
memory, counting the reconfiguration from the committed mesh spread over
``horizon`` steps; the second the one that moves the fewest bytes across
hosts, then the fastest. With ``cp`` among the degrees, ``cp_shard`` says
the layout the script builds (0: context-parallel ranks keep replicas, as
Megatron-Core does; 1: FSDP over ``fsdp·cp``, torchtitan's ``dp_shard_cp``);
by default it is the committed mesh's (0 for a new job), so a job is never
moved to a layout its script cannot load.

**The call order** on every (re)start of the workers, inside
:func:`resume`, collective over the default process group:

1. every worker tells rank 0 its host;
2. rank 0 creates the job if it does not exist (``init``), or, when its
   committed configuration differs from the rule's, asks ptcfs to
   reconfigure it (which also drops a save that was opened and never
   committed: the job resumes from the last committed step);
3. rank 0 broadcasts the outcome; an error raises on every worker;
4. every worker loads its rank's state (:func:`~ptcfs.client.torch.state.load_rank`).

:func:`save` is collective as well: rank 0 opens the version, the first
data-parallel replica of each model slice puts its sub-tensors on its own
host, rank 0 commits the step, and all learn the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ptcfs import settings
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.control.datastate import advance_data
from ptcfs.client.control.saving import begin_save, commit_step
from ptcfs.client.formats.common import Entry, Source, import_source, new_state
from ptcfs.client.torch.gang import gather, on_every, on_rank0, rank_world
from ptcfs.client.torch.state import RankState, load_rank, put_rank
from ptcfs.errors import InvalidConfig, JobNotFound, WorkerError
from ptcfs.jobstate import JobState
from ptcfs.sharding import validate
from ptcfs.suggest.device import PROFILES, Device
from ptcfs.suggest.search import Query, suggest
from ptcfs.types import Host, ModelSpec, ParallelConfig, TensorSpec

__all__ = ["choose_config", "pick_config", "interleaved", "hosts_of_ranks", "resume", "save",
           "Resumed", "WorkerError", "POLICIES"]

#: What :func:`pick_config` accepts.
POLICIES = ("fastest-that-fits", "fixed-rule", "least-moved")

Init = Callable[[TensorSpec], torch.Tensor]


def choose_config(world: int, hosts: tuple[Host, ...], model: ModelSpec, tp: int = 1,
                  pp: int = 1, batch: int | None = None, vpp: int = 1) -> ParallelConfig:
    """The configuration for ``world`` workers on ``hosts`` (see the rule in
    the module docstring)."""
    if sum(h.gpus for h in hosts) != world:
        raise InvalidConfig(f"the hosts hold {sum(h.gpus for h in hosts)} workers, not {world}")
    tried = []
    for t in range(max(1, tp), 0, -1):
        if world % t or any(h.gpus % t for h in hosts):
            continue
        for p in range(max(1, pp), 0, -1):
            if (world // t) % p:
                continue
            dp = world // (t * p)
            if batch is not None and batch % dp:
                tried.append(f"tp={t},pp={p},dp={dp} (dp does not divide batch={batch})")
                continue
            cfg = ParallelConfig(t, p, dp, hosts)
            try:
                validate(model, cfg)
            except InvalidConfig as e:
                tried.append(f"tp={t},pp={p}: {e}")
                continue
            return interleaved(cfg, model, vpp)
    raise InvalidConfig(f"no configuration fits {world} workers: " + "; ".join(tried))


def pick_config(world: int, hosts: tuple[Host, ...], model: ModelSpec, *,
                policy: str = "fastest-that-fits", tp: int = 1, pp: int = 1,
                batch: int | None = None, seq: int | None = None,
                device: Device | str = "h100-sxm", old: ParallelConfig | None = None,
                horizon: int = 1000, recompute: str = "none",
                degrees: tuple[str, ...] = ("tp", "pp", "dp"), vpp: int = 1,
                cp_shard: int | None = None) -> ParallelConfig:
    """The configuration ``policy`` gives (see the module docstring).
    ``seq`` defaults to the model's ``seq`` param, else 2048; ``batch``,
    needed by the cost policies, to ``world``; ``cp_shard`` to ``old``'s
    (0 without it)."""
    if vpp < 1:
        raise InvalidConfig(f"vpp must be at least 1, not {vpp}")
    if policy == "fixed-rule":
        return choose_config(world, hosts, model, tp, pp, batch, vpp)
    if policy not in POLICIES:
        raise InvalidConfig(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    if sum(h.gpus for h in hosts) != world:
        raise InvalidConfig(f"the hosts hold {sum(h.gpus for h in hosts)} workers, not {world}")
    if isinstance(device, str):
        if device not in PROFILES:
            raise InvalidConfig(f"unknown device {device!r}; known: {', '.join(PROFILES)}")
        device = PROFILES[device]
    given = dict(model.params).get("seq")
    s = seq or (given if isinstance(given, int) else 2048)
    layout = cp_shard if cp_shard is not None else old.cp_shard if old is not None else 0
    q = Query(model, hosts, batch or world, s, device, recompute=recompute, allow=degrees,
              max_tp=tp, max_pp=pp, old=old, horizon=horizon, cp_shard=layout)
    best = suggest(q, policy).best
    if best is None:
        raise InvalidConfig(f"no mesh of {world} workers fits in {device.name}'s memory "
                            f"(policy {policy}); try recompute='full' or more workers")
    return interleaved(best.config, model, vpp)


def interleaved(cfg: ParallelConfig, model: ModelSpec, vpp: int) -> ParallelConfig:
    """``cfg`` with ``vpp`` virtual stages per pipeline rank where it has a
    pipeline and its layers split into that many chunks; else ``cfg``."""
    if vpp <= 1 or cfg.pp < 2:
        return cfg
    cand = replace(cfg, vpp=vpp, pp_layers=())
    try:
        validate(model, cand)
    except InvalidConfig:
        return cfg
    return cand


def hosts_of_ranks(per_rank: list[str]) -> tuple[Host, ...]:
    """``["h0", "h0", "h1"]`` → ``(h0:2, h1:1)``; a host's ranks must be contiguous."""
    out: list[Host] = []
    for name in per_rank:
        if out and out[-1].name == name:
            out[-1] = Host(name, out[-1].gpus + 1)
        elif any(h.name == name for h in out):
            raise InvalidConfig(f"the ranks of host {name} are not contiguous: {per_rank}")
        else:
            out.append(Host(name, 1))
    return tuple(out)


@dataclass
class Resumed:
    """What :func:`resume` did, for logs and benchmarks."""

    rank_state: RankState
    created: bool
    reconfigured: bool
    reconfigure_seconds: float
    load_seconds: float
    bytes_loaded: int


def resume(cluster: Cluster, job: str, model: str, *, tp: int = 1, pp: int = 1,
           batch: int | None = None, dtype: str = "fp32", optimizer: str = "adam",
           init: Init | None = None, host: str | None = None,
           device: torch.device | str | None = None, policy: str = "fastest-that-fits",
           gpu: Device | str = "h100-sxm", seq: int | None = None,
           degrees: tuple[str, ...] = ("tp", "pp", "dp"), vpp: int = 1,
           cp_shard: int | None = None) -> Resumed:
    """Steps 1–4 of the module docstring; ``host`` defaults to ``$PTC_HOST``.
    ``policy``, ``gpu`` (a :class:`~ptcfs.suggest.device.Device` or a profile
    name), ``seq``, ``degrees``, ``vpp`` and ``cp_shard`` choose the configuration
    (:func:`pick_config`); ``device`` is where the tensors are loaded."""
    me = settings.get("PTC_HOST", host)
    if not me:
        raise InvalidConfig("set PTC_HOST to this worker's host name in the cluster file")
    rank, world = rank_world()
    names = gather(me)

    def decide() -> tuple[bool, bool, float]:
        coord = Coordinator(cluster)
        spec_hosts = hosts_of_ranks([str(n) for n in names])
        t0 = time.perf_counter()
        try:
            st = coord.state(job)
        except JobNotFound:
            if init is None:
                raise
            spec = JobState(job, 1, model, dtype, optimizer,
                            ParallelConfig(1, 1, 1, spec_hosts), 0).model_spec()
            cfg = pick_config(world, spec_hosts, spec, policy=policy, tp=tp, pp=pp,
                              batch=batch, seq=seq, device=gpu, degrees=degrees, vpp=vpp,
                              cp_shard=cp_shard)
            _create(coord, job, model, dtype, optimizer, cfg, spec, init)
            return True, False, time.perf_counter() - t0
        cfg = pick_config(world, spec_hosts, st.model_spec(), policy=policy, tp=tp, pp=pp,
                          batch=batch, seq=seq, device=gpu, old=st.config, degrees=degrees,
                          vpp=vpp, cp_shard=cp_shard)
        if cfg == st.config:
            return False, False, 0.0
        coord.reconfigure(job, cfg)
        return False, True, time.perf_counter() - t0

    created, reconfigured, seconds = on_rank0(decide)
    t0 = time.perf_counter()
    rs = on_every(lambda: load_rank(cluster, job, rank, device))
    return Resumed(rs, created, reconfigured, seconds, time.perf_counter() - t0, rs.nbytes)


def _create(coord: Coordinator, job: str, model: str, dtype: str, optimizer: str,
            cfg: ParallelConfig, spec: ModelSpec, init: Init) -> None:
    """Version 1 of the job from ``init`` (one logical tensor at a time)."""
    def entry(s: TensorSpec) -> Entry:
        return Entry(s.shape, torch.float32, lambda: init(s), "init")

    src = Source({s.name: entry(s) for s in spec.tensors if not s.name.startswith("optim/")})
    import_source(coord, src, new_state(job, model, dtype, optimizer, cfg, 0, coord), False)
    # a dataset ingested before: deal it to these ranks
    advance_data(coord.cluster, job, None, cfg.data_parallel)


def save(cluster: Cluster, state: JobState, step: int, tensors: dict[str, torch.Tensor]
         ) -> JobState:
    """Commit the workers' tensors as ``step`` (collective; see the module
    docstring). ``state``: the job's committed version the workers run under."""
    rank = rank_world()[0]
    version = on_rank0(lambda: begin_save(Coordinator(cluster), state.job))
    on_every(lambda: put_rank(cluster, state, version, rank, tensors, owned=True))
    new: JobState = on_rank0(lambda: commit_step(Coordinator(cluster), state.job, step,
                                                 config=state.config))
    return new
