"""Bounded requests: a peer that floods a daemon with the biggest requests
the wire allows cannot grow its memory beyond the daemon's caps, and the
daemon goes on answering a normal client correctly."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from ptcfs.server.net.wire import encode_request
from tests.daemons import client, raw_socket, running

pytestmark = pytest.mark.multihost

MIB = 1 << 20
FRAME = 4 * MIB
LIMITS = {
    "PTC_WIRE_MAX_FRAME": str(FRAME),
    "PTC_WIRE_MAX_FRAMES": "4",
    "PTC_WIRE_MAX_REQUEST_BYTES": str(16 * MIB),
    "PTC_DAEMON_PEER_INFLIGHT_BYTES": str(32 * MIB),
    "PTC_DAEMON_INFLIGHT_BYTES": str(64 * MIB),
    "PTC_DAEMON_WORKERS": "1",  # slow to serve puts: the flood outruns it
    "PTC_STORE_ROOM": "0",
}


def rss(pid: int, field: str = "RssAnon") -> int:
    """Bytes of a process's resident anonymous memory (the heap, not the
    store's mapped file), from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_flood_of_the_biggest_requests_stays_within_the_caps(tmp_path):
    with running(tmp_path, 1, env=LIMITS, keys=False) as lc:
        pid = lc.procs["h0"].pid
        good = client(lc, timeout_s=30)
        good.call("begin_at", job="j", version=1)
        a = np.arange(1000, dtype=np.float32)
        good.put("j", 1, "w", "full", a)
        base = rss(pid)
        payload = [np.full(FRAME, i, dtype=np.uint8).data for i in range(4)]
        put = {"job": "j", "version": 1, "part": "full", "shape": [16 * MIB], "dtype": "uint8"}
        socks = [raw_socket(lc) for _ in range(3)]
        peak, sent, deadline = base, 0, time.monotonic() + 60
        for n in range(20):
            for k, s in enumerate(socks):
                s.send_multipart([encode_request(n, "put", "x", {**put, "tensor": f"t{k}"}),
                                  *payload], copy=False)
                sent += 1
            peak = max(peak, rss(pid))
        # over the request's limits: refused with a reason before it is queued
        socks[0].send_multipart([encode_request(100, "put", "x", {**put, "tensor": "big"}),
                                 *payload, payload[0]], copy=False)
        replies: dict[str, int] = {}
        got = 0
        while got < sent + 1 and time.monotonic() < deadline:
            peak = max(peak, rss(pid))
            for s in socks:
                while s.poll(0):
                    r = msgpack.unpackb(s.recv_multipart()[0])
                    kind = "ok" if r["ok"] else r["error"]["type"]
                    replies[kind] = replies.get(kind, 0) + 1
                    if r["id"] == 100:
                        assert "PTC_WIRE_MAX_FRAMES" in r["error"]["message"]
                    got += 1
            time.sleep(0.005)
        assert got == sent + 1, replies
        assert replies.get("ok", 0) >= 1 and replies.get("Overloaded", 0) >= 1, replies
        # what the daemon holds stays within its cap (64 MiB), plus what ZeroMQ
        # queues and the copy a put of several frames makes
        assert peak - base < 256 * MIB, (peak - base) / MIB
        assert good.call("health")["request_bytes_held"] < 1024  # its own header
        good.call("commit", job="j", version=1)  # only a committed version is read
        assert bytes(good.read_into("j", 1, "w", "full")) == a.tobytes()
        assert good.call("ping")["host"] == "h0"
        for s in socks:
            s.close()
        good.close()
        print(f"flood: {sent} requests of 16 MiB, {replies}; "
              f"RssAnon +{(peak - base) / MIB:.0f} MiB at peak, "
              f"VmRSS {rss(pid, 'VmRSS') / MIB:.0f} MiB")
