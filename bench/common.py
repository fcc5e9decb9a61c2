"""Helpers shared by the benchmarks: repeated timing, summaries, ratios,
the machine's description and plain-text tables.

Every figure a benchmark reports is the median of its runs, with the
runs' minimum and maximum beside it (:func:`summary`).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "summary", "put", "timed", "ratio", "fmt_stat", "fmt_fig", "machine", "table",
           "gb"]

ROOT = Path(__file__).resolve().parent.parent


def summary(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """``{"median", "min", "max", "runs"}`` of the measured values."""
    if not values:
        raise ValueError("summary of no runs")
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def put(out: dict[str, Any], key: str, values: Sequence[float], digits: int = 4) -> float:
    """Set ``out[key]`` to the median of ``values`` and ``out["spread"][key]``
    to ``[min, max]``; return the median."""
    s = summary(values, digits)
    out[key] = s["median"]
    out.setdefault("spread", {})[key] = [s["min"], s["max"]]
    return float(s["median"])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ratio(ours: float, peer: float, digits: int = 3) -> float | None:
    """ours / peer, or None when the peer's figure is zero."""
    return round(ours / peer, digits) if peer else None


def fmt_stat(s: dict[str, Any], unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
    """``1.23 s (1.10-1.40)``."""
    return (f"{s['median'] * scale:.{digits}f} {unit} "
            f"({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})")


def fmt_fig(out: dict[str, Any], key: str, unit: str = "s", scale: float = 1.0,
            digits: int = 2) -> str:
    """A figure set by :func:`put`, with its spread: ``1.23 s (1.10-1.40)``."""
    lo, hi = out.get("spread", {}).get(key, [out[key], out[key]])
    return fmt_stat({"median": out[key], "min": lo, "max": hi}, unit, scale, digits)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return "not installed"
    return str(getattr(mod, "__version__", "?"))


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, versions, commit."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    streaming = "not installed"
    try:
        from importlib.metadata import version

        streaming = version("mosaicml-streaming")
    except Exception:  # noqa: BLE001
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "mosaicml_streaming": streaming,
        "commit": commit or "unknown",
    }


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
