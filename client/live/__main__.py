"""Run a live job: ``python -m ptcfs.client.live [options] -- COMMAND...``.

Starts ``--workers`` workers (``w0``, ``w1``, ...) and ``--standby`` warm
standby ones (``s0``, ...) of COMMAND, a script that trains with
:class:`~ptcfs.client.live.worker.LiveWorker`, and makes the changes of
``--change`` in order, each once the one before it runs:

- ``STEP:N``: from step STEP, N workers (fewer: the last ones leave; more:
  standby workers join, new ones are started when none is left);
- ``STEP:replace``: the last worker leaves and a standby one takes its rank.

A worker that fails is dropped at once (its survivors rebuild its state
from their replicas). Prints one line per generation, or with ``--json`` one
object: the generations, the steps they took effect at, each worker's exit
status and how many survivors got a new process.

``--job NAME`` keeps the job's state in ptcfs's stores (the cluster of
``--cluster`` or ``PTC_CLUSTER``; the workers' host ``PTC_HOST``, else the
cluster's first): created from the first generation's values, or resumed
from the job's committed version when it exists; each change's new layout
is committed as the job's next version in the background, after the first
step on the new mesh, and the last step when the workers stop
(:mod:`ptcfs.client.live.durable`). The output then names the job's
committed version, step and configuration. Without it the job lives in its
workers' memory only: a crash of every worker loses it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.live.agent import Launcher
from ptcfs.errors import LiveError, PtcError


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ptcfs.client.live",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, required=True, help="workers of the first generation")
    p.add_argument("--standby", type=int, default=0, help="warm standby workers")
    p.add_argument("--change", action="append", default=[], metavar="STEP:N|STEP:replace")
    p.add_argument("--logs", type=Path, help="a folder for each worker's output")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--job", help="keep the job's state in this ptcfs job (created or resumed)")
    p.add_argument("--cluster", type=Path, help="the cluster file (default: $PTC_CLUSTER)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the worker's command line")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("give the worker's command after --")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.cluster is not None and not args.job:
        p.error("--cluster goes with --job (the job kept in that cluster)")
    return args


def _changes(texts: list[str]) -> list[tuple[int, str]]:
    out = []
    for t in texts:
        step, _, what = t.partition(":")
        if not step.isdigit() or not (what == "replace" or what.isdigit()):
            raise LiveError(f"--change {t!r}: give STEP:N or STEP:replace")
        out.append((int(step), what))
    return out


def run(args: argparse.Namespace) -> dict:
    changes = _changes(args.change)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.job:
        env["PTC_LIVE_JOB"] = args.job
        if args.cluster is not None:
            env["PTC_CLUSTER"] = str(args.cluster.resolve())
        # a missing cluster file fails here, not in every worker
        Cluster.load(env.get("PTC_CLUSTER")).close()
    launcher = Launcher(args.command, env=env, logs=args.logs)
    try:
        workers = [f"w{i}" for i in range(args.workers)]
        standby = [f"s{i}" for i in range(args.standby)]
        for name in workers + standby:
            launcher.spawn(name)
        launcher.ready(workers)
        launcher.post(workers)
        steps = [launcher.applied(1, args.timeout)]
        fresh = len(standby)
        for at, what in changes:
            cur = list(launcher.current.workers)
            if what == "replace":
                want = len(cur)
                cur = cur[:-1]
            else:
                want = int(what)
                cur = cur[:want]
            while len(cur) < want:
                if not standby:
                    standby.append(f"s{fresh}")
                    launcher.spawn(standby[-1])
                    fresh += 1
                cur.append(standby.pop(0))
            launcher.ready(cur)
            gen = launcher.post(cur, at_step=at)
            steps.append(launcher.applied(gen.number, args.timeout))
        codes = launcher.finish(args.timeout)
        for g in launcher.generations[len(steps):]:  # generations the watcher posted
            steps.append(launcher.applied(g.number, 1.0) if launcher.store.check(
                [f"applied/{g.number}"]) else -1)
        out = {"generations": [dict(asdict(g), step=s)
                               for g, s in zip(launcher.generations, steps)],
               "exit": codes, "restarted": launcher.restarted(),
               "lost": [w for w, _, _ in launcher.losses]}
        if args.job:
            out["job"] = _committed(args.job, env.get("PTC_CLUSTER"))
        return out
    finally:
        launcher.close()


def _committed(job: str, cluster: str | None) -> dict:
    """The job's committed version, step and configuration (after the run)."""
    conn = Cluster.load(cluster)
    try:
        st = Coordinator(conn).state(job)
    finally:
        conn.close()
    return {"name": job, "version": st.version, "step": st.step, "config": st.describe()}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # a stopped launcher ends its workers too (run's finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        out = run(args)
    except PtcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    failed = {w: c for w, c in out["exit"].items() if c not in (0,) and w not in out["lost"]}
    if args.json:
        print(json.dumps(out))
    else:
        for g in out["generations"]:
            print(f"generation {g['number']} at step {g['step']}: {', '.join(g['workers'])}"
                  + (f" (lost {', '.join(g['lost'])})" if g["lost"] else ""))
        print(f"workers restarted: {out['restarted']}")
        if "job" in out:
            j = out["job"]
            print(f"job {j['name']}: version {j['version']} at step {j['step']}, {j['config']}")
    if failed:
        print(f"error: workers failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
