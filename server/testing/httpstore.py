"""A plain HTTP file server with byte ranges: the shared checkpoint storage
of a netns cluster (:mod:`ptcfs.server.testing.netnscluster`), where PyTorch DCP
loads from in the benchmarks, the way users keep checkpoints on a storage
server.

``python -m ptcfs.server.testing.httpstore ROOT --bind ADDR --port P [--ready-file F]``
serves the files under ``ROOT`` read-only: ``GET`` (whole file, or one
``Range: bytes=A-B`` range, answered ``206``) and ``HEAD``, HTTP/1.1 with
keep-alive, one thread per connection, file bytes sent with ``sendfile``.
The standard library's ``http.server`` ignores ``Range``, so a reader of a
few sub-tensors would have to fetch whole files through it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["RangeHandler", "serve", "main"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeHandler(BaseHTTPRequestHandler):
    """Files under the server's ``root``, with single byte ranges."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait between
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass  # one line per request would be most of the log

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = self._path()
        if path is None:
            self._error(404, "not found")
            return
        size = path.stat().st_size
        start, end, status = 0, size, 200
        want = self.headers.get("Range")
        if want:
            m = _RANGE.match(want.strip())
            if not m or (not m.group(1) and not m.group(2)):
                self._error(416, "only one range bytes=A-B is served")
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # bytes=-N: the last N bytes
                start = max(0, size - int(m.group(2)))
            if start >= end:
                self._error(416, f"range {want} outside the file's {size} bytes")
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            self.wfile.flush()
            with open(path, "rb") as f:
                self.connection.sendfile(f, start, end - start)

    def _path(self) -> Path | None:
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        root = self.server.root
        p = (root / rel).resolve()
        if p != root and root not in p.parents:
            return None
        return p if p.is_file() else None

    def _error(self, code: int, text: str) -> None:
        data = (text + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    root: Path


def serve(root: str | Path, bind: str, port: int, ready_file: str | Path | None = None) -> None:
    """Serve ``root`` on ``bind:port`` until killed; write ``ready_file``
    (JSON: pid, address) once listening."""
    server = _Server((bind, port), RangeHandler)
    server.root = Path(root).resolve()
    if ready_file is not None:
        ready = Path(ready_file)
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "address": f"{bind}:{port}"}) + "\n")
        tmp.replace(ready)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="httpstore", description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--ready-file")
    args = ap.parse_args(argv)
    try:
        serve(args.root, args.bind, args.port, args.ready_file)
    except OSError as e:
        print(f"httpstore: error: cannot serve {args.root} on {args.bind}:{args.port}: {e}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
