"""``ptcd``'s Prometheus metrics, scraped over HTTP from real daemons during
and after a reconfiguration, a read through a mount and a bad request."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ptcfs.errors import InvalidRequest, TensorNotFound
from ptcfs.server.testing.localcluster import LocalCluster
from tests.daemons import client
from tests.test_cluster import MEDIUM, ptcctl
from tests.test_faults import ctl_env, ptcctl_cmd

pytestmark = [pytest.mark.multihost, pytest.mark.fuse]

#: The longest any wait of these tests lasts.
WAIT_S = 60.0

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(lc: LocalCluster, host: str) -> Samples:
    """``{sample name: {labels (sorted, host left out): value}}``."""
    with urllib.request.urlopen(lc.metrics_url(host), timeout=10) as r:
        text = r.read().decode()
    out: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("host") == host, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "host"))
            out[s.name][labels] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for k, v in samples.get(name, {}).items()
               if set(labels.items()) <= set(k))


def wait_for(lc: LocalCluster, host: str, name: str, at_least: float, **labels: str
             ) -> Samples:
    """Scrape ``host`` until ``name`` reaches ``at_least`` (the mount's
    figures reach the daemon within a second or so)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        s = scrape(lc, host)
        if total(s, name, **labels) >= at_least:
            return s
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {at_least}: {s[name]}"
        time.sleep(0.1)


def test_metrics_move_with_a_reconfiguration_reads_and_errors(local_cluster, monkeypatch):
    monkeypatch.setenv("PTC_STAGE_RATE", "8M")  # the stage lasts long enough to scrape it
    lc = local_cluster(3, mount=True, metrics=True)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "j", "--model", MEDIUM, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "2")
    before = {h: scrape(lc, h) for h in ("h0", "h1", "h2")}
    assert all(total(s, "ptcd_store_used_bytes") > 0 for s in before.values())
    assert all(total(s, "ptcd_store_free_bytes") > 0 for s in before.values())
    assert all(total(s, "ptcd_stage_seconds_count") == 0 for s in before.values())
    proc = subprocess.Popen(ptcctl_cmd("reconfigure", "j", "--to", "tp=1,pp=2",
                                       "--hosts", "h1:1,h2:1"),
                            env=ctl_env(lc), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    during = 0
    try:
        deadline = time.monotonic() + WAIT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if total(scrape(lc, "h2"), "ptcd_peer_received_bytes_total") > 0:
                during += 1  # h2 is fetching its stage, and says so while it runs
            time.sleep(0.05)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert during > 0
    after = {h: scrape(lc, h) for h in ("h0", "h1", "h2")}
    # h2 held nothing: every byte it has it fetched from h0 or h1, which served them
    got = {peer: total(after["h2"], "ptcd_peer_received_bytes_total", peer=peer)
           for peer in ("h0", "h1")}
    assert sum(got.values()) > 0
    for peer, n in got.items():
        assert total(after[peer], "ptcd_peer_sent_bytes_total", peer="h2") == n
    for h in ("h1", "h2"):
        assert total(after[h], "ptcd_stage_seconds_count") == 1
        assert total(after[h], "ptcd_stage_seconds_sum") > 0
        assert total(after[h], "ptcd_commit_seconds_count") >= 1
    assert total(after["h2"], "ptcd_store_used_bytes") > total(before["h2"],
                                                               "ptcd_store_used_bytes")
    assert total(after["h2"], "ptcd_store_versions") >= 1

    # reads through h2's mount: its own pieces are spliced from the store file
    name = "encoder.final_layernorm.bias"
    data = (lc.mount_dir("h2") / "j" / "tensors" / f"{name}.npy").read_bytes()
    mounted = wait_for(lc, "h2", "ptcd_mount_read_bytes_total", len(data))
    assert total(mounted, "ptcd_mount_opens_total") >= 1
    assert total(mounted, "ptcd_mount_reads_total") >= 1
    assert total(mounted, "ptcd_mount_lookup_misses_total") + \
        total(mounted, "ptcd_mount_lookup_hits_total") >= 1

    # errors by kind
    c = client(lc, "h0")
    try:
        with pytest.raises(InvalidRequest):
            c.call("no_such_op")
        with pytest.raises(TensorNotFound):
            c.call("info", job="j", version=1, tensor="nope", part="0")
    finally:
        c.close()
    errs = scrape(lc, "h0")
    assert total(errs, "ptcd_errors_total", kind="InvalidRequest") == 1
    assert total(errs, "ptcd_errors_total", kind="TensorNotFound") == 1


def test_ptcd_refuses_a_bad_metrics_port_in_one_line(tmp_path: Path):
    lc = LocalCluster(tmp_path)
    lc.write(1)
    r = subprocess.run([*lc.command, "--cluster", str(lc.cluster_file), "--host-id", "h0",
                        "--metrics-port", "70000"], capture_output=True, text=True,
                       timeout=WAIT_S, env=dict(os.environ))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--metrics-port" in r.stderr


def test_a_metrics_port_taken_before_the_daemon_binds_it_is_chosen_again(tmp_path: Path):
    """The test clusters choose a free port and the daemon binds it later;
    a port taken in between (by another process that picked it too, or
    bound it itself) makes the daemon exit in one line, and the cluster
    starts it again on another port."""
    lc = LocalCluster(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lc.metrics_ports["h0"] = taken.getsockname()[1]
        try:
            lc.up(1, keys=False, metrics=True)
            assert lc.metrics_ports["h0"] != taken.getsockname()[1]
            assert "Address already in use" in (tmp_path / "h0.log").read_text()
            assert total(scrape(lc, "h0"), "ptcd_errors_total") == 0
        finally:
            lc.down()
