"""Print two runs' per-step losses side by side (the metrics files of
train_gpt.py) and, last, ``max relative loss difference: X``. Exits 1 when
a step is missing, saw other samples, or differs by more than --tolerance."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def steps(path: Path) -> dict[int, dict]:
    """The last record of each step (a resumed run repeats the lost steps)."""
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if "event" not in d:
            out[d["step"]] = d
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", type=Path)
    p.add_argument("other", type=Path)
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args(argv)
    ref, got = steps(a.reference), steps(a.other)
    for line in a.other.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "resume":
            print(f"started at step {e['step']:>3} on {e['world']} workers: {e['config']:<24} "
                  + (f"(created the job in {e['reconfigure_s']:.2f} s)" if e["created"] else
                     f"(reconfigure {e['reconfigure_s']:.2f} s, load {e['load_s']:.2f} s)"))
    ok = sorted(ref) == sorted(got)
    worst = 0.0
    print(f"{'step':>4}  {'uninterrupted':>13}  {'elastic':>11}  {'rel. diff':>9}  configuration")
    for s in sorted(ref):
        r = ref[s]
        g = got.get(s)
        if g is None:
            print(f"{s:>4}  {r['loss']:13.6f}  {'missing':>11}")
            continue
        rel = abs(g["loss"] - r["loss"]) / abs(r["loss"])
        worst = max(worst, rel)
        same = g["samples"] == r["samples"]
        ok &= same
        print(f"{s:>4}  {r['loss']:13.6f}  {g['loss']:11.6f}  {rel:9.1e}  {g['config']}"
              + ("" if same else "  OTHER SAMPLES"))
    print("samples: " + ("the same at every step" if ok else "DIFFERENT (see above)"))
    print(f"max relative loss difference: {worst:.3g}")
    return 0 if ok and worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
