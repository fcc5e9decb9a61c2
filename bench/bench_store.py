"""Throughput of the LMDB tensor store against plain numpy files, same run, same bytes.

For each directory (default: /dev/shm, memory; /tmp, disk) it writes
``--size-mb`` of sub-tensors of ``--tensor-mb`` each, then reads them back,
and does the same with one ``.npy`` file per sub-tensor in the same
directory. Best of ``--repeat`` runs, GB = 1e9 bytes.

- write: LmdbStore ``begin``, ``put`` each, ``commit`` (durable: fsync) vs
  ``np.save`` each file then ``fsync`` it (durable too).
- read into a buffer: zero-copy ``Reader.ranges`` copied once into a
  preallocated buffer vs ``open(..., buffering=0).readinto`` the same buffer.
- read_array: ``Reader.read_array`` (a new array each) vs ``np.load``.

Reads come from the page cache in both cases (dropping it needs root).
Like ptcd, this process first runs ``keep_heap()`` (``--no-keep-heap`` does
not). The store runs with LMDB writing by ``pwrite`` (the default) and, with
``--writemap``, also straight into its map (``LmdbStore(writemap=True)``).

    python bench/bench_store.py [--size-mb 1024] [--tensor-mb 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ptcfs.store import LmdbStore
from ptcfs.store.lmdb_store import keep_heap


def best_seconds(run: Callable[[int], None], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls ``run(i)``."""
    best = float("inf")
    for i in range(repeat):
        start = time.perf_counter()
        run(i)
        best = min(best, time.perf_counter() - start)
    return best


def bench_dir(base: Path, tensors: list[np.ndarray], repeat: int, chunk: int | None,
              modes: list[bool]) -> list[dict[str, Any]]:
    total = sum(a.nbytes for a in tensors)
    size = max(a.nbytes for a in tensors)
    buf = np.empty(size + 4096, dtype=np.uint8)  # room for a .npy header too
    with tempfile.TemporaryDirectory(dir=base, prefix="ptc-bench-") as tmp:
        root = Path(tmp)
        files = root / "files"
        files.mkdir()
        store = LmdbStore(root / "store-0", chunk_bytes=chunk, writemap=modes[0])

        def lmdb_write(i: int) -> None:
            v = store.begin("bench")
            for k, a in enumerate(tensors):
                store.put("bench", v, f"t{k}", "full", a, a.shape, "fp32")
            store.commit("bench", v)
            if v > 1:  # keep one copy on disk
                store.delete_version("bench", v - 1)

        def file_write(i: int) -> None:
            for k, a in enumerate(tensors):
                with open(files / f"t{k}.npy", "wb") as f:
                    np.save(f, a)
                    f.flush()
                    os.fsync(f.fileno())

        def lmdb_read_into(i: int) -> None:
            v = store.current("bench")
            assert v is not None
            with store.reader() as r:
                for k in range(len(tensors)):
                    pos = 0
                    for view in r.ranges("bench", v, f"t{k}", "full"):
                        buf[pos:pos + len(view)] = np.frombuffer(view, dtype=np.uint8)
                        pos += len(view)

        def file_read_into(i: int) -> None:
            for k in range(len(tensors)):
                with open(files / f"t{k}.npy", "rb", buffering=0) as f:
                    f.readinto(buf.data)

        def lmdb_read_array(i: int) -> None:
            v = store.current("bench")
            assert v is not None
            with store.reader() as r:
                for k in range(len(tensors)):
                    r.read_array("bench", v, f"t{k}", "full")

        def file_load(i: int) -> None:
            for k in range(len(tensors)):
                np.load(files / f"t{k}.npy")

        pairs = [("write+commit (fsync)", lmdb_write, file_write),
                 ("read into a buffer", lmdb_read_into, file_read_into),
                 ("read_array / np.load", lmdb_read_array, file_load)]
        peer_s = {op: best_seconds(peer, repeat) for op, _, peer in pairs}
        rows = []
        for i, writemap in enumerate(modes):
            if i:
                store.close()
                store = LmdbStore(root / f"store-{i}", chunk_bytes=chunk, writemap=writemap)
            try:
                for op, ours, _ in pairs:
                    t = best_seconds(ours, repeat)
                    rows.append({"dir": str(base), "op": op, "writemap": writemap,
                                 "bytes": total, "lmdb_gbps": total / t / 1e9,
                                 "files_gbps": total / peer_s[op] / 1e9, "ratio": peer_s[op] / t})
                back = store.get("bench", store.current("bench") or 0, "t0", "full")
                if back.tobytes() != tensors[0].tobytes():
                    raise SystemExit("the store gave back other bytes than were written")
            finally:
                store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print write and read throughput of LmdbStore against plain files."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--size-mb", type=int, default=1024, help="total MiB written (default 1024)")
    p.add_argument("--tensor-mb", type=int, default=64, help="MiB per sub-tensor (default 64)")
    p.add_argument("--chunk-mb", type=int, default=None,
                   help="store chunk size in MiB (default: the store's own)")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure; the best counts")
    p.add_argument("--dirs", nargs="+", default=["/dev/shm", "/tmp"],
                   help="directories to run in (default: /dev/shm /tmp)")
    p.add_argument("--writemap", action="store_true",
                   help="also run the store with writemap=True (see LmdbStore)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--no-keep-heap", action="store_true",
                   help="leave malloc as it is (ptcd runs keep_heap(): see lmdb_store)")
    args = p.parse_args(argv)
    if not args.no_keep_heap:
        keep_heap()
    if args.size_mb < 1 or args.tensor_mb < 1 or args.repeat < 1:
        p.error("--size-mb, --tensor-mb and --repeat must be positive")
    n = max(1, args.size_mb // args.tensor_mb)
    rng = np.random.default_rng(0)
    tensors = [np.frombuffer(rng.bytes(args.tensor_mb << 20), dtype=np.float32)
               for _ in range(n)]
    chunk = None if args.chunk_mb is None else args.chunk_mb << 20
    rows = []
    for d in args.dirs:
        if not os.path.isdir(d):
            print(f"bench_store: {d} is not a directory", file=sys.stderr)
            return 2
        rows += bench_dir(Path(d), tensors, args.repeat, chunk,
                          [False, True] if args.writemap else [False])
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{n} x {args.tensor_mb} MiB sub-tensors, best of {args.repeat}; GB/s (1e9 bytes/s); "
          "ratio > 1: LmdbStore is faster")
    print(f"{'dir':<10} {'operation':<22} {'store':<9} {'LmdbStore':>10} {'np files':>10} "
          f"{'ratio':>7}")
    for r in rows:
        mode = "writemap" if r["writemap"] else "pwrite"
        print(f"{r['dir']:<10} {r['op']:<22} {mode:<9} {r['lmdb_gbps']:>10.2f} "
              f"{r['files_gbps']:>10.2f} {r['ratio']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
