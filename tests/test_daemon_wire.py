"""The daemon against hostile input, CURVE security, and clean restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptcfs.errors import InvalidRequest, PeerError, TensorNotFound
from ptcfs.server.cluster import load_cluster
from ptcfs.server.keys import generate_keys, load_keys
from ptcfs.server.peer import PeerClient
from ptcfs.server.wire import MAX_HEADER, decode_request, encode_request

pytestmark = pytest.mark.multihost


def client(lc, host="h0", keys=None, timeout_s=5.0) -> PeerClient:
    spec = load_cluster(lc.cluster_file)
    if keys is None and spec.curve_dir:
        keys = load_keys(spec.curve_dir)
    return PeerClient(spec.host(host).address, curve=keys, timeout_s=timeout_s, peer_name=host)


def put_sample(c: PeerClient) -> np.ndarray:
    a = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    c.call("begin_at", job="j", version=1)
    c.put("j", 1, "w", "full", a, "fp32")
    c.call("commit", job="j", version=1)
    return a


def test_decode_request_refuses_bad_headers():
    ok = encode_request(1, "ping", "ctl", {})
    assert decode_request([ok]).op == "ping"
    for frames, message in [
        ([], "empty"),
        ([b"\xc1"], "malformed msgpack"),
        ([msgpack.packb([1, 2])], "not a map"),
        ([msgpack.packb({"v": 99, "id": 1, "op": "ping", "args": {}})], "protocol version 99"),
        ([msgpack.packb({"v": 1, "id": "x", "op": "ping", "args": {}})], "needs id"),
        ([b"x" * (MAX_HEADER + 1)], "exceeds"),
        ([ok] + [b""] * 100, "frames exceeds"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            decode_request(frames)


def test_daemon_keeps_serving_through_garbage(local_cluster):
    lc = local_cluster(1)
    good = client(lc)
    a = put_sample(good)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(load_cluster(lc.cluster_file).host("h0").address)
    attacks = [
        [b""], [os.urandom(64)], [b"\xc1\xc1"], [msgpack.packb("text")],
        [msgpack.packb({"v": 2, "id": 1, "op": "ping", "args": {}})],
        [b"\x80" * (MAX_HEADER + 10)],
        [encode_request(1, "nosuchop", "x", {})],
        [encode_request(2, "read", "x", {"job": 5})],
        [encode_request(3, "read_box", "x", {"job": "j", "version": 1, "tensor": "w",
                                             "part": "full", "box": [[0, 99], [0, 1]]})],
        [encode_request(4, "read_box", "x", {"job": "j", "version": 1, "tensor": "w",
                                             "part": "full", "box": "zz"})],
        [encode_request(5, "put", "x", {"job": "j", "version": 1, "tensor": "w",
                                        "part": "full", "shape": [2], "dtype": "fp32"}),
         b"12345678"],
        [encode_request(6, "info", "x", {"job": "j", "version": 1, "tensor": "nope",
                                         "part": "full"})],
        [encode_request(7, "stage", "x", {"job": "j", "old_version": 1, "new_version": 2,
                                          "dst": [[1, 2]], "moves": 5})],
        [encode_request(8, "ping", "x", {})] + [b"x"] * 200,
    ]
    for frames in attacks:
        raw.send_multipart(frames)
    # replies that carry an id are errors that name the problem
    replies = []
    while raw.poll(2000):
        h = msgpack.unpackb(raw.recv_multipart()[0])
        replies.append(h)
    assert replies and all(not r["ok"] for r in replies if r["id"] is not None)
    by_id = {r["id"]: r for r in replies if r["id"] is not None}
    assert by_id[1]["error"]["message"].startswith("unknown operation")
    assert by_id[6]["error"]["type"] == "TensorNotFound"
    assert by_id[5]["error"]["type"] == "VersionImmutable"
    raw.close()
    # and the daemon still answers correctly
    assert good.call("ping")["host"] == "h0"
    got = np.frombuffer(good.read_box("j", 1, "w", "full", ((0, 3), (0, 1000)), 4),
                        dtype=np.float32).reshape(3, 1000)
    np.testing.assert_array_equal(got, a)
    with pytest.raises(TensorNotFound):
        good.call("info", job="j", version=1, tensor="nope", part="full")
    good.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=256), min_size=1, max_size=4))
def test_random_frames_never_break_the_daemon(fuzz_daemon, frames):
    lc, raw, good = fuzz_daemon
    raw.send_multipart(frames)
    assert good.call("ping")["host"] == "h0"


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    from ptcfs.server.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("fuzz"))
    lc.up(1)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(load_cluster(lc.cluster_file).host("h0").address)
    good = client(lc)
    try:
        yield lc, raw, good
    finally:
        raw.close()
        good.close()
        lc.down()


def test_curve_refuses_peers_without_the_keys(local_cluster, tmp_path):
    keys = generate_keys(tmp_path / "keys")
    lc = local_cluster(2, curve_dir=str(keys))
    good = client(lc)
    a = put_sample(good)
    got = np.frombuffer(good.read_box("j", 1, "w", "full", ((1, 2), (0, 1000)), 4),
                        dtype=np.float32)
    np.testing.assert_array_equal(got, a[1])
    plain = PeerClient(load_cluster(lc.cluster_file).host("h0").address, timeout_s=1.5)
    with pytest.raises(PeerError) as e:
        plain.call("ping")
    assert e.value.timed_out
    other = load_keys(generate_keys(tmp_path / "other"))
    stranger = client(lc, keys=other, timeout_s=1.5)
    with pytest.raises(PeerError):
        stranger.call("ping")
    assert good.call("ping")["host"] == "h0"  # still serving its own
    for c in (good, plain, stranger):
        c.close()
    with pytest.raises(Exception, match="has keys already"):
        generate_keys(keys)


def test_sigterm_exits_cleanly_and_a_restart_keeps_the_data(local_cluster):
    lc = local_cluster(1)
    c = client(lc)
    a = put_sample(c)
    c.close()
    proc = lc.procs["h0"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    lc.procs.pop("h0")
    lc.start("h0")
    c = client(lc)
    got = np.frombuffer(c.read_box("j", 1, "w", "full", ((0, 3), (0, 1000)), 4),
                        dtype=np.float32).reshape(3, 1000)
    np.testing.assert_array_equal(got, a)
    assert c.call("versions", job="j")[0]["state"] == "committed"
    c.close()


def test_ptcd_refuses_a_bad_cluster_file(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("[cluster]\nreplicas = 3\n[hosts.h0]\naddress = 'tcp://127.0.0.1:1'\n"
                   "store = 's'\n")
    exe = Path(sys.executable).with_name("ptcd")
    r = subprocess.run([str(exe), "--cluster", str(bad), "--host-id", "h0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "replicas=3 but only 1 hosts" in r.stderr
    r = subprocess.run([str(exe), "--cluster", str(tmp_path / "none.toml"), "--host-id", "h0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "does not exist" in r.stderr
