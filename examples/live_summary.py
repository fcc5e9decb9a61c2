"""The four lines of ``live_llama.sh``, from its runs' metrics files.

    live_summary.py REFERENCE LIVE LAUNCHER_JSON [RESTART]

REFERENCE and LIVE are ``live_llama.py`` metrics (uninterrupted, live);
LAUNCHER_JSON what ``python -m ptcfs.client.live --json`` printed for the
live run; RESTART the metrics of the same changes made by restarting with
torchrun (``train_llama.py``). Prints each change's downtime, then::

    max relative loss difference: X      (against the uninterrupted run)
    steps lost: N
    workers restarted: K                 (survivors that got a new process)
    downtime: live A s, restart B s      (decision -> first step after it, summed)

A step lost is a step trained twice (a run that resumed from an earlier
commit). Exits 1 when a step is missing or saw other samples.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path) -> tuple[list[dict], list[dict]]:
    """Step records in order (repeats kept) and events."""
    steps, events = [], []
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            d = json.loads(line)
            (events if "event" in d else steps).append(d)
    return steps, events


def compare(ref: list[dict], got: list[dict]) -> tuple[float, bool]:
    """The largest relative loss difference (last record of each step) and
    whether every step is there with the same samples."""
    r = {d["step"]: d for d in ref}
    g = {d["step"]: d for d in got}
    ok = sorted(r) == sorted(g) and all(g[s]["samples"] == r[s]["samples"] for s in r)
    worst = max((abs(g[s]["loss"] - r[s]["loss"]) / abs(r[s]["loss"]) for s in r if s in g),
                default=float("inf"))
    return worst, ok


def lost_steps(steps: list[dict]) -> int:
    seen = [d["step"] for d in steps]
    return len(seen) - len(set(seen))


def live_downtimes(events: list[dict]) -> list[tuple[str, int, float]]:
    """(kind, step, seconds) of each change, as the first worker saw it."""
    first: dict[int, dict] = {}
    for e in events:
        if e["event"] in ("change", "loss") and e["worker"] != "s0":
            first.setdefault(e["generation"], e)
    return [(e["event"], e["step"], e["downtime_s"]) for _, e in sorted(first.items())]


def restart_downtimes(steps: list[dict], events: list[dict]) -> list[tuple[int, float]]:
    """(step, seconds) of each restart: from the last step record before a
    start to the first step record after it."""
    out = []
    for e in events:
        if e["event"] != "resume" or e["step"] == 0 and not out and e.get("created"):
            continue
        before = [d for d in steps if d["time"] < e["time"]]
        after = [d for d in steps if d["time"] > e["time"]]
        if before and after:
            out.append((before[-1]["step"], after[0]["time"] - before[-1]["time"]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    ref, _ = read(Path(args[0]))
    live, events = read(Path(args[1]))
    launcher = json.loads(Path(args[2]).read_text())
    worst, ok = compare(ref, live)
    lost = lost_steps(live)
    live_dt = live_downtimes(events)
    for kind, step, s in live_dt:
        print(f"live {kind} after step {step}: {s:.3f} s")
    pids: dict[str, set[int]] = {}
    for e in events:
        pids.setdefault(e["worker"], set()).add(e["pid"])
    restarted = max(launcher["restarted"], sum(len(v) - 1 for v in pids.values()))
    restart_total = float("nan")
    if len(args) == 4:
        rsteps, revents = read(Path(args[3]))
        rworst, rok = compare(ref, rsteps)
        rdt = restart_downtimes(rsteps, revents)
        for step, s in rdt:
            print(f"restart after step {step}: {s:.3f} s")
        print(f"restart: max relative loss difference {rworst:.1e}, steps lost "
              f"{lost_steps(rsteps)}")
        restart_total = sum(s for _, s in rdt)
        ok &= rok
    print(f"max relative loss difference: {worst:.1e}")
    print(f"steps lost: {lost}")
    print(f"workers restarted: {restarted}")
    print(f"downtime: live {sum(s for *_, s in live_dt):.2f} s, restart {restart_total:.2f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
