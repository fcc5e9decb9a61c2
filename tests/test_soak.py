"""The chaos soak (bench/soak.py), short: three hosts with mounts under
readers, saves, reconfigurations and faults for 45 seconds, then nothing
lost, no torn read, no mount stuck, no process left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multihost, pytest.mark.fuse]

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_loses_nothing_and_tears_nothing(tmp_path: Path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "0.75",
                        "--hosts", "3", "--seed", "5", "--fault-every", "4", "--json",
                        "--dir", str(tmp_path / "soak")],
                       capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert r.stdout, r.stderr[-3000:]
    out = json.loads(r.stdout)
    hangs = "".join(f.read_text()[:4000] for f in sorted((tmp_path / "soak").glob("hang-*.txt")))
    assert out["ok"] and r.returncode == 0, (out["failures"], r.stderr[-3000:], hangs)
    assert out["torn_reads"] == 0 and not out["failures"]
    # the soak did what it says: versions committed, reads checked, faults injected
    assert out["versions_committed"] > 0 and out["bytes_verified"] > 0
    assert sum(v for k, v in out["ops"].items() if k.startswith("read_")) > 0
    assert sum(out["faults"].values()) > 0
