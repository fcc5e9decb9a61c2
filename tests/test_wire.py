"""The wire protocol: encoding, decoding, what it refuses, and the bytes a
``read_box`` reply carries (no sockets)."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ptcfs import errors
from ptcfs.boxes import contiguous_range
from ptcfs.errors import InvalidRequest, PeerError, TensorNotFound, VersionImmutable
from ptcfs.server.net.wire import (
    MAX_HEADER,
    PROTOCOL_VERSION,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    error_from_wire,
    max_frames,
)
from ptcfs.store.boxes import gather_box
from ptcfs.store.lmdb_store import LmdbStore


def header(**fields: object) -> bytes:
    base: dict[str, object] = {"v": PROTOCOL_VERSION, "id": 1, "op": "ping", "from": "h0",
                               "args": {}}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...}, use_bin_type=True)


def test_a_request_round_trips_with_its_payload():
    payload = [b"abc", memoryview(np.arange(4, dtype=np.int32))]
    req = decode_request([encode_request(7, "read", "h1", {"job": "j", "offset": 3}), *payload])
    assert (req.id, req.op, req.caller, req.args) == (7, "read", "h1", {"job": "j", "offset": 3})
    assert req.frames == payload


def test_a_reply_round_trips_and_errors_keep_their_class():
    ok = decode_reply(encode_reply(3, {"host": "h0", "n": [1, 2]}))
    assert ok["ok"] and ok["id"] == 3 and ok["result"] == {"host": "h0", "n": [1, 2]}
    bad = decode_reply(encode_reply(4, error=TensorNotFound("no w [full]")))
    assert not bad["ok"] and bad["error"] == {"type": "TensorNotFound", "message": "no w [full]"}
    e = error_from_wire(bad["error"], "h0 (read)")
    assert type(e) is TensorNotFound and str(e) == "h0 (read): no w [full]"
    assert isinstance(e, FileNotFoundError)
    assert type(error_from_wire({"type": "VersionImmutable", "message": "m"}, "x")) \
        is VersionImmutable


def test_unknown_or_foreign_error_types_become_peer_errors():
    for kind in ("NoSuchError", "ValueError", "errno", "__class__", "Path"):
        assert type(error_from_wire({"type": kind, "message": "m"}, "h0")) is errors.PeerError
    internal = decode_reply(encode_reply(1, error=KeyError("boom")))
    assert internal["error"]["type"] == "PtcError"


def test_a_result_msgpack_cannot_hold_becomes_an_error_reply():
    h = decode_reply(encode_reply(9, {"x": object()}))
    assert not h["ok"] and h["id"] == 9 and "internal error" in h["error"]["message"]


@pytest.mark.parametrize("frames, message", [
    ([], "empty message"),
    ([b"\xc1"], "malformed msgpack header"),
    ([b"\x92\x01"], "malformed msgpack header"),  # truncated
    ([header() + b"\x00"], "malformed msgpack header"),  # trailing bytes
    ([msgpack.packb([1, 2])], "header is a list, not a map"),
    ([msgpack.packb({1: 2})], "malformed msgpack"),  # non-text map keys
    ([header(v=2)], "protocol version 2 is not supported"),
    ([header(v=...)], "protocol version None"),
    ([header(id="1")], "id is '1'"),
    ([header(id=True)], "id is True"),
    ([header(id=-1)], "id is -1"),
    ([header(id=...)], "id is None"),
    ([header(op=5)], "op as a lower-case name"),
    ([header(op="Read")], "op as a lower-case name"),
    ([header(op="x" * 65)], "op as a lower-case name"),
    ([header(op=...)], "op as a lower-case name"),
    ([header(args=[1])], "args must be a map"),
    ([header(**{"from": ""})], "'from' must be the caller's host id"),
    ([header(**{"from": 3})], "'from' must be the caller's host id"),
    ([b"\x80" * (MAX_HEADER + 1)], f"exceeds {MAX_HEADER}"),
    ([header()] + [b""] * (max_frames() + 1), "frames exceeds"),
])
def test_bad_requests_are_refused_with_a_reason(frames, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_request(frames)


def test_malformed_replies_raise_peer_errors():
    for raw in (b"\xc1", msgpack.packb([1]), msgpack.packb({"v": 9, "ok": True}),
                msgpack.packb({"v": 1, "ok": "yes", "id": 1}),
                msgpack.packb({"v": 1, "ok": False, "id": 1, "error": "x"}),
                msgpack.packb({"v": 1, "ok": True, "id": "1"})):
        with pytest.raises(PeerError):
            decode_reply(raw)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
keys = st.sampled_from(["v", "id", "op", "from", "args"]) | st.text(max_size=6)


@given(h=st.dictionaries(keys, values | st.sampled_from([1, "ping", "h0", {}]), max_size=7),
       extra=st.lists(st.binary(max_size=16), max_size=3))
def test_any_header_decodes_or_is_refused_as_invalid(h, extra):
    try:
        req = decode_request([msgpack.packb(h, use_bin_type=True), *extra])
    except InvalidRequest:
        return
    assert h["v"] == PROTOCOL_VERSION and isinstance(req.args, dict)
    assert isinstance(req.id, int) and isinstance(req.op, str) and req.frames == extra


@given(raw=st.binary(max_size=64))
def test_any_bytes_decode_or_are_refused(raw):
    try:
        decode_request([raw])
    except InvalidRequest:
        pass
    try:
        decode_reply(raw)
    except PeerError:
        pass


@given(data=st.data())
def test_contiguous_range_is_exactly_the_boxes_that_are_one_run(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    box = tuple(tuple(sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n)))))
                for n in shape)
    index = tuple(slice(a, b) for a, b in box)
    arr = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
    got = contiguous_range(box, shape, 2)
    if got is not None:
        offset, length = got
        assert arr.tobytes()[offset:offset + length] == arr[index].tobytes()
    flat = arr[index].reshape(-1).astype(np.int64)
    if flat.size:
        assert (got is not None) == bool(np.all(np.diff(flat) == 1))


def test_contiguous_range_examples():
    shape = (4, 5, 6)
    assert contiguous_range(((0, 4), (0, 5), (0, 6)), shape, 4) == (0, 480)
    assert contiguous_range(((1, 3), (0, 5), (0, 6)), shape, 4) == (120, 240)
    assert contiguous_range(((1, 2), (2, 4), (0, 6)), shape, 4) == ((30 + 12) * 4, 48)
    assert contiguous_range(((1, 2), (2, 3), (1, 4)), shape, 4) == ((30 + 12 + 1) * 4, 12)
    assert contiguous_range(((0, 2), (2, 4), (0, 6)), shape, 4) is None
    assert contiguous_range(((0, 4), (0, 5), (0, 3)), shape, 4) is None
    assert contiguous_range(((0, 5), (0, 5), (0, 6)), shape, 4) is None  # outside
    assert contiguous_range((), (), 8) == (0, 8)


def test_gather_box_matches_numpy_across_store_chunks(tmp_path):
    """Boxes of entries cut into tiny store chunks: every strided stretch and
    every chunk boundary."""
    rng = random.Random(7)
    with LmdbStore(tmp_path / "s", chunk_bytes=40) as store:
        v = store.begin("j")
        arrays = {}
        for i in range(12):
            shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
            dtype = rng.choice([np.uint8, np.int16, np.float32, np.float64])
            arrays[f"t{i}"] = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
            store.put("j", v, f"t{i}", "full", arrays[f"t{i}"], shape,
                      {np.uint8: "uint8", np.int16: "int16", np.float32: "fp32",
                       np.float64: "fp64"}[dtype])
        with store.reader() as r:
            for _ in range(300):
                name = rng.choice(sorted(arrays))
                a = arrays[name]
                box = tuple(tuple(sorted((rng.randint(0, n), rng.randint(0, n))))
                            for n in a.shape)
                want = a[tuple(slice(x, y) for x, y in box)]
                out = np.empty(want.nbytes, dtype=np.uint8)
                gather_box(r, ("j", v, name, "full"), a.shape, a.itemsize, box, out)
                assert out.tobytes() == want.tobytes(), (name, a.shape, box)
            with pytest.raises(InvalidRequest, match="outside"):
                gather_box(r, ("j", v, "t0", "full"), arrays["t0"].shape, 1,
                           tuple((0, n + 1) for n in arrays["t0"].shape), out)
