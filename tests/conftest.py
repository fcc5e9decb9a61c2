"""Test tiers: tests marked ``gpu`` skip themselves without CUDA, ``fuse``
without /dev/fuse and fusermount3; everything else runs everywhere."""

from __future__ import annotations

import os
import shutil

import pytest


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


@pytest.fixture
def local_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Start real ptcd daemons on loopback: ``local_cluster(n, **kw)`` returns a
    LocalCluster; every daemon started is stopped at teardown, even on failure."""
    from ptcfs.server.localcluster import LocalCluster

    started: list[LocalCluster] = []

    def start(n: int, **kw: object) -> LocalCluster:
        lc = LocalCluster(tmp_path_factory.mktemp("cluster"))
        started.append(lc)
        lc.up(n, **kw)  # type: ignore[arg-type]
        return lc

    yield start
    for lc in started:
        lc.down()
