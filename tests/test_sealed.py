"""The sealed channel (:mod:`ptcfs.server.net.sealed`): where a cluster has keys,
tensor reads go over a second daemon socket sealed with AES-GCM, under the
CURVE channel's authentication. Real daemons, real sockets: what crosses
that socket is never plain, a forged, replayed or changing request there is
not served, a rotated key stops its sessions, a restarted daemon's callers
open a new session, and ``PTC_BULK=0`` keeps every read on CURVE."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import zmq

from ptcfs.errors import NotAllowed
from ptcfs.server.net.keys import load_keys
from ptcfs.server.net.sealed import (
    MAX_SEALED_REQUEST,
    NO_SESSION,
    Channel,
    InvalidTag,
    Session,
    open_session,
)
from ptcfs.server.net.wire import decode_reply, encode_request
from tests.daemons import client, running
from tests.test_cluster import ptcctl

pytestmark = pytest.mark.multihost

#: a pattern no ciphertext holds by chance: each 8-byte word says its place
PLAIN = (np.arange(1 << 18, dtype=np.uint64) * 0x0101010101010101).view(np.int64)
#: a straggler to a request that must get no answer arrives within this
NO_ANSWER_MS = 500


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    with running(tmp_path_factory.mktemp("sealed"), 1, gpus=1, replicas=1) as lc:
        c = client(lc)
        try:
            c.call("begin_at", job="j", version=1)
            c.put("j", 1, "t", "full", PLAIN)
            c.call("commit", job="j", version=1)
        finally:
            c.close()
        yield lc


def _read_request(id_: int, length: int = PLAIN.nbytes) -> bytes:
    return encode_request(id_, "read", "ctl", {"job": "j", "version": 1, "tensor": "t",
                                               "part": "full", "offset": 0, "length": length})


def _dealer(address: str) -> zmq.Socket:
    """A bare DEALER connected to a daemon's sealed socket."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _answer(s: zmq.Socket, timeout_ms: int = 10_000) -> list[bytes] | None:
    return s.recv_multipart() if s.poll(timeout_ms) else None


def test_reads_are_sealed_and_give_the_stored_bytes(one, monkeypatch):
    c = client(one)
    try:
        got = np.empty_like(PLAIN)
        c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, got)
        assert np.array_equal(got, PLAIN)
        assert c.call("health")["sealed"]["sessions"] >= 1
        strided = np.zeros(2 * PLAIN.size, np.int64)[::2]  # lands through the array path
        c.read_box("j", 1, "t", "full", [(0, PLAIN.size)], 8, out=strided)
        assert np.array_equal(strided, PLAIN)
        # the same bytes over CURVE
        monkeypatch.setenv("PTC_BULK", "0")
        again = np.empty_like(PLAIN)
        c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, again)
        assert np.array_equal(again, PLAIN)
    finally:
        c.close()
    # what crosses the sealed socket: no run of the plain bytes, and it opens to them
    c = client(one)
    ch = open_session(c.call, c.address)
    s = _dealer(ch.address)
    try:
        s.send_multipart(ch.seal_request(_read_request(7)))
        parts = _answer(s)
        assert parts is not None and len(parts) == 2
        raw = b"".join(parts)
        assert PLAIN[1000:1002].tobytes() not in raw and PLAIN.tobytes()[:64] not in raw
        frames = [zmq.Frame(p) for p in parts]
        head = decode_reply(ch.open_header(frames))
        assert head["ok"] and head["id"] == 7
        out = bytearray(PLAIN.nbytes)
        ch.open_into(7, 1, 2, memoryview(parts[1]), memoryview(out))
        assert bytes(out) == PLAIN.tobytes()
        with pytest.raises(InvalidTag):  # the payload of request 7 is not request 8's
            ch.open_into(8, 1, 2, memoryview(parts[1]), memoryview(out))
    finally:
        s.close(0)
        c.close()


def test_forged_replayed_and_changing_requests_are_not_served(one):
    c = client(one)
    ch = open_session(c.call, c.address)
    s = _dealer(ch.address)
    try:
        # a session the daemon does not know
        stranger = Channel(ch.address, b"x" * 16, b"k" * 32)
        s.send_multipart(stranger.seal_request(_read_request(1)))
        assert _answer(s) == [NO_SESSION]
        # a forged request (one byte of its ciphertext changed), then a good one
        sid, sealed = ch.seal_request(_read_request(2, 64))
        forged = bytearray(sealed)
        forged[20] ^= 1
        s.send_multipart([sid, bytes(forged)])
        good = ch.seal_request(_read_request(3, 64))
        s.send_multipart(good)
        parts = _answer(s)
        assert parts is not None
        assert decode_reply(ch.open_header([zmq.Frame(p) for p in parts]))["id"] == 3
        # the good one again, byte for byte: a replay
        s.send_multipart(good)
        assert _answer(s, NO_ANSWER_MS) is None
        # a change, or a new session, over the sealed socket: refused, sealed
        for id_, op, args in ((4, "delete_job", {"job": "j"}), (5, "bulk_open", {})):
            s.send_multipart(ch.seal_request(encode_request(id_, op, "ctl", args)))
            parts = _answer(s)
            assert parts is not None
            h = decode_reply(ch.open_header([zmq.Frame(p) for p in parts]))
            assert h["id"] == id_ and not h["ok"]
            assert h["error"]["type"] == "InvalidRequest", h
            assert "not served on the sealed socket" in h["error"]["message"]
        assert c.call("jobs") == {"j": 1}
    finally:
        s.close(0)
        c.close()


def test_frames_do_not_open_out_of_their_place():
    s = Session(b"s" * 16, b"k" * 32, "client", "fp")
    ch = Channel("tcp://127.0.0.1:1", s.sid, s.key)
    frames = [zmq.Frame(f) for f in s.seal_reply(9, [b"head", b"one", b"two"])]
    assert len(frames) == 2  # the payload's pieces, sealed as one
    assert ch.open_header(frames) == b"head"
    assert ch.open_into(9, 1, 2, frames[1].buffer, None) == b"onetwo"
    for id_, index, count in ((9, 0, 2), (10, 1, 2), (9, 1, 3)):  # moved, other reply, count
        with pytest.raises(InvalidTag):
            ch.open_into(id_, index, count, frames[1].buffer, None)
    with pytest.raises(InvalidTag):  # a header without its payload
        ch.open_header(frames[:1])


def test_a_rotated_key_stops_its_sealed_session(one, monkeypatch):
    ptcctl(one.cluster_file, "keys", "new", "dave")
    monkeypatch.setenv("PTC_CLIENT_KEY", "dave")
    c = client(one, keys=load_keys(one.dir / "keys"))
    try:
        got = np.empty_like(PLAIN)
        c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, got)  # opens dave's session
        assert np.array_equal(got, PLAIN)
        ptcctl(one.cluster_file, "keys", "rotate", "dave")
        with pytest.raises(NotAllowed, match="'dave' was rotated or removed"):
            c.read_into("j", 1, "t", "full", 0, 64, bytearray(64))
    finally:
        c.close()


def test_a_restarted_daemon_gets_a_new_session(one):
    c = client(one)
    try:
        got = np.empty_like(PLAIN)
        c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, got)
        one.kill("h0", signal.SIGTERM)
        one.start("h0")  # its sessions are gone with it
        got[:] = 0
        c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, got)
        assert np.array_equal(got, PLAIN)
        assert c.call("health")["sealed"]["sessions"] == 1  # a new session, opened once
    finally:
        c.close()


def test_without_bulk_every_read_stays_on_curve(tmp_path):
    with running(tmp_path, 1, env={"PTC_BULK": "0"}, gpus=1, replicas=1) as lc:
        c = client(lc)
        try:
            assert c.call("health")["sealed"] == {"port": None, "sessions": 0}
            hosts = json.loads(ptcctl(lc.cluster_file, "status", "--json").stdout)["hosts"]
            assert hosts["h0"]["sealed"] == {"port": None, "sessions": 0}
            c.call("begin_at", job="j", version=1)
            c.put("j", 1, "t", "full", PLAIN)
            c.call("commit", job="j", version=1)
            got = np.empty_like(PLAIN)
            c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, got)
            assert np.array_equal(got, PLAIN)
        finally:
            c.close()


def test_a_stranger_flooding_the_sealed_socket_is_not_read(one):
    """Messages over MAX_SEALED_REQUEST are cut off by ZeroMQ before the
    daemon reads them; small ones of no session get NO_SESSION. A bounded
    flood of both leaves the daemon's answers correct."""
    c = client(one)
    ch = open_session(c.call, c.address)
    ctx = zmq.Context.instance()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.setsockopt(zmq.SNDHWM, 64)
    big.connect(ch.address)
    s = _dealer(ch.address)
    try:
        for _ in range(32):
            big.send_multipart([b"x" * 16, b"\0" * (MAX_SEALED_REQUEST + 1)], zmq.NOBLOCK)
        stranger = Channel(ch.address, b"y" * 16, b"k" * 32)
        for i in range(32):
            s.send_multipart(stranger.seal_request(_read_request(i)))
        assert all(_answer(s) == [NO_SESSION] for _ in range(32))
        assert _answer(big, NO_ANSWER_MS) is None
        got = np.empty_like(PLAIN)
        c.read_into("j", 1, "t", "full", 0, PLAIN.nbytes, got)
        assert np.array_equal(got, PLAIN)
    finally:
        big.close(0)
        s.close(0)
        c.close()


def test_a_daemon_keeps_the_sessions_used_last():
    from ptcfs.errors import NoSession
    from ptcfs.server.net.sealed import MAX_SESSIONS, Sessions

    table = Sessions()
    first, second = table.new("client", "fp"), table.new("client", "fp")
    ch = Channel("tcp://127.0.0.1:1", second.sid, second.key)
    for _ in range(MAX_SESSIONS - 2):
        table.new("client", "fp")
    assert table.open_request(ch.seal_request(b"hi"))[1] == b"hi"  # second: used last now
    table.new("client", "fp")  # one over: the first goes
    assert len(table) == MAX_SESSIONS
    with pytest.raises(NoSession):
        table.open_request(Channel("", first.sid, first.key).seal_request(b"hi"))
    assert table.open_request(ch.seal_request(b"again"))[1] == b"again"
