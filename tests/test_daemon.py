"""Real ptcd processes on loopback: round trips, chunked big reads that let
small requests through, byte counters, hostile input, SIGTERM and restart,
and CurveZMQ refusal."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from ptcfs.boxes import full_box
from ptcfs.errors import (
    InvalidConfig,
    InvalidRequest,
    JobNotFound,
    PeerError,
    TensorNotFound,
    VersionImmutable,
    VersionNotCommitted,
    VersionNotFound,
)
from ptcfs.plan.stagework import HostWork, encode
from ptcfs.server.mount import PeerRemote
from ptcfs.server.net.cluster import load_cluster
from ptcfs.server.net.keys import generate_keys, load_keys
from ptcfs.server.net.peer import PeerClient
from ptcfs.server.net.wire import MAX_HEADER, MAX_PAYLOAD, PROTOCOL_VERSION, encode_request
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.types import Endpoint, Entry, Slice, Transfer
from tests.daemons import address, client, raw_socket, running
from tests.test_metrics import scrape, total

pytestmark = pytest.mark.multihost

BIG_MIB = 112


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running(tmp_path_factory.mktemp("pair"), 2) as lc:
        yield lc


def commit_one(c: PeerClient, job: str, tensor: str, a: np.ndarray, version: int = 1,
               dtype: str | None = None) -> None:
    c.call("begin_at", job=job, version=version)
    c.put(job, version, tensor, "full", a, dtype)
    c.call("commit", job=job, version=version)


def whole_copy(src: str, dst: str, tensor: str, shape: tuple[int, ...], dtype: str
               ) -> dict[str, Any]:
    """``stage`` arguments that copy a whole entry ``tensor [full]`` from ``src`` to ``dst``."""
    box = full_box(shape)
    t = Transfer(Endpoint(src, -1, tensor, Slice(), box), Endpoint(dst, -1, tensor, Slice(), box),
                 0)
    return encode(HostWork(dst, (Entry(tensor, Slice(), shape, dtype),), (t,)))


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll ``check`` until true, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        time.sleep(0.01)


def test_put_and_read_round_trips(pair):
    c = client(pair)
    arrays = {"f32": np.random.default_rng(0).standard_normal((33, 70), dtype=np.float32),
              "i64": np.arange(-50, 50, dtype=np.int64).reshape(4, 25),
              "u8": np.frombuffer(bytes(range(256)) * 3, dtype=np.uint8),
              "scalar": np.array(2.5, dtype=np.float64),
              "empty": np.zeros((0, 8), dtype=np.float16)}
    c.call("begin_at", job="rt", version=1, meta={"step": 7})
    for name, a in arrays.items():
        c.put("rt", 1, name, "full", a)
    bf16 = np.arange(10, dtype=np.uint16)
    with pytest.raises(InvalidRequest, match="no ptcfs equivalent"):
        c.put("rt", 1, "bf", "full", bf16)  # uint16 could be anything: say bf16
    c.put("rt", 1, "bf", "full", bf16, "bf16")
    c.call("commit", job="rt", version=1)
    assert c.call("jobs")["rt"] == 1
    assert c.call("versions", job="rt") == [{"version": 1, "state": "committed",
                                              "meta": {"step": 7}}]
    listed = {e["tensor"]: e for e in c.call("entries", job="rt", version=1)}
    assert listed["bf"]["dtype"] == "bf16" and listed["f32"]["shape"] == [33, 70]
    for name, a in arrays.items():
        assert c.call("info", job="rt", version=1, tensor=name, part="full")["nbytes"] == a.nbytes
        whole = c.read_into("rt", 1, name, "full")
        assert bytes(whole) == a.tobytes()
    a = arrays["f32"]
    out = np.empty(100, dtype=np.float32)
    c.read_into("rt", 1, "f32", "full", 4 * 200, 400, out, chunk=64)  # 7 pipelined requests
    np.testing.assert_array_equal(out, a.reshape(-1)[200:300])
    for box in (((3, 9), (0, 70)), ((5, 6), (10, 60)), ((0, 33), (7, 9))):  # rows, run, columns
        got = np.frombuffer(c.read_box("rt", 1, "f32", "full", box), dtype=np.float32)
        np.testing.assert_array_equal(got, a[box[0][0]:box[0][1], box[1][0]:box[1][1]].ravel())
    c.close()


def test_put_many_puts_small_sub_tensors_in_one_request(pair):
    c = client(pair)
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
              "scalar": np.array(7, dtype=np.int64), "empty": np.zeros((0, 2), dtype=np.float16),
              "bf": np.arange(5, dtype=np.uint16)}
    c.call("begin_at", job="many", version=1)
    c.put_many("many", 1, [(n, "full", a, "bf16" if n == "bf" else None)
                           for n, a in arrays.items()])
    c.call("commit", job="many", version=1)
    listed = {e["tensor"]: e for e in c.call("entries", job="many", version=1)}
    assert listed["bf"]["dtype"] == "bf16" and listed["a"]["shape"] == [3, 4]
    for name, a in arrays.items():
        assert bytes(c.read_into("many", 1, name, "full")) == a.tobytes()
    c.call("begin_at", job="many", version=2)
    bad = [({"items": [["w", "full", [4], "fp32", 2]]}, "name 2 payload frames, 1 came"),
           ({"items": [["w", "full", [4], "fp32"]]}, "items must be"),
           ({"items": [["w", "full", [4], "fp32", 1]]}, "needs 16")]
    for args, match in bad:
        with pytest.raises(InvalidRequest, match=match):
            c.call("put_many", frames=[bytes(8)], job="many", version=2, **args)
    assert c.call("entries", job="many", version=2) == []
    with pytest.raises(VersionImmutable):
        c.put_many("many", 1, [("a", "full", arrays["a"], None)])
    # more sub-tensors than a request's frames: as many requests as it takes
    lots = {f"t{i}": np.full(3, i, dtype=np.int32) for i in range(150)}
    c.put_many("many", 2, [(n, "full", a, None) for n, a in lots.items()])
    c.call("commit", job="many", version=2)
    assert len(c.call("entries", job="many", version=2)) == 150
    assert bytes(c.read_into("many", 2, "t149", "full")) == lots["t149"].tobytes()
    c.close()


def test_errors_come_back_as_the_same_class(pair):
    c = client(pair)
    commit_one(c, "errs", "w", np.ones(4, dtype=np.float32))
    with pytest.raises(TensorNotFound, match=r"h0 \(info\)"):
        c.call("info", job="errs", version=1, tensor="nope", part="full")
    with pytest.raises(VersionNotFound):
        c.read_into("errs", 9, "w", "full", 0, 4)
    with pytest.raises(JobNotFound):
        c.call("entries", job="no-such-job", version=1)
    assert c.call("versions", job="no-such-job") == []
    with pytest.raises(VersionImmutable):
        c.put("errs", 1, "w", "full", np.ones(4, dtype=np.float32))
    with pytest.raises(InvalidRequest, match="unknown operation 'frobnicate'"):
        c.call("frobnicate")
    with pytest.raises(InvalidRequest, match="argument 'version' must be int"):
        c.call("info", job="errs", version="1", tensor="w", part="full")
    with pytest.raises(InvalidRequest, match="length must be"):
        c.call("read", job="errs", version=1, tensor="w", part="full", length=MAX_PAYLOAD + 1)
    with pytest.raises(InvalidRequest):
        c.read_into("errs", 1, "w", "full", 8, 100)  # past the end
    assert c.call("ping")["host"] == "h0"  # the socket is fine after all that
    c.close()


def test_a_version_is_read_only_where_it_is_committed(pair, monkeypatch):
    """A host that has a version staging (a stage or a roll-forward under
    way, a save a reconfiguration dropped) holds bytes that are not that
    version's yet: every read of it is refused. The mount's reads wait for
    a holder to commit it (bounded by PTC_MOUNT_PEER_TIMEOUT_S), never
    taking the staging bytes."""
    h0, h1 = client(pair, "h0"), client(pair, "h1")
    a = np.arange(256, dtype=np.float32)
    commit_one(h1, "stg", "w", a)
    h0.call("begin_at", job="stg", version=1)
    h0.put("stg", 1, "w", "full", np.zeros_like(a))  # a stage that has not fetched yet
    with pytest.raises(VersionNotCommitted, match="staging here, not committed"):
        h0.read_into("stg", 1, "w", "full", 0, a.nbytes)
    with pytest.raises(VersionNotCommitted):
        h0.read_box("stg", 1, "w", "full", ((0, 8),))
    # a save's copy to its replicas reads the ranks' bytes before the commit
    assert bytes(h0.read_box("stg", 1, "w", "full", ((0, 8),), staging=True)) == bytes(32)
    assert bytes(h1.read_into("stg", 1, "w", "full")) == a.tobytes()

    remote = PeerRemote(load_cluster(pair.cluster_file), "h1", client(pair).curve)
    out = bytearray(a.nbytes)
    remote.read_range(("h0", "h1"), "stg", 1, "w", "full", 0, a.nbytes, memoryview(out))
    assert bytes(out) == a.tobytes()  # h0 skipped: h1 has it committed
    monkeypatch.setenv("PTC_MOUNT_PEER_TIMEOUT_S", "0.3")
    with pytest.raises(PeerError, match="staging here"):  # gave up, took nothing
        remote.read_range(("h0",), "stg", 1, "w", "full", 0, a.nbytes, memoryview(out))
    monkeypatch.setenv("PTC_MOUNT_PEER_TIMEOUT_S", "30")
    h0.call("abort", job="stg", version=1)
    h0.call("begin_at", job="stg", version=1)
    h0.put("stg", 1, "w", "full", a)
    commit = threading.Timer(0.2, h0.call, ("commit",), {"job": "stg", "version": 1})
    commit.start()
    out = bytearray(a.nbytes)
    remote.read_range(("h0",), "stg", 1, "w", "full", 0, a.nbytes, memoryview(out))
    commit.join()
    assert bytes(out) == a.tobytes()  # waited for the commit
    remote.close()
    h0.close()
    h1.close()


def test_a_big_read_comes_in_chunks_and_pings_get_through(pair):
    big = np.arange(BIG_MIB << 18, dtype=np.float32)  # 112 MiB
    writer = client(pair, timeout_s=60)
    commit_one(writer, "big", "w", big)
    reader, pinger = client(pair, timeout_s=60), client(pair)
    events: list[str] = []
    out = np.empty_like(big)

    def read() -> None:
        reader.read_into("big", 1, "w", "full", 0, big.nbytes, out, chunk=1 << 20,
                         progress=lambda n: events.append("chunk"))

    t = threading.Thread(target=read)
    t.start()
    try:
        wait_for("the first chunk", lambda: "chunk" in events)
        for _ in range(5):
            assert pinger.call("ping")["host"] == "h0"
            events.append("ping")
    finally:
        t.join(60)
    assert events.count("chunk") == BIG_MIB
    # the pings were answered while the read was still going
    last_ping = len(events) - 1 - events[::-1].index("ping")
    assert last_ping < len(events) - 1 - events[::-1].index("chunk")
    assert np.array_equal(out, big)
    for c in (writer, reader, pinger):
        c.close()


def test_counters_count_payload_bytes_per_peer(pair):
    c = client(pair, host_id="tester")
    a = np.arange(1000, dtype=np.int32)
    commit_one(c, "count", "w", a)
    c.read_into("count", 1, "w", "full", 0, 1000, chunk=300)
    assert c.call("counters")["tester"] == {"sent": 1000, "received": 4000}
    assert (c.sent, c.received) == (4000, 1000)
    # a daemon fetching from another counts it under the other's host id
    h1 = client(pair, "h1")
    h1.call("begin_at", job="count", version=2)
    h1.call("stage", job="count", old_version=1, new_version=2,
            **whole_copy("h0", "h1", "w", (1000,), "int32"))
    wait_for("h1's stage", lambda: h1.call("stage_status", job="count",
                                           version=2)["state"] != "running")
    assert h1.call("stage_status", job="count", version=2)["state"] == "done"
    h1.call("commit", job="count", version=2)
    assert bytes(h1.read_into("count", 2, "w", "full")) == a.tobytes()
    assert c.call("counters")["h1"]["sent"] == 4000
    assert h1.call("counters")["h0"] == {"sent": 0, "received": 4000}
    c.close()
    h1.close()


def test_read_box_lands_in_strided_arrays(pair):
    c = client(pair, timeout_s=60)
    # 8000-byte rows: read_box's 8 MiB pieces end off the store's 16 MiB chunks, so
    # one piece comes as two frames
    a = np.random.default_rng(3).standard_normal((3000, 2000), dtype=np.float32)
    commit_one(c, "strided", "w", a)
    out = np.full((3000, 4000), -1.0, dtype=np.float32)
    got = c.read_box("strided", 1, "w", "full", ((0, 3000), (0, 2000)), 4, out[:, 1000:3000])
    assert got.nbytes == a.nbytes
    np.testing.assert_array_equal(out[:, 1000:3000], a)
    assert (out[:, :1000] == -1).all() and (out[:, 3000:] == -1).all()
    # a strided box of the source (gathered by the daemon) into a strided target
    cols = np.zeros((3000, 2000), dtype=np.float32)
    c.read_box("strided", 1, "w", "full", ((0, 3000), (500, 1500)), 4, cols[:, ::2])
    np.testing.assert_array_equal(cols[:, ::2], a[:, 500:1500])
    assert (cols[:, 1::2] == 0).all()
    with pytest.raises(InvalidRequest, match="the box is"):
        c.read_box("strided", 1, "w", "full", ((0, 10), (0, 10)), 4, out[:10, :20:2][:, :5])
    c.close()


def test_read_boxes_gives_each_box_in_turn(pair, monkeypatch):
    c = client(pair, timeout_s=60)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 200), dtype=np.float32)
    b = rng.integers(-2**62, 2**62, 50, dtype=np.int64)
    commit_one(c, "boxes", "w", w)
    boxes = [("w", "full", ((0, 300), (0, 200))), ("b", "full", ((10, 20),)),
             ("w", "full", ((5, 9), (50, 150))), ("w", "full", ((0, 0), (0, 200)))]
    want = w.tobytes() + b[10:20].tobytes() + w[5:9, 50:150].tobytes()
    for bulk in ("1", "0"):  # the sealed channel, then CURVE
        monkeypatch.setenv("PTC_BULK", bulk)
        out = np.full(len(want), 7, dtype=np.uint8)
        c.read_boxes("boxes", 1, boxes[:1] + boxes[2:], out[:w.nbytes + 1600])
        assert out[:w.nbytes + 1600].tobytes() == w.tobytes() + w[5:9, 50:150].tobytes()
        c.close()
    c.close()
    c = client(pair, timeout_s=60)
    c.call("begin_at", job="boxes", version=2)
    c.put("boxes", 2, "b", "full", b)
    c.put("boxes", 2, "w", "full", w)
    c.call("commit", job="boxes", version=2)
    out = np.empty(len(want), dtype=np.uint8)
    c.read_boxes("boxes", 2, boxes, out)
    assert out.tobytes() == want
    whole = ("w", "full", ((0, 300), (0, 200)))
    over = 1 + MAX_PAYLOAD // w.nbytes
    with pytest.raises(InvalidRequest, match="more than a reply holds"):
        c.read_boxes("boxes", 2, [whole] * over, np.empty(over * w.nbytes, np.uint8))
    with pytest.raises(InvalidRequest, match=r"each of boxes is \[tensor, part, box\]"):
        c.call("read_boxes", job="boxes", version=2, boxes=[["w", "full"]])
    with pytest.raises(InvalidRequest, match="box must be a list"):
        c.call("read_boxes", job="boxes", version=2, boxes=[["w", "full", "zz"]])
    with pytest.raises(InvalidRequest, match="at most 4096"):
        c.call("read_boxes", job="boxes", version=2, boxes=[["b", "full", [[0, 0]]]] * 4097)
    with pytest.raises(TensorNotFound):
        c.read_boxes("boxes", 2, [("nope", "full", ((0, 1),))], np.empty(4, np.uint8))
    c.call("begin_at", job="boxes", version=3)
    with pytest.raises(VersionNotCommitted):
        c.read_boxes("boxes", 3, boxes[1:2], np.empty(80, np.uint8))
    c.call("abort", job="boxes", version=3)
    c.close()


@pytest.mark.parametrize("op", ["stage", "repair_stage"])
def test_a_stage_fetches_small_regions_many_to_a_request(tmp_path, op):
    """A reconfiguration's stage, and a repair's."""
    lc = LocalCluster(tmp_path / "c")
    try:
        lc.up(2, gpus=1, metrics=True)
        c, h1 = client(lc), client(lc, "h1")
        rng = np.random.default_rng(8)
        small = {f"s{i}": rng.standard_normal(100 + 37 * i, dtype=np.float32) for i in range(30)}
        big = rng.standard_normal(1 << 19, dtype=np.float32)  # 2 MiB: fetched on its own
        c.call("begin_at", job="many", version=1)
        for name, a in [*small.items(), ("big", big)]:
            c.put("many", 1, name, "full", a)
        c.call("commit", job="many", version=1)
        entries, transfers = [], []
        for name, a in [*small.items(), ("big", big)]:
            box = full_box(a.shape)
            entries.append(Entry(name, Slice(), a.shape, "fp32"))
            transfers.append(Transfer(Endpoint("h0", -1, name, Slice(), box),
                                      Endpoint("h1", -1, name, Slice(), box), 0))
        before = scrape(lc, "h0")
        h1.call("begin_at", job="many", version=2)
        h1.call(op, job="many", old_version=1, new_version=2,
                **encode(HostWork("h1", tuple(entries), tuple(transfers))))
        st = h1.call("stage_status", job="many", version=2, wait=30)
        assert st["state"] == "done", st["error"]
        h1.call("commit", job="many", version=2)
        for name, a in [*small.items(), ("big", big)]:
            assert bytes(h1.read_into("many", 2, name, "full")) == a.tobytes(), name
        after = scrape(lc, "h0")
        asked = {op: total(after, "ptcd_requests_total", op=op)
                 - total(before, "ptcd_requests_total", op=op) for op in ("read_box",
                                                                         "read_boxes")}
        assert asked == {"read_box": 1, "read_boxes": 1}  # 30 small regions in one request
        c.close()
        h1.close()
    finally:
        lc.down()


def test_stage_status_waits_for_the_stage_to_end(pair):
    c, h1 = client(pair), client(pair, "h1")
    a = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: built in a pooled buffer
    commit_one(c, "wait", "w", a)
    h1.call("begin_at", job="wait", version=2)
    h1.call("stage", job="wait", old_version=1, new_version=2,
            **whole_copy("h0", "h1", "w", (a.size,), "fp32"))
    # one call: the answer comes when the stage has ended, not before
    assert h1.call("stage_status", job="wait", version=2, wait=30)["state"] == "done"
    assert h1.call("stage_status", job="nope", version=2, wait=30)["state"] == "unknown"
    for bad in (-1, "soon", True):
        with pytest.raises(InvalidRequest, match="wait must be"):
            h1.call("stage_status", job="wait", version=2, wait=bad)
    h1.call("commit", job="wait", version=2)
    assert bytes(h1.read_into("wait", 2, "w", "full")) == a.tobytes()
    assert h1.call("health")["stage_buffers_bytes"] >= a.nbytes  # kept for the next stage
    c.close()
    h1.close()


def test_the_daemon_keeps_its_start_up_objects_out_of_the_collector(pair):
    """What start-up made is frozen (out of the collector's full passes);
    health says so, and counts the passes of each generation."""
    c = client(pair)
    try:
        gc_ = c.call("health")["gc"]
    finally:
        c.close()
    # the daemon's modules, settings and handles: tens of thousands of objects
    assert gc_["frozen"] > 10_000
    assert len(gc_["collections"]) == 3 and all(n >= 0 for n in gc_["collections"])


def test_hostile_input_never_stops_the_daemon(tmp_path):
    with running(tmp_path, 1, env={"PTC_WIRE_MAX_FRAME": str(4 << 20)}, keys=False) as lc:
        good = client(lc)
        a = np.arange(3000, dtype=np.float32)
        commit_one(good, "j", "w", a)
        raw = raw_socket(lc)
        rng = random.Random(1234)
        attacks: list[list[bytes]] = [[rng.randbytes(rng.randrange(0, 300))
                                       for _ in range(rng.randrange(1, 4))] for _ in range(150)]
        key = {"job": "j", "version": 1, "tensor": "w", "part": "full"}
        attacks += [
            [b""], [b"\xc1\xc1"], [msgpack.packb("text")], [msgpack.packb({"v": 1})],
            [msgpack.packb({"v": PROTOCOL_VERSION + 1, "id": 1, "op": "ping", "args": {}})],
            [msgpack.packb({"v": 0, "id": 1, "op": "ping", "args": {}})],
            [b"\x80" * (MAX_HEADER + 10)],
            [encode_request(1, "nosuchop", "x", {})],
            [encode_request(2, "read", "x", {**key, "length": 10 ** 12})],
            [encode_request(3, "read", "x", {**key, "tensor": "missing", "length": 4})],
            [encode_request(4, "read_box", "x", {**key, "box": [[0, 10 ** 9]]})],
            [encode_request(5, "read_box", "x", {**key, "box": "zz"})],
            [encode_request(10, "read_boxes", "x",
                            {**key, "boxes": [["w", "full", [[0, 10 ** 9]]]]})],
            [encode_request(11, "read_boxes", "x", {**key, "boxes": [["w", 3, "zz"]] * 5000})],
            [encode_request(6, "put", "x", {**key, "shape": [2], "dtype": "fp32"})],
            [encode_request(7, "info", "x", {**key, "version": 99})],
            [encode_request(8, "ping", "x", {})] + [b"x"] * 200,
        ]
        for frames in attacks:
            raw.send_multipart(frames)
        oversized = raw_socket(lc)  # a frame over the daemon's limit: dropped with the connection
        oversized.send_multipart([encode_request(9, "ping", "x", {}), b"\0" * (5 << 20)])
        replies = []
        while raw.poll(1500):
            replies.append(msgpack.unpackb(raw.recv_multipart()[0]))
        assert replies and all(r["v"] == PROTOCOL_VERSION and r["ok"] is False for r in replies)
        by_id = {r["id"]: r["error"] for r in replies if r["id"] is not None}
        assert by_id[1]["type"] == "InvalidRequest"
        assert by_id[3]["type"] == "TensorNotFound"
        assert by_id[7]["type"] == "VersionNotFound"
        assert not oversized.poll(0)
        raw.close()
        oversized.close()
        # and it still serves correct answers
        assert good.call("ping")["host"] == "h0"
        assert bytes(good.read_into("j", 1, "w", "full")) == a.tobytes()
        with pytest.raises(TensorNotFound):
            good.call("info", job="j", version=1, tensor="missing", part="full")
        assert good.call("health")["protocol"] == PROTOCOL_VERSION
        good.close()


def test_sigterm_exits_0_and_a_restart_keeps_committed_data(tmp_path):
    with running(tmp_path, 1) as lc:
        c = client(lc)
        a = np.arange(5000, dtype=np.int64)
        commit_one(c, "j", "w", a)
        c.call("begin_at", job="j", version=2)
        c.put("j", 2, "w", "full", a + 1)  # staged, never committed
        health = c.call("health")
        assert health["host"] == "h0" and health["store"]["versions"] == 2
        c.close()
        ready = lc.dir / "h0.ready"
        assert json.loads(ready.read_text())["pid"] == lc.procs["h0"].pid
        for sig in (signal.SIGTERM, signal.SIGINT):
            proc = lc.procs.pop("h0")
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0
            assert not ready.exists()
            assert b"Traceback" not in (lc.dir / "h0.log").read_bytes()
            lc.start("h0")
            c = client(lc)
            assert bytes(c.read_into("j", 1, "w", "full")) == a.tobytes()
            assert [v["state"] for v in c.call("versions", job="j")] == ["committed", "staging"]
            assert c.call("jobs") == {"j": 1}
            c.close()


def test_keys_are_never_made_in_a_folder_that_holds_other_files(tmp_path):
    """It would become its owner's only: ``keys generate /`` once left the
    machine's root folder 0700 (no other user could run anything)."""
    busy = tmp_path / "busy"
    busy.mkdir(mode=0o755)
    (busy / "notes.txt").write_text("x")
    busy.chmod(0o755)
    with pytest.raises(InvalidConfig, match="is not empty"):
        generate_keys(busy)
    assert busy.stat().st_mode & 0o777 == 0o755 and sorted(os.listdir(busy)) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generate_keys(empty) == empty and empty.stat().st_mode & 0o777 == 0o700


def test_curve_admits_the_cluster_and_refuses_strangers(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    with running(tmp_path / "c", 2, curve_dir=str(keys)) as lc:
        good = client(lc)
        a = np.arange(256, dtype=np.float32)
        commit_one(good, "j", "w", a)
        assert bytes(good.read_into("j", 1, "w", "full")) == a.tobytes()
        # daemons talk to each other with the keys too
        h1 = client(lc, "h1")
        h1.call("begin_at", job="j", version=2)
        h1.call("stage", job="j", old_version=1, new_version=2,
                **whole_copy("h0", "h1", "w", (256,), "fp32"))
        wait_for("h1's stage", lambda: h1.call("stage_status", job="j",
                                               version=2)["state"] != "running")
        assert h1.call("stage_status", job="j", version=2)["state"] == "done"
        strangers = [PeerClient(good.address, timeout_s=1.5, peer_name="h0"),
                     client(lc, keys=load_keys(generate_keys(tmp_path / "other")),
                            timeout_s=1.5)]
        failures: list[Any] = [None, None]

        def attempt(i: int) -> None:
            try:
                strangers[i].call("ping")
            except PeerError as e:
                failures[i] = e

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(e, PeerError) and e.timed_out for e in failures)
        assert "h0 did not answer 'ping'" in str(failures[0])
        assert good.call("ping")["host"] == "h0"  # still serving its own
        for c in (good, h1, *strangers):
            c.close()


def test_a_bad_cluster_file_or_a_busy_port_exits_nonzero(tmp_path):
    import subprocess

    from ptcfs.server.testing.localcluster import ptcd_command

    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\nreplicas = 3\n[hosts.h0]\naddress = 'tcp://127.0.0.1:1'\n"
                   "store = 's'\n")
    r = subprocess.run(ptcd_command() + ["--cluster", str(bad), "--host-id", "h0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "replicas=3 but only 1 hosts" in r.stderr
    two = "[hosts.h0]\naddress = 'tcp://127.0.0.1:1'\nstore = 's0'\n" \
          "[hosts.h1]\naddress = 'tcp://127.0.0.1:2'\nstore = 's1'\n"
    bad.write_text(two)  # two hosts, no keys: refused unless the file says insecure
    r = subprocess.run(ptcd_command() + ["--cluster", str(bad), "--host-id", "h0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no curve_secret_dir" in r.stderr
    assert "insecure = true" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad.write_text("[cluster]\ninsecure = true\n" + two)
    assert load_cluster(bad).insecure
    load_cluster(bad).check_secure()
    with running(tmp_path / "c", 1) as lc:
        r = subprocess.run(ptcd_command() + ["--cluster", str(lc.cluster_file), "--host-id",
                                             "h0", "--log-level", "warning"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "cannot serve on tcp://127.0.0.1:" in r.stderr
        assert client(lc).call("ping")["host"] == "h0"
        # a local cluster has keys unless asked not to: a keyless client gets no answer
        assert load_cluster(lc.cluster_file).curve_dir == lc.dir / "keys"
        stranger = PeerClient(address(lc), timeout_s=1.0, peer_name="h0")
        with pytest.raises(PeerError):
            stranger.call("ping")
        stranger.close()
