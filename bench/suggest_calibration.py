"""The mesh chooser against the published runs ``tests/test_suggest_published.py``
holds (torchtitan's H100 tables and its first 405B runs, Llama 3's Table 4,
NVIDIA's tuned Megatron-Core recipes on H100): for each, the estimated step
over the one the run measured, the estimated memory over the measured, and
where the published mesh stands among every mesh of its GPUs (on the front
``ptcctl suggest`` shows, or its step over the fastest that fits).

    .venv/bin/python bench/suggest_calibration.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ptcfs.suggest import suggest  # noqa: E402
from ptcfs.suggest.memory import StateClasses  # noqa: E402
from ptcfs.suggest.search import dominates, estimate  # noqa: E402
from tests.test_suggest_published import (  # noqa: E402
    ALL_ROWS,
    Run,
    _measured_step,
    _query,
)


def row(run: Run) -> dict[str, object]:
    q, cfg = _query(run)
    e = estimate(q, cfg, StateClasses(q.model))
    s = suggest(q)
    assert s.best is not None
    return {"run": run.label, "mesh": cfg.degrees_text(),
            "step_vs_measured": e.step / _measured_step(run) if run.tps else None,
            "memory_vs_measured": e.memory / 2**30 / run.memory_gib if run.memory_gib else None,
            "on_front": not any(dominates(o, e) for o in s.estimates),
            "step_vs_best": e.step / s.best.step, "best": s.best.config.degrees_text()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    rows = [row(r) for r in ALL_ROWS]
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0

    def ratio(v: object) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "-"

    print(f"{'run':31} {'step/meas':>9} {'mem/meas':>8} {'front':>5} {'step/best':>9}  best")
    for r in rows:
        print(f"{r['run']:31} {ratio(r['step_vs_measured']):>9} "
              f"{ratio(r['memory_vs_measured']):>8} {'yes' if r['on_front'] else 'no':>5} "
              f"{ratio(r['step_vs_best']):>9}  {r['best']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
