"""Resharding a GPT state with Adam between tensor/data-parallel layouts:
ptcfs against PyTorch DCP and the centralized way, on the same bytes, in
the same run.

Layouts run 4 ranks on 2 local hosts (``h0:2,h1:2``); transitions
tp=2,dp=2 -> tp=4 and tp=4 -> tp=2,dp=2. Per transition and run:

- **ptcfs**: ``Coordinator.reconfigure`` (what ``ptcctl reconfigure``
  runs) across the 2 hosts' daemons, then each of the 4 new ranks loads
  its state from its host's daemon (:func:`load_rank`).
- **DCP**: the same state, saved once by 4 gloo processes as DTensors of the
  old layout (``dcp.save``), is loaded by the 4 processes of the new layout
  into DTensors of that layout (``dcp.load`` reshards).
- **central** (Tenplex's baseline): gather every tensor on one process,
  re-split it, send every host its parts; then the same per-rank loads.

Both systems hand each new rank the same bytes (checked by CRC on the
first run). Checkpoint files and host stores live under ``--dir``.

Then, on the same cluster, the stage phase of tp=2,dp=2 -> tp=4 (nothing
crosses hosts) with views and with every local region copied, for each
``--stage-model`` (default: the bench's model and one with the same
tensors at a quarter of its bytes), and each host's store growth as a
share of the state (:mod:`reshard_stage`).

    .venv/bin/python bench/bench_reshard.py [--model gpt:...] [--runs 3] [--json]
        [--stage-model gpt:... ...] [--no-stage]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_reconfigure import central
from common import fmt_fig, put, ratio, table
from ranks import Ranks
from reshard_ranks import JOB, ReshardRank
from reshard_stage import stage_bench

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.jobstate import JobState
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import parse_config

# fp32 parameters with Adam's two moments: 1.15 GB of state. The vocabulary
# is a multiple of 128*4, so no layout pads it (DTensor shards do not pad).
MODEL = "gpt:layers=8,hidden=768,heads=12,vocab=50176,seq=1024"
SMOKE_MODEL = "gpt:layers=2,hidden=64,heads=4,vocab=1024,seq=64"
# the same 300 tensors at a quarter of the bytes (0.29 GB): the stage bench's second size
STAGE_SMALL = "gpt:layers=8,hidden=384,heads=8,vocab=25088,seq=1024"
HOSTS = "h0:2,h1:2"
TRANSITIONS = (("tp=2,dp=2", "tp=4"), ("tp=4", "tp=2,dp=2"))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _transition(co: Coordinator, ranks: Ranks, a: str, b: str, runs: int,
                work: Path) -> dict[str, Any]:
    cfg_a, cfg_b = parse_config(a, HOSTS), parse_config(b, HOSTS)
    if co.state(JOB).config != cfg_a:
        co.reconfigure(JOB, cfg_a)
    ckpt = work / f"dcp-{a.replace(',', '_').replace('=', '')}"
    save = ranks.call("save_dcp", a, str(ckpt))
    out: dict[str, Any] = {"case": f"{a} -> {b} on {HOSTS}"}
    t: dict[str, list[float]] = {k: [] for k in (
        "ptcfs_s", "ptcfs_reconfigure_s", "ptcfs_load_s", "dcp_s", "central_s",
        "central_transform_s")}
    for i in range(runs):
        verify = i == 0
        planned = co.plan_for(JOB, cfg_b)
        t_central = central(co, planned[0], planned[1])
        t0 = time.perf_counter()
        r = co.reconfigure(JOB, cfg_b, planned=planned)
        t_reconf = time.perf_counter() - t0
        loads = ranks.call("load_ptc", verify)
        dcps = ranks.call("load_dcp", b, str(ckpt), verify)
        t_load, t_dcp = loads[0]["seconds"], dcps[0]["seconds"]
        for k, v in (("ptcfs_s", t_reconf + t_load), ("ptcfs_reconfigure_s", t_reconf),
                     ("ptcfs_load_s", t_load), ("dcp_s", t_dcp),
                     ("central_s", t_central + t_load), ("central_transform_s", t_central)):
            t[k].append(v)
        if verify:
            out["identical"] = all(x["crc"] == y["crc"] for x, y in zip(loads, dcps))
            out["ptcfs_bytes_moved"] = sum(tr.nbytes for tr in r.plan.transfers)
            out["ptcfs_bytes_cross_host"] = r.plan.bytes_cross_host
            out["ptcfs_bytes_loaded"] = sum(x["bytes"] for x in loads)
            out["dcp_bytes_read"] = sum(x["read"] for x in dcps)
        co.reconfigure(JOB, cfg_a)  # back, for the next run
    for k, v in t.items():
        put(out, k, v, 3)
    out["dcp_save_s"] = round(save[0]["seconds"], 3)
    out["dcp_checkpoint_bytes"] = _dir_bytes(ckpt)
    out["ratio_vs_dcp"] = ratio(out["ptcfs_s"], out["dcp_s"])
    out["ratio_vs_central"] = ratio(out["ptcfs_s"], out["central_s"])
    return out


def run(model: str = MODEL, runs: int = 3, directory: str = "/tmp",
        transitions: int = len(TRANSITIONS), stage_models: tuple[str, ...] = ()
        ) -> dict[str, Any]:
    """The transitions (top-level figures are the sums over them), then the
    stage bench for each of ``stage_models``."""
    with tempfile.TemporaryDirectory(prefix="ptc-bench-reshard-", dir=directory) as d:
        work = Path(d)
        lc = LocalCluster(work / "cluster")
        lc.up(2, gpus=2, replicas=1)
        ranks = None
        state = JobState(JOB, 1, model, "fp32", "adam", parse_config(TRANSITIONS[0][0], HOSTS),
                         0, 1, ("h0", "h1"))
        state_bytes = sum(s.nbytes for s in state.model_spec().tensors_for(1))
        cases: list[dict[str, Any]] = []
        try:
            co = Coordinator(Cluster.load(lc.cluster_file))
            if transitions > 0:
                co.create(state, seed=0)
                ranks = Ranks(4, ReshardRank, str(lc.cluster_file))
                cases = [_transition(co, ranks, a, b, runs, work)
                         for a, b in TRANSITIONS[:transitions]]
                if stage_models:  # room for the stage bench's jobs
                    co.delete_job(JOB)
                    for ckpt in work.glob("dcp-*"):
                        shutil.rmtree(ckpt)
            co.cluster.close()
            stage = [stage_bench(lc, m, HOSTS, runs) for m in stage_models]
        finally:
            if ranks is not None:
                ranks.close()
            lc.down()
    out: dict[str, Any] = {"model": model, "dtype": "fp32", "optimizer": "adam",
                           "state_bytes": state_bytes, "runs": runs}
    for k in ("ptcfs_s", "dcp_s", "central_s"):
        out[k] = round(sum(c[k] for c in cases), 3)
    out["ratio_vs_dcp"] = ratio(out["ptcfs_s"], out["dcp_s"])
    out["ratio_vs_central"] = ratio(out["ptcfs_s"], out["central_s"])
    out["identical"] = all(c["identical"] for c in cases)
    out["cases"] = cases
    if stage:
        out["stage"] = stage
        out["stage_views_vs_copies"] = max(s["views_vs_copies"] or 0.0 for s in stage)
        out["stage_views_max_grew_share"] = max(s["views_max_grew_share"] for s in stage)
    return out


def render_stage(stage: list[dict[str, Any]]) -> str:
    """The stage bench's table."""
    rows = []
    for s in stage:
        grew = ", ".join(f"{h} {100 * v:.3f}%" for h, v in s["views_grew_share"].items())
        pages = ", ".join(f"{h} {v / 1e6:.2f} MB" for h, v in
                          s["views_pages_grew_bytes"].items())
        copied = ", ".join(f"{h} {100 * v:.0f}%" for h, v in s["copies_grew_share"].items())
        rows.append([f"{s['state_bytes'] / 1e9:.2f} GB", fmt_fig(s, "views_stage_s", digits=3),
                     fmt_fig(s, "copies_stage_s", digits=3), f"{s['views_vs_copies']:.3f}",
                     fmt_fig(s, "views_host_stage_s", digits=3),
                     fmt_fig(s, "copies_host_stage_s", digits=3), grew, pages, copied])
    head = (f"stage phase of {stage[0]['case']} (nothing crosses hosts), views "
            f"(PTC_STAGE_VIEWS=1) vs copies (=0); medians of {stage[0]['runs']} runs (min-max); "
            f"target: views <= 0.05x copies, stores grow < 1% of the state\n")
    return head + table(rows, ["state", "views", "copies", "ratio", "host: views",
                               "host: copies", "stored growth, views", "pages, views",
                               "stored growth, copies"])


def render(r: dict[str, Any]) -> str:
    if not r["cases"]:
        return render_stage(r["stage"]) if r.get("stage") else "nothing was run"
    rows = []
    for c in r["cases"]:
        rows.append([
            c["case"], fmt_fig(c, "ptcfs_s"), fmt_fig(c, "dcp_s"), fmt_fig(c, "central_s"),
            f"{c['ratio_vs_dcp']:.2f}", f"{c['ratio_vs_central']:.2f}",
            f"{c['ptcfs_bytes_cross_host'] / 1e9:.2f}/{c['ptcfs_bytes_moved'] / 1e9:.2f}",
            f"{c['dcp_bytes_read'] / 1e9:.2f}", "yes" if c["identical"] else "NO",
        ])
    head = (f"{r['model']} fp32 + Adam, {r['state_bytes'] / 1e9:.2f} GB of state; "
            f"times are medians of {r['runs']} runs (min-max); ratio = ptcfs / peer\n")
    text = head + table(rows, ["transition", "ptcfs", "DCP", "central", "vs DCP",
                               "vs central", "ptcfs GB cross/moved", "DCP GB read",
                               "same bytes"])
    if r.get("stage"):
        text += "\n\n" + render_stage(r["stage"])
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL, help=f"GPT preset (default {MODEL})")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp", help="where stores and checkpoints live")
    ap.add_argument("--transitions", type=int, default=len(TRANSITIONS),
                    help="run only the first N transitions (0: only the stage bench)")
    ap.add_argument("--stage-model", action="append", default=None, metavar="MODEL",
                    help="a model for the stage bench, views vs copies (repeatable; default: "
                         f"--model, and {STAGE_SMALL} with the default --model)")
    ap.add_argument("--no-stage", action="store_true", help="skip the stage bench")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    stage: tuple[str, ...] = ()
    if not args.no_stage:
        stage = tuple(args.stage_model or ([MODEL, STAGE_SMALL] if args.model == MODEL
                                           else [args.model]))
    r = run(args.model, args.runs, args.dir, args.transitions, stage)
    print(json.dumps(r) if args.json else render(r))
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
