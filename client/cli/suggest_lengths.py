"""``ptcctl suggest ... --seq-lengths FILE|JOB``: one mesh per sequence-length
group (:mod:`ptcfs.suggest.lengths`), from a file of lengths or the coming
steps of a job's dataset (:mod:`ptcfs.client.control.lookahead`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from ptcfs.client.cli.app import emit_json
from ptcfs.errors import BadInput
from ptcfs.suggest.lengths import GroupPlan, plan_groups
from ptcfs.suggest.search import Query
from ptcfs.units import fmt_bytes

__all__ = ["run_lengths", "read_lengths", "plan_json"]


def read_lengths(text: str, where: str) -> list[int]:
    """Whole numbers separated by white space or commas."""
    words = [w for w in re.split(r"[\s,]+", text) if w]
    try:
        out = [int(w) for w in words]
    except ValueError as e:
        raise BadInput(f"{where}: expected whole numbers of tokens ({e})") from e
    if not out:
        raise BadInput(f"{where}: no sequence lengths in it")
    return out


def _lengths(args: argparse.Namespace) -> list[int]:
    src = args.seq_lengths
    path = Path(src)
    if path.is_file():
        return read_lengths(path.read_text(encoding="utf-8"), src)
    if "/" in src or path.suffix:
        raise BadInput(f"--seq-lengths {src}: no such file (a job name has no '/' or '.')")
    from ptcfs.client.control.conn import Cluster
    from ptcfs.client.control.lookahead import coming_steps

    cluster = Cluster.load(None)  # PTC_CLUSTER
    try:
        ahead = coming_steps(cluster, src, args.lookahead)
    finally:
        cluster.close()
    if ahead["unit"] != "tokens":
        raise BadInput(f"the dataset of {src!r} has no token count per sample; give a file "
                       "of lengths instead")
    return [n for s in ahead["step_lengths"] for n in s["lengths"]]


def plan_json(p: GroupPlan) -> dict[str, Any]:
    return {
        "groups": [{"bound": g.bound, "sequences": g.count, "tokens": g.tokens,
                    "config": g.estimate.config.degrees_text(),
                    "degrees": g.estimate.config.degrees(), "seconds": g.seconds,
                    "memory_bytes": g.estimate.memory} for g in p.groups],
        "switch_seconds": p.switch_seconds, "switch_bytes": p.switch_bytes,
        "step_seconds": p.seconds,
        "single_mesh": {"config": p.single.degrees_text(), "degrees": p.single.degrees(),
                        "seconds": p.single_seconds},
        "speedup_vs_single_mesh": p.speedup,
    }


def run_lengths(args: argparse.Namespace, q: Query) -> int:
    lengths = _lengths(args)
    p = plan_groups(q, lengths)
    if args.json:
        emit_json(plan_json(p))
        return 0
    total = p.seconds
    print(f"{len(lengths)} sequences in {len(p.groups)} group(s), "
          f"{q.batch} sequences a step")
    print(f"  {'up to':>8} {'seqs':>7} {'mesh':34} {'step share':>10} {'mem/GPU':>10}")
    for g in p.groups:
        print(f"  {g.bound:>8} {g.count:>7} {g.estimate.config.degrees_text():34} "
              f"{g.seconds / total:>9.0%} {fmt_bytes(g.estimate.memory):>10}")
    print(f"switches: {p.switch_seconds:.3f} s a step ({fmt_bytes(p.switch_bytes)} between GPUs)")
    print(f"step: {total:.3f} s; best single mesh {p.single.degrees_text()}: "
          f"{p.single_seconds:.3f} s; predicted gain {p.speedup:.2f}x")
    return 0
