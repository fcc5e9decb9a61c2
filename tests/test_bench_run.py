"""``bench/run --smoke --json``: every section runs on tiny sizes and its JSON
has the keys the benchmark issue names, with sane values. Figures are not
checked against any time: the machine is shared and smoke sizes mean
nothing; only correctness (same bytes as DCP, no duplicates or skips,
never worse than HotSPa's greedy planner) and the report's shape are."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the benchmarks run by hand (bench/run); here only with the wider sweeps
pytestmark = [pytest.mark.slow, pytest.mark.multihost, pytest.mark.extended]


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("bench")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run_all.py"), "--smoke", "--json",
         "--no-install", "--dir", str(d / "work"), "--results", str(d / "RESULTS.md")],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert line, f"bench/run printed no JSON (exit {r.returncode}): {r.stderr[-2000:]}"
    out: dict[str, Any] = json.loads(line[-1])
    out["_exit"], out["_dir"] = r.returncode, d
    return out


def _need(section: dict[str, Any]) -> None:
    if "missing" in section and "not installed" in section["missing"]:
        pytest.skip(section["missing"])
    assert "missing" not in section, section["missing"]


def test_reshard_keys(smoke: dict[str, Any]) -> None:
    r = smoke["reshard"]
    _need(r)
    for k in ("ptcfs_s", "dcp_s", "central_s", "ratio_vs_dcp"):
        assert _positive(r[k]), (k, r[k])
    assert r["identical"] is True  # DCP and ptcfs hand every new rank the same bytes
    c = r["cases"][0]
    assert c["spread"]["ptcfs_s"][0] <= c["ptcfs_s"] <= c["spread"]["ptcfs_s"][1]
    stage = r["stage"][0]  # the stage within hosts, views against copies
    assert _positive(stage["views_stage_s"]) and _positive(stage["copies_stage_s"])
    assert stage["views_max_grew_share"] < max(stage["copies_grew_share"].values())


def test_planner_keys(smoke: dict[str, Any]) -> None:
    p = smoke["planner"]
    if isinstance(p, dict):  # a section reported missing
        _need(p)
    assert isinstance(p, list) and p and smoke["planner_seconds"] > 0
    for c in p:
        for k in ("max_send_ratio_vs_greedy", "cross_ratio_vs_greedy"):
            assert c[k] is not None and 0 < c[k] <= 1.0, (k, c[k])
        assert c["worse_than_greedy"] is False


def test_data_keys(smoke: dict[str, Any]) -> None:
    d = smoke["data"]
    _need(d)
    if "missing" in d.get("ptcfs", {}):
        pytest.skip(d["ptcfs"]["missing"])
    assert d["duplicates"] == 0 and d["skipped"] == 0
    assert _positive(d["resume_ratio_vs_streaming"])
    assert _positive(d["throughput_ratio_vs_streaming"])
    assert d["streaming_duplicates"] >= 0 and d["streaming_skipped"] >= 0


def test_fuse_keys(smoke: dict[str, Any]) -> None:
    f = smoke["fuse"]
    if "missing" in f and not os.path.exists("/dev/fuse"):
        pytest.skip(f["missing"])
    _need(f)
    for k in ("mount_vs_shm_cold", "mount_vs_shm_repeat", "mount_cold_gbs", "shm_cold_gbs",
              "mount_uncached_gbs", "uncached_vs_shm_cold", "small_mount_opens_s",
              "small_shm_opens_s", "small_mount_vs_shm"):
        assert _positive(f[k]), (k, f[k])
    assert f["small_files"] > 0


def test_wire_keys(smoke: dict[str, Any]) -> None:
    w = smoke["wire"]
    _need(w)
    for k in ("sealed_gbps", "curve_gbps", "plain_gbps", "zmq_plain_gbps", "zmq_curve_gbps",
              "sealed_vs_curve", "sealed_vs_zmq_plain"):
        assert _positive(w[k]), (k, w[k])


def test_cluster_keys(smoke: dict[str, Any]) -> None:
    c = smoke["cluster"]
    if "not_run" in c:
        pytest.skip(c["not_run"])
    _need(c)
    assert c["identical"] is True  # checksums kept, DCP loaded the job's bytes
    for case in c["cases"]:
        for k in ("ptcfs_s", "limit_s", "dcp_s", "vs_limit", "ratio_vs_dcp"):
            assert _positive(case[k]), (case["case"], k, case[k])
        assert 0 <= case["ptcfs_idle"] <= 1 and case["ptcfs_cores"] >= 0


def test_scaling_and_report(smoke: dict[str, Any]) -> None:
    s = smoke["scaling"]
    _need(s)
    assert len(s["reconfigure_vs_size"]) >= 2 and len(s["plan_vs_hosts"]) >= 2
    assert all(_positive(x["seconds"]) for x in s["plan_vs_size"])
    if "png" in s:
        assert Path(s["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (smoke["_dir"] / "RESULTS.md").read_text()
    assert "bench/run --smoke" in md and smoke["machine"]["torch"] in md
    # a peer that is not installed (a plain set-up has no bench extra) is reported as
    # missing and makes bench/run exit 1; anything else is a real failure
    real = [f for f in smoke["failures"] if "not installed" not in f]
    assert real == []
    assert smoke["_exit"] == (1 if smoke["failures"] else 0)
