"""The text and Markdown reports of ``bench/run``: one summary table with
every ratio against a peer, then each section's own table.

Ratios are ptcfs / peer. For times and bytes lower is better; for
throughput (samples/s, GB/s) higher is better; the table says which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import fmt_fig, table

__all__ = ["summary_rows", "render", "markdown"]

LOWER, HIGHER = "lower is better", "higher is better"


def _r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _reshard(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in r["cases"]:
        rows.append(["reshard", f"{c['case']}: end to end", fmt_fig(c, "ptcfs_s"),
                     "DCP " + fmt_fig(c, "dcp_s"), _r(c["ratio_vs_dcp"]), LOWER])
        rows.append(["reshard", f"{c['case']}: end to end", fmt_fig(c, "ptcfs_s"),
                     "central " + fmt_fig(c, "central_s"), _r(c["ratio_vs_central"]), LOWER])
    rows.append(["reshard", "both transitions", f"{r['ptcfs_s']:.2f} s",
                 f"DCP {r['dcp_s']:.2f} s", _r(r["ratio_vs_dcp"]), LOWER])
    for s in r.get("stage", []):
        size = f"{s['state_bytes'] / 1e9:.2f} GB"
        rows.append(["reshard", f"stage within hosts, {size}: views vs copies",
                     fmt_fig(s, "views_stage_s", digits=3),
                     "copies " + fmt_fig(s, "copies_stage_s", digits=3),
                     _r(s["views_vs_copies"]), LOWER + ", target <= 0.05"])
        rows.append(["reshard", f"stage within hosts, {size}: a store's growth / state",
                     f"{100 * s['views_max_grew_share']:.3f}%",
                     f"copies {100 * max(s['copies_grew_share'].values()):.0f}%", "",
                     "target < 1%"])
    return rows


def _planner(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in r["cases"]:
        rows.append(["planner", f"{c['case']}: max sent by a host",
                     f"{c['max_send'] / 1e9:.2f} GB",
                     f"greedy {c['max_send_greedy'] / 1e9:.2f} GB",
                     _r(c["max_send_ratio_vs_greedy"]), LOWER])
        rows.append(["planner", f"{c['case']}: across hosts", f"{c['cross'] / 1e9:.1f} GB",
                     f"greedy {c['cross_greedy'] / 1e9:.1f} GB",
                     _r(c["cross_ratio_vs_greedy"]), LOWER])
        rows.append(["planner", f"{c['case']}: max sent by a host",
                     f"{c['max_send'] / 1e9:.2f} GB",
                     f"round-robin {c['max_send_round_robin'] / 1e9:.2f} GB",
                     _r(c["max_send_ratio_vs_round_robin"]), LOWER])
    return rows


def _data(r: dict[str, Any]) -> list[list[str]]:
    if "missing" in r.get("ptcfs", {}):
        return [["data", "ptcfs side", "missing", r["ptcfs"]["missing"], "", ""]]
    ours, peer = r["ptcfs"], r["streaming"]
    rows = []
    for key in (k for k in ours if k.startswith("dp")):
        o, p = ours[key], peer[key]
        dp = o["dp"]
        rows.append(["data", f"dp {dp}: duplicates/skips", f"{o['duplicates']}/{o['skipped']}",
                     f"streaming {p['duplicates']}/{p['skipped']}", "", "0/0 wanted"])
        rows.append(["data", f"dp {dp}: resume to first batch", fmt_fig(o, "resume_s"),
                     "streaming " + fmt_fig(p, "resume_s"),
                     _r(r.get(f"resume_ratio_vs_streaming_{key}")), LOWER])
        rows.append(["data", f"dp {dp}: steady samples/s", fmt_fig(o, "samples_per_s", "", 1, 0),
                     "streaming " + fmt_fig(p, "samples_per_s", "", 1, 0),
                     _r(r.get(f"throughput_ratio_vs_streaming_{key}")), HIGHER])
    return rows


def _fuse(r: dict[str, Any]) -> list[list[str]]:
    return [["fuse", "cold read, GB/s", f"mount {r['mount_cold_gbs']:.2f}",
             f"/dev/shm {r['shm_cold_gbs']:.2f}", _r(r["mount_vs_shm_cold"]), HIGHER],
            ["fuse", "not yet cached, GB/s", f"mount {r['mount_uncached_gbs']:.2f}",
             f"/dev/shm {r['shm_cold_gbs']:.2f}", _r(r["uncached_vs_shm_cold"]), HIGHER],
            ["fuse", "repeated read, GB/s", f"mount {r['mount_repeat_gbs']:.2f}",
             f"/dev/shm {r['shm_repeat_gbs']:.2f}", _r(r["mount_vs_shm_repeat"]), HIGHER],
            ["fuse", "LMDB direct, GB/s", f"{r['lmdb_gbs']:.2f}", "", "", ""],
            ["fuse", "small files opened and read, files/s",
             f"mount {r['small_mount_opens_s']:.0f}", f"/dev/shm {r['small_shm_opens_s']:.0f}",
             _r(r["small_mount_vs_shm"]), HIGHER]]


def _wire(r: dict[str, Any]) -> list[list[str]]:
    return [["wire", "read from a daemon with keys, GB/s", "sealed " + fmt_fig(
                r, "sealed_gbps", "GB/s"), "CurveZMQ " + fmt_fig(r, "curve_gbps", "GB/s"),
             _r(r["sealed_vs_curve"]), HIGHER],
            ["wire", "sealed against ZeroMQ's plain TCP", "sealed " + fmt_fig(
                r, "sealed_gbps", "GB/s"), "ZeroMQ " + fmt_fig(r, "zmq_plain_gbps", "GB/s"),
             _r(r["sealed_vs_zmq_plain"]), HIGHER + ", 1 = the limit"]]


def _cluster(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in r["cases"]:
        rows.append(["cluster", f"{c['case']}: end to end", fmt_fig(c, "ptcfs_s"),
                     "DCP over HTTP " + fmt_fig(c, "dcp_s"), _r(c["ratio_vs_dcp"]), LOWER])
        rows.append(["cluster", f"{c['case']}: share of the link's speed",
                     fmt_fig(c, "ptcfs_s"), "limit " + fmt_fig(c, "limit_s"),
                     _r(c["vs_limit"]), "limit / ptcfs, 1 = link"])
    return rows


SUMMARY: dict[str, Callable[[dict[str, Any]], list[list[str]]]] = {
    "reshard": _reshard, "planner": _planner, "data": _data, "fuse": _fuse,
    "wire": _wire, "cluster": _cluster}


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, fn in SUMMARY.items():
        sec = results.get(name)
        if sec is None:
            continue
        if "missing" in sec:
            rows.append([name, "MISSING", "", sec["missing"], "", ""])
            continue
        if "not_run" in sec:
            rows.append([name, "SKIPPED", "", sec["not_run"], "", ""])
            continue
        rows.extend(fn(sec))
    return rows


def render(results: dict[str, Any],
           renderers: dict[str, Callable[[dict[str, Any]], str]]) -> str:
    """The whole text report."""
    parts = [f"mode {results['mode']}; ratio = ptcfs / peer; medians (min-max)",
             table(summary_rows(results), ["section", "figure", "ptcfs", "peer", "ratio",
                                           "reading"])]
    for name, fn in renderers.items():
        sec = results.get(name)
        if sec is not None and "missing" not in sec and "not_run" not in sec:
            parts.append(f"== {name} ==\n{fn(sec)}")
    if results.get("failures"):
        parts.append("FAILURES:\n" + "\n".join(f"- {f}" for f in results["failures"]))
    return "\n\n".join(parts)


def markdown(results: dict[str, Any], text: str) -> str:
    """bench/RESULTS.md: machine, versions, command, then the text report."""
    m = results["machine"]
    lines = ["# Benchmark results", "",
             f"Command: `{results['command']}` ({results['mode']} mode), started "
             f"{results['started']}, took {results['total_seconds']:.0f} s.", "",
             "| machine | |", "|---|---|"]
    for k in ("cpu", "cores", "memory_gib", "os", "python", "torch", "numpy",
              "mosaicml_streaming", "commit"):
        lines.append(f"| {k} | {m.get(k)} |")
    lines += ["", "Ratios are ptcfs / peer, measured in the same run on the same data; "
              "figures are medians of the runs with min-max in brackets. "
              "See bench/README.md for what each figure means.", "",
              "```", text, "```", ""]
    png = results.get("scaling", {}).get("png")
    if png:
        lines += [f"![scaling curves]({png.rsplit('/', 1)[-1]})", ""]
    png = results.get("cluster", {}).get("png", "")
    if png.endswith(".png"):
        lines += [f"![time vs hosts on the shaped cluster]({png.rsplit('/', 1)[-1]})", ""]
    return "\n".join(lines)


def merged(old: str, report: str) -> str:
    """A results file with ``report`` in place of the run's report at its
    top (everything before the first ``## `` heading) and the sections
    written by hand after it kept."""
    at = 0 if old.startswith("## ") else old.find("\n## ") + 1
    kept = old[at:] if at > 0 or old.startswith("## ") else ""
    return report.rstrip("\n") + "\n\n" + kept if kept else report
