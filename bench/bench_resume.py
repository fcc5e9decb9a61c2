"""Data resumption: ptcfs dataset views against mosaicml-streaming, on the
same token samples, in the same run.

The samples (``--samples`` rows of ``--length`` int32 tokens, token 0 being
the sample's index) are written to MDS shards and ingested into ptcfs
(``ptcctl data ingest --format npy``, 2 local hosts with their /ptc mounts,
every chunk on both). Each system then runs, with global batch ``--batch``:

1. an uninterrupted epoch at dp=2 (the reference);
2. the first third of the epoch at dp=2, then it stops;
3. a resume at dp=1 and one at dp=3 with the same global batch, each read
   to the end of the epoch, ``--runs`` times.

Per resume: duplicates and skips (samples seen more, or fewer, times than
in the reference), global batches that differ from the reference's, the
time from resume to the first batch on every rank (streaming: a new
StreamingDataset, ``load_state_dict``, first batch; ptcfs: committing the
read position, opening the view, first batch), and steady samples/s after
the first batch (all ranks together). Ranks are processes joined by gloo.

    .venv/bin/python bench/bench_resume.py [--samples 98304] [--length 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import ptcctl
from common import fmt_fig, put, ratio, table, timed
from data_ranks import PtcfsDataRank
from ranks import Ranks
from streaming_peer import StreamingRank, write_mds

from ptcfs.server.testing.localcluster import LocalCluster

JOB = "resume"
TINY = "gpt:layers=1,hidden=16,heads=2,vocab=64,seq=8"
SEED = 7
TARGETS = (1, 3)


def make_tokens(n: int, length: int) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, 50000, (n, length), dtype=np.int32)
    tokens[:, 0] = np.arange(n, dtype=np.int32)
    return tokens


def _global(replies: list[dict[str, Any]]) -> list[np.ndarray]:
    """Global batches: step s is every rank's step-s batch."""
    return [np.concatenate([r["ids"][s] for r in replies]) for s in range(len(replies[0]["ids"]))]


def _compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict[str, int]:
    want = Counter(np.concatenate(ref).tolist())
    seen = Counter(np.concatenate(got).tolist()) if got else Counter()
    differ = sum(1 for a, b in zip(ref, got) if sorted(a.tolist()) != sorted(b.tolist()))
    return {"duplicates": sum((seen - want).values()), "skipped": sum((want - seen).values()),
            "batches_differing": differ + abs(len(ref) - len(got)), "batches": len(ref)}


def _system(name: str, factory: Any, args: tuple[Any, ...], batch: int, steps: int,
            runs: int, start: Any, resume: Any, targets: tuple[int, ...]) -> dict[str, Any]:
    """Reference epoch, interrupted part, and resumes at each target dp."""
    with Ranks(2, factory, *args) as r:
        ref = _global(r.call("run", batch, None, start, True))
        part = r.call("run", batch, steps, start, True)
    head = _global(part)
    out: dict[str, Any] = {"system": name, "reference_steps": len(ref)}
    for dp in targets:
        case: dict[str, Any] = {"dp": f"2 -> {dp}"}
        firsts, rates, commits = [], [], []
        with Ranks(dp, factory, *args) as r:
            for i in range(runs):
                got = r.call("run", batch, None, resume(part, dp), i == 0)
                if i == 0:
                    case.update(_compare(ref, head + _global(got)))
                if "commit_s" in got[0]:
                    commits.append(got[0]["commit_s"])
                first = max(g["first_batch_s"] for g in got)
                after = sum(g["samples"] for g in got) - batch
                firsts.append(first)
                rates.append(after / max(max(g["end_s"] for g in got) - first, 1e-9))
        put(case, "resume_s", firsts)
        if commits:  # the part of resume_s spent committing the read position
            put(case, "resume_commit_s", commits)
        put(case, "samples_per_s", rates, 1)
        out[f"dp{dp}"] = case
    return out


def _ptcfs(work: Path, tokens_file: Path, batch: int, steps: int, runs: int,
           targets: tuple[int, ...]) -> dict[str, Any]:
    lc = LocalCluster(work / "cluster")
    try:
        lc.up(2, gpus=2, replicas=2, mount=True)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", JOB, "--model", TINY, "--config", "dp=2", "--hosts",
               "h0:1,h1:1")
        t_ingest, _ = timed(lambda: ptcctl(cf, "data", "ingest", JOB, str(tokens_file),
                                           "--format", "npy", "--global-batch", str(batch),
                                           "--seed", str(SEED), "--quiet"))
        mounts = [str(lc.mount_dir(h)) for h in ("h0", "h1")]
        out = _system("ptcfs", PtcfsDataRank, (str(cf), JOB, mounts), batch, steps, runs,
                      (0, 2), lambda part, dp: (steps, dp), targets)
        out["ingest_s"] = round(t_ingest, 3)
        return out
    finally:
        lc.down()


def _streaming(work: Path, tokens: np.ndarray, batch: int, steps: int, runs: int,
               targets: tuple[int, ...]) -> dict[str, Any]:
    mds = work / "mds"
    write_s = write_mds(tokens, mds)
    out = _system("streaming", StreamingRank, (str(mds), SEED), batch, steps, runs, None,
                  lambda part, dp: part[0]["state"], targets)
    out["write_s"] = round(write_s, 3)
    return out


def run(samples: int = 98304, length: int = 256, batch: int = 96, runs: int = 3,
        directory: str | None = None, targets: tuple[int, ...] = TARGETS) -> dict[str, Any]:
    """Both systems; top-level ratios are geometric means over the target dps."""
    if samples % batch or any(batch % dp for dp in (2, *targets)):
        raise SystemExit(f"--samples must be a multiple of --batch, and --batch of 2 and "
                         f"{', '.join(map(str, targets))}")
    steps = samples // batch // 3
    out: dict[str, Any] = {"samples": samples, "length": length, "global_batch": batch,
                           "resume_at_step": steps, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="ptc-bench-resume-", dir=directory) as d:
        work = Path(d)
        tokens = make_tokens(samples, length)
        np.save(work / "tokens.npy", tokens)
        out["dataset_bytes"] = tokens.nbytes
        out["streaming"] = _streaming(work, tokens, batch, steps, runs, targets)
        if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
            out["ptcfs"] = {"missing": "needs FUSE (/dev/fuse and fusermount3)"}
            return out
        out["ptcfs"] = _ptcfs(work, work / "tokens.npy", batch, steps, runs, targets)
    ours, peer = out["ptcfs"], out["streaming"]
    out["duplicates"] = sum(ours[f"dp{dp}"]["duplicates"] for dp in targets)
    out["skipped"] = sum(ours[f"dp{dp}"]["skipped"] for dp in targets)
    out["streaming_duplicates"] = sum(peer[f"dp{dp}"]["duplicates"] for dp in targets)
    out["streaming_skipped"] = sum(peer[f"dp{dp}"]["skipped"] for dp in targets)
    for key, name in (("resume_s", "resume_ratio_vs_streaming"),
                      ("samples_per_s", "throughput_ratio_vs_streaming")):
        per = [ratio(ours[f"dp{dp}"][key], peer[f"dp{dp}"][key], 6) or 0.0 for dp in targets]
        for dp, v in zip(targets, per):
            out[f"{name}_dp{dp}"] = round(v, 3)
        out[name] = round(math.prod(per) ** (1 / len(per)), 3)
    return out


def render(r: dict[str, Any]) -> str:
    head = (f"{r['samples']} samples of {r['length']} int32 tokens, global batch "
            f"{r['global_batch']}, stopped at step {r['resume_at_step']} at dp=2; "
            f"medians of {r['runs']} resumes (min-max)\n")
    if "missing" in r.get("ptcfs", {}):
        head += f"ptcfs side missing: {r['ptcfs']['missing']}\n"
    rows = []
    dps = [int(k[2:]) for k in r.get("streaming", {}) if k.startswith("dp")]
    for dp in dps:
        for name in ("ptcfs", "streaming"):
            s = r.get(name, {})
            if "missing" in s:
                continue
            c = s[f"dp{dp}"]
            rows.append([f"2 -> {dp}", name, f"{c['duplicates']}/{c['skipped']}",
                         f"{c['batches_differing']}/{c['batches']}", fmt_fig(c, "resume_s"),
                         fmt_fig(c, "resume_commit_s") if "resume_commit_s" in c else "-",
                         fmt_fig(c, "samples_per_s", "/s", digits=0)])
    text = head + table(rows, ["dp", "system", "dup/skip", "batches differing",
                               "resume -> 1st batch", "of it: commit", "samples/s"])
    if "resume_ratio_vs_streaming" in r:
        text += (f"\nptcfs/streaming: resume time {r['resume_ratio_vs_streaming']:.2f}x "
                 f"(lower is better), samples/s {r['throughput_ratio_vs_streaming']:.2f}x "
                 "(higher is better); geometric means over the resumes")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=98304)
    ap.add_argument("--length", type=int, default=256, help="int32 tokens per sample")
    ap.add_argument("--batch", type=int, default=96, help="global batch")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--targets", default="1,3", help="dp degrees to resume at (default 1,3)")
    ap.add_argument("--dir", help="where stores and shards go (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    targets = tuple(int(x) for x in args.targets.split(","))
    r = run(args.samples, args.length, args.batch, args.runs, args.dir, targets)
    print(json.dumps(r, default=str) if args.json else render(r))
    return 0 if r.get("duplicates", 0) == 0 and r.get("skipped", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
