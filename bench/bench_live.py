"""Live changes against restarts, same model, same changes, same run.

The example LLaMA (``examples/live_llama.py``, FSDP2 + tensor parallelism,
``--hsdp``) on gloo, CPU:

1. **Live** (``python -m ptcfs.client.live``): 4 workers; after step 3 two
   leave (*shrink*), after step 5 a warm standby joins (*grow*), after step
   7 the last worker is swapped for a standby (*replace*), at step 10 a
   worker is killed (*lose*). Per change: the time from the decision to the
   end of the first step after it, as the first worker saw it, the slowest
   worker's rebuild of its module on the new mesh (a joiner's, for a grow
   or a replace: its standby built the module once while it waited), and
   the bytes the workers received against what the plan gave them.
2. **Restart** (unless ``--no-restart``): the same changes with torchrun
   (``examples/train_llama.py``) on a local ptcfs cluster: each change saves
   the step, stops every worker and starts new ones, which reconfigure the
   job and load it; the lost worker rolls the job back to its last commit.
   Per change: the time from the last step before it to the first step
   after it.
3. **Hot switch** (``examples/hotswitch_llama.py``): every step's short
   micro-batch on fsdp=4, the long one on fsdp=2,tp=2; the median time of
   a step's two switches against the step's.
4. **Live with a job** (``--job``): the live run of 1 again, its state kept
   in a ptcfs job on a local cluster (the launcher's ``--job``, saving every
   2 steps): each change's copy committed in the background after its
   first step. Per change: the same time from the decision to the end of
   the first step after it, and its extra cost over the run without a job
   (``job_extra_s``); for the whole run, the median step and its extra
   cost, and the job's last committed step.

    python bench/bench_live.py [--quick] [--json] [--job]

``--quick`` trains fewer steps after the last change. No GPU is used;
on CUDA the same runs would use NCCL (not measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from live_summary import live_downtimes, lost_steps, read, restart_downtimes  # noqa: E402

from ptcfs.server.testing.localcluster import LocalCluster  # noqa: E402

KINDS = ("shrink", "grow", "replace", "lose")
CHANGES = ("--change", "3:2", "--change", "5:3", "--change", "7:replace")
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> str:
    with open(log, "w") as err:
        p = subprocess.run(cmd, env=env or _env(), stdout=subprocess.PIPE, stderr=err,
                           text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"bench_live: {' '.join(cmd[:4])}... failed; see {log}")
    return p.stdout


def live(d: Path, tokens: Path, steps: int, job: bool = False) -> dict[str, Any]:
    """Mode 1; ``job``: mode 4 (its state kept in a job on a local cluster)."""
    name = "live-job" if job else "live"
    lc = LocalCluster(d / "cluster-live") if job else None
    env, kept, saves = _env(), [], []
    if lc is not None:
        lc.up(1, gpus=4, mount=False)
        env["PTC_CLUSTER"] = str(lc.cluster_file)
        kept, saves = ["--job", "bench"], ["--save-every", "2"]
    try:
        out = json.loads(_run([PY, "-m", "ptcfs.client.live", "--workers", "4", "--standby",
                               "2", *CHANGES, *kept, "--json", "--logs", str(d / f"{name}-logs"),
                               "--", PY, str(ROOT / "examples" / "live_llama.py"), "--data",
                               str(tokens), "--hsdp", "--steps", str(steps), "--die-at",
                               "s1:10", *saves, "--metrics", str(d / f"{name}.jsonl")],
                              d / f"{name}.err", env))
    finally:
        if lc is not None:
            lc.down()
    records, events = read(d / f"{name}.jsonl")
    downs = live_downtimes(events)
    moved: dict[int, tuple[int, int]] = {}
    rebuilt: dict[int, float] = {}
    for e in events:
        if e["event"] in ("change", "loss"):
            got, want = moved.get(e["generation"], (0, 0))
            moved[e["generation"]] = (got + e["bytes_received"], want + e["bytes_planned_in"])
            rebuilt[e["generation"]] = max(rebuilt.get(e["generation"], 0.0), e["rebuild_s"])
    per = {}
    for kind, (_, step, secs), gen in zip(KINDS, downs, sorted(moved)):
        per[kind] = {"after_step": step, "live_s": round(secs, 4),
                     "slowest_rebuild_s": round(rebuilt[gen], 4),
                     "bytes_received": moved[gen][0], "bytes_planned": moved[gen][1]}
    times = [r["time"] for r in records]
    step_s = statistics.median(b - a for a, b in zip(times, times[1:]))
    return {"kinds": per, "restarted": out["restarted"], "steps_lost": lost_steps(records),
            "median_step_s": round(step_s, 4),
            **({"job_step": out["job"]["step"]} if job else {})}


def with_job(plain: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """Mode 4's figures, each with its extra cost over mode 1's."""
    for k, v in job["kinds"].items():
        v["job_extra_s"] = round(v["live_s"] - plain["kinds"][k]["live_s"], 4)
    job["job_extra_step_s"] = round(job["median_step_s"] - plain["median_step_s"], 4)
    return job


def restart(d: Path, tokens: Path, steps: int) -> dict[str, Any]:
    lc = LocalCluster(d / "cluster")
    lc.up(1, gpus=4)
    try:
        env = dict(_env(), PTC_CLUSTER=str(lc.cluster_file), PTC_HOST="h0")
        for n, extra in ((4, ["--steps", "3"]), (2, ["--steps", "5"]), (3, ["--steps", "7"]),
                         (3, ["--steps", str(steps), "--exit-after", "9"]),
                         (2, ["--steps", str(steps)])):
            _run([TORCHRUN, "--standalone", f"--nproc-per-node={n}",
                  str(ROOT / "examples" / "train_llama.py"), "--job", "restart", "--data",
                  str(tokens), "--save-every", "5", "--metrics", str(d / "restart.jsonl"),
                  *extra], d / f"restart-{n}.err", env)
    finally:
        lc.down()
    records, events = read(d / "restart.jsonl")
    downs = restart_downtimes(records, events)
    return {"kinds": {k: {"after_step": s, "restart_s": round(t, 4)}
                      for k, (s, t) in zip(KINDS, downs)},
            "steps_lost": lost_steps(records)}


def hot_switch(d: Path, tokens: Path, steps: int) -> dict[str, Any]:
    _run([TORCHRUN, "--standalone", "--nproc-per-node=4",
          str(ROOT / "examples" / "hotswitch_llama.py"), "--data", str(tokens), "--steps",
          str(steps), "--metrics", str(d / "hot.jsonl")], d / "hot.err")
    recs = [json.loads(x) for x in (d / "hot.jsonl").read_text().splitlines()][1:]
    step = statistics.median(r["step_s"] for r in recs)
    switch = statistics.median(r["switch_s"] for r in recs)
    return {"step_s": round(step, 4), "switch_s": round(switch, 4),
            "switch_of_step": round(switch / step, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-restart", action="store_true")
    p.add_argument("--job", action="store_true",
                   help="also the live run with its state kept in a ptcfs job (mode 4)")
    p.add_argument("--dir", type=Path, help="keep the runs' files here")
    a = p.parse_args(argv)
    steps = 12 if a.quick else 20
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        d = a.dir or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        tokens = d / "tokens.npy"
        subprocess.run([PY, str(ROOT / "examples" / "make_tokens.py"), str(tokens)],
                       check=True, stdout=subprocess.DEVNULL)
        out: dict[str, Any] = {"live": live(d, tokens, steps)}
        if not a.no_restart:
            out["restart"] = restart(d, tokens, steps)
            for k, v in out["restart"]["kinds"].items():
                mine = out["live"]["kinds"].get(k, {})
                mine["restart_s"] = v["restart_s"]
                if mine.get("live_s"):
                    mine["restart_over_live"] = round(v["restart_s"] / mine["live_s"], 1)
        if a.job:
            out["live_job"] = with_job(out["live"], live(d, tokens, steps, job=True))
        out["hot_switch"] = hot_switch(d, tokens, 6 if a.quick else 12)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{'change':<8} {'live s':>8} {'restart s':>10} {'received/planned bytes':>24}")
    for k, v in out["live"]["kinds"].items():
        print(f"{k:<8} {v['live_s']:8.3f} {v.get('restart_s', float('nan')):10.3f} "
              f"{v['bytes_received']:>11}/{v['bytes_planned']:<11}")
    if "live_job" in out:
        j = out["live_job"]
        print(f"{'change':<8} {'job s':>8} {'extra s':>8}   (live with --job, same run)")
        for k, v in j["kinds"].items():
            print(f"{k:<8} {v['live_s']:8.3f} {v['job_extra_s']:8.3f}")
        print(f"median step: {j['median_step_s']:.4f} s with --job, extra "
              f"{j['job_extra_step_s']:+.4f} s; committed step {j['job_step']}")
    h = out["hot_switch"]
    print(f"hot switch: {h['switch_s']:.4f} s of a {h['step_s']:.4f} s step")
    print(f"steps lost: live {out['live']['steps_lost']}"
          + (f", restart {out['restart']['steps_lost']}" if "restart" in out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
