"""Test tiers: tests marked ``gpu`` skip themselves without CUDA, ``fuse``
without /dev/fuse and fusermount3; everything else runs everywhere.

Order: test files run heaviest first, by the seconds each took in a recorded
run (``tests/weights.json``; files it does not name come last, in their
usual order), so that on several workers (``deploy/test.sh`` runs pytest-xdist
with ``--dist loadfile --no-loadscope-reorder``) no long file starts last
while the other workers sit idle. ``PTC_RECORD_WEIGHTS=1`` writes the
file's figures from the run it is set for."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

WEIGHTS = Path(__file__).with_name("weights.json")
_spent: dict[str, float] = defaultdict(float)


def _cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "CUDA is not available on this machine"


def _fuse() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {"gpu": _cuda, "fuse": _fuse}
    cache: dict[str, str | None] = {}
    for item in items:
        for mark, probe in reasons.items():
            if item.get_closest_marker(mark) is None:
                continue
            if mark not in cache:
                cache[mark] = probe()
            if cache[mark]:
                item.add_marker(pytest.mark.skip(reason=cache[mark]))
    try:
        weights = json.loads(WEIGHTS.read_text())
    except (OSError, ValueError):
        weights = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_file(item.nodeid), i)
    # stable: a file's tests keep their order
    items.sort(key=lambda it: (-float(weights.get(_file(it.nodeid), 0.0)),
                               first[_file(it.nodeid)]))


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """``PTC_RECORD_WEIGHTS=1``: the seconds each file took, into ``WEIGHTS``
    (by the process that sees every report: xdist's controller, or the
    only one)."""
    if os.environ.get("PTC_RECORD_WEIGHTS") != "1" or hasattr(session.config, "workerinput"):
        return
    if _spent:
        WEIGHTS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(
            _spent.items(), key=lambda kv: -kv[1])}, indent=1) + "\n")


@pytest.fixture
def local_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Start real ptcd daemons on loopback: ``local_cluster(n, **kw)`` returns a
    LocalCluster; every daemon started is stopped at teardown, even on failure."""
    from ptcfs.server.testing.localcluster import LocalCluster

    started: list[LocalCluster] = []

    def start(n: int, **kw: object) -> LocalCluster:
        lc = LocalCluster(tmp_path_factory.mktemp("cluster"))
        started.append(lc)
        lc.up(n, **kw)  # type: ignore[arg-type]
        return lc

    yield start
    for lc in started:
        lc.down()
