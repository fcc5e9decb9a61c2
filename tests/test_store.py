"""The store contract on every backend, and what only the LMDB store promises:
persistence, zero-copy reads, several processes, and writers killed mid-way."""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ptcfs.errors import InvalidConfig, InvalidRequest, StoreError
from ptcfs.store import LmdbStore, MemoryStore, TensorStore
from ptcfs.store.room import in_memory
from tests.store_contract import StoreContract, values

ROOT = Path(__file__).resolve().parents[1]


class TestLmdbStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LmdbStore]:
        self.opened = [LmdbStore(tmp_path / "store", chunk_bytes=self.CHUNK)]
        yield self.opened[0]
        for s in self.opened:
            s.close()

    def reopen(self, store: TensorStore) -> TensorStore:
        assert isinstance(store, LmdbStore)
        store.close()
        self.opened.append(LmdbStore(store.path, chunk_bytes=self.CHUNK))
        return self.opened[-1]


class TestLmdbStoreWritemap(TestLmdbStore):
    """The same contract with LMDB writing straight into its map."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LmdbStore]:
        self.opened = [LmdbStore(tmp_path / "store", chunk_bytes=self.CHUNK, writemap=True)]
        yield self.opened[0]
        for s in self.opened:
            s.close()

    def reopen(self, store: TensorStore) -> TensorStore:
        assert isinstance(store, LmdbStore) and store.writemap
        store.close()
        self.opened.append(LmdbStore(store.path, chunk_bytes=self.CHUNK, writemap=True))
        return self.opened[-1]


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> Iterator[MemoryStore]:
        s = MemoryStore()
        yield s
        s.close()


# --- LMDB only ---------------------------------------------------------------
@pytest.fixture
def lmdb_store(tmp_path: Path) -> Iterator[LmdbStore]:
    s = LmdbStore(tmp_path / "store", chunk_bytes=4096)
    yield s
    s.close()


def _mapped(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == os.path.realpath(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_reads_are_views_of_the_map(lmdb_store: LmdbStore) -> None:
    a = values((4096 * 3 + 1000,), "uint8")
    v = lmdb_store.begin("j")
    lmdb_store.put("j", v, "w", "full", a, a.shape, "uint8")
    maps = _mapped(lmdb_store.path / "data.mdb")
    assert maps, "data.mdb is not mapped into this process"

    def in_map(buf: memoryview | bytes) -> bool:
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        return any(lo <= addr and addr + len(buf) <= hi for lo, hi in maps)

    with lmdb_store.reader() as r:
        views = list(r.ranges("j", v, "w", "full", 100, 4096 * 2 + 50))
        assert [len(m) for m in views] == [4096 - 100, 4096, 150]  # one view per chunk touched
        for m in views:
            assert isinstance(m, memoryview) and m.readonly and not isinstance(m.obj, bytes)
            assert in_map(m), "a range was copied out of the map"
        assert not in_map(bytes(views[0]))  # the check can fail: a copy lives elsewhere
        assert b"".join(views) == a[100:100 + 4096 * 2 + 50].tobytes()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_where_entries_lie_is_found_from_the_tree_and_matches_lookups(tmp_path: Path) -> None:
    """file_ranges finds chunks by walking LMDB's pages (no lookup, which would
    touch every page of the chunk): enough chunks for a tree of several
    levels, entries with a last chunk small enough to sit inside a leaf page,
    and a snapshot whose meta page later commits have reused, where the walk
    must give up and the ordinary lookup answers instead."""
    from ptcfs.store.lmdb_pages import PageWalker
    from ptcfs.store.lmdb_store import _ckey

    s = LmdbStore(tmp_path / "s", chunk_bytes=3 * 4096)
    try:
        v = s.begin("j")
        shapes = {f"t{i}": (3 * 4096 * (1 + i % 4) + (i % 3) * 100,) for i in range(150)}
        for name, shape in shapes.items():
            s.put("j", v, name, "full", values(shape, "uint8"), shape, "uint8")
        s.commit("j", v)
        walker = s._walker
        assert isinstance(walker, PageWalker)

        def lookups(r: object, name: str) -> list[tuple[int, int, int]]:
            out = []
            for view in r.ranges("j", v, name, "full"):  # type: ignore[attr-defined]
                fd, pos = r.file_range(view)  # type: ignore[attr-defined]
                out.append((fd, pos, len(view)))
            return out

        with s.reader() as r:
            with s._live().begin() as txn:
                assert txn.stat(s._db["chunks"])["depth"] >= 2, "the tree is one page deep"
            for name, shape in shapes.items():
                got = r.file_ranges("j", v, name, "full")
                assert got is not None
                data = b"".join(os.pread(fd, n, pos) for fd, pos, n in got)
                assert data == values(shape, "uint8").tobytes()
                # only a last chunk small enough to sit in a leaf page was looked up
                small = shape[0] % (3 * 4096) != 0
                assert len(r._chunks) == small, name
                assert got == lookups(r, name), name
                r._chunks.clear()
            txnid = r._live().id()
            key = _ckey(r._entry("j", v, "t3", "full")["id"], 0)
            assert walker.locate(txnid, b"chunks", key) is not None
            assert walker.locate(txnid, b"chunks", b"no such key") is None
            assert walker.locate(txnid, b"no such db", b"x") is None
            # two more commits reuse this snapshot's meta page: a walk that did
            # not know the tree's root yet gives up, and file_ranges looks up
            for _ in range(2):
                w = s.begin("k")
                s.put("k", w, "x", "full", values((10,), "uint8"), (10,), "uint8")
            assert walker.locate(txnid, b"chunks", key) is not None  # its root is known
            fresh = PageWalker(walker.fd, walker.psize)
            assert fresh.locate(txnid, b"chunks", key) is None
            s._walker = fresh
            assert r.file_ranges("j", v, "t3", "full") == lookups(r, "t3")
            assert r._chunks
    finally:
        s.close()


def test_a_place_kept_across_snapshots_is_never_inside_a_leaf_page(tmp_path: Path) -> None:
    """``placement`` promises that two snapshots giving one token hold the
    entry's bytes at the same file ranges, and the mount keeps those ranges
    across snapshots on that promise. A value small enough to sit inside a
    leaf page moves whenever a neighbouring key changes, and its old page is
    reused: such an entry gets no token. (The soak saw the mount splice a
    bias from its stale place: a later save's bytes in a committed version.)"""
    chunk = 3 * 4096
    s = LmdbStore(tmp_path / "s", chunk_bytes=chunk)
    try:
        v = s.begin("j")
        sizes = {"big": 2 * chunk, "odd": chunk + 3000, "tail": chunk + 100, "small": 512}
        for name, n in sizes.items():
            s.put("j", v, name, "full", values((n,), "uint8"), (n,), "uint8")
        s.commit("j", v)
        with s.reader() as r:
            before = {name: (r.placement("j", v, name, "full"), r.file_ranges("j", v, name, "full"))
                      for name in sizes}
        assert before["big"][0] is not None and before["odd"][0] is not None
        assert before["small"][0] is None and before["tail"][0] is None
        for i in range(20):  # neighbouring keys come and go; freed pages are reused
            w = s.begin("j")
            for k in range(8):
                s.put("j", w, f"n{k}", "full", values((300,), "uint8", seed=i + 1), (300,),
                      "uint8")
            s.abort("j", w)
        with s.reader() as r:
            for name, n in sizes.items():
                want = values((n,), "uint8").tobytes()
                ranges = r.file_ranges("j", v, name, "full")
                assert ranges is not None
                assert b"".join(os.pread(fd, k, pos) for fd, pos, k in ranges) == want
                token, old = before[name]
                if token is not None and r.placement("j", v, name, "full") == token:
                    assert old is not None
                    assert b"".join(os.pread(fd, k, pos) for fd, pos, k in old) == want, name
    finally:
        s.close()


def test_keep_heap_serves_chunk_buffers_from_the_heap() -> None:
    """After keep_heap(), a chunk-sized buffer comes from malloc's heap (no
    mapping of its own) and its memory is reused for the next one; before
    it, glibc maps such a buffer apart. In a child: it changes the process."""
    code = """
import ctypes, sys
from ptcfs.store.lmdb_store import CHUNK_BYTES, keep_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def own_mapping(addr):
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return hi - lo < 2 * CHUNK_BYTES and addr - lo < 8192
    return False
a = libc.malloc(CHUNK_BYTES)
before = own_mapping(a)
libc.free(a)
assert keep_heap()
b = libc.malloc(CHUNK_BYTES)
after = own_mapping(b)
libc.free(b)
c = libc.malloc(CHUNK_BYTES)
print(before, after, b == c)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True"]


def test_chunk_size_is_kept_per_entry(tmp_path: Path) -> None:
    s = LmdbStore(tmp_path / "s", chunk_bytes=1000)
    v = s.begin("j")
    a = values((2500,), "uint8")
    s.put("j", v, "old", "full", a, a.shape, "uint8")
    s.close()
    s = LmdbStore(tmp_path / "s", chunk_bytes=300)
    s.put("j", v, "new", "full", a, a.shape, "uint8")
    with s.reader() as r:
        assert [len(m) for m in r.ranges("j", v, "old", "full")] == [1000, 1000, 500]
        assert [len(m) for m in r.ranges("j", v, "new", "full")][:2] == [300, 300]
        assert r.read("j", v, "old", "full") == r.read("j", v, "new", "full") == a.tobytes()
    s.close()


def test_tunables_come_from_argument_then_environment(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PTC_STORE_CHUNK_BYTES", "4096")
    monkeypatch.setenv("PTC_STORE_MAP_SIZE", str(1 << 30))
    with LmdbStore(tmp_path / "a") as s:
        assert s.stats()["chunk_bytes"] == 4096 and s.stats()["map_size"] == 1 << 30
    with LmdbStore(tmp_path / "b", chunk_bytes=512, map_size=1 << 31) as s:
        assert s.stats()["chunk_bytes"] == 512 and s.stats()["map_size"] == 1 << 31
    monkeypatch.setenv("PTC_STORE_CHUNK_BYTES", "lots")
    with pytest.raises(InvalidConfig, match="PTC_STORE_CHUNK_BYTES"):
        LmdbStore(tmp_path / "c")
    with pytest.raises(InvalidRequest, match="chunk_bytes"):
        LmdbStore(tmp_path / "c", chunk_bytes=0)
    monkeypatch.delenv("PTC_STORE_CHUNK_BYTES")
    with LmdbStore(tmp_path / "d") as s:
        assert s.stats()["chunk_bytes"] == 16 << 20


@pytest.mark.parametrize("writemap", [False, True], ids=["pwrite", "writemap"])
def test_a_full_store_says_what_to_do(tmp_path: Path, writemap: bool) -> None:
    with LmdbStore(tmp_path / "small", map_size=1 << 20, writemap=writemap) as s:
        v1 = s.begin("j")
        s.put("j", v1, "w", "full", values((1000,)), (1000,), "fp32")
        s.commit("j", v1)
        v2 = s.begin("j")
        big = np.zeros(1 << 20, dtype=np.uint8)
        with pytest.raises(StoreError, match="full.*map_size") as e:
            s.put("j", v2, "big", "full", big, big.shape, "uint8")
        assert "PTC_STORE_MAP_SIZE" in str(e.value)
        s.put("j", v2, "small", "full", big[:10], (10,), "uint8")  # still usable
        np.testing.assert_array_equal(s.get("j", v1, "w", "full"), values((1000,)))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (needs the right to mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "ptcfs-test", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_filesystem_under_writemap_is_an_error_not_a_crash(small_fs: Path) -> None:
    """A writemap put that does not fit raises StoreError before writing (it
    would otherwise die of SIGBUS inside LMDB); the store goes on working.
    The writer is a child process so that a crash cannot take pytest along."""
    script = """
import json, sys
import numpy as np
from ptcfs.errors import StoreError
from ptcfs.store import LmdbStore
out = []
with LmdbStore(sys.argv[1], writemap=True, map_size=1 << 30) as s:
    v = s.begin("j")
    for mib in (2, 16, 3):
        data = np.full(mib << 20, mib, dtype=np.uint8)
        try:
            s.put("j", v, f"t{mib}", "full", data, data.shape, "uint8")
            out.append("ok")
        except StoreError as e:
            out.append(str(e))
    s.commit("j", v)
    out.append(sorted(e.tensor for e in s.entries("j", v)))
    out.append(int(s.get("j", v, "t3", "full").sum()))
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", script, str(small_fs / "store")],
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr)
    first, big, last, names, total = json.loads(r.stdout)
    assert (first, last) == ("ok", "ok")
    assert "no room for" in big and "nothing was written" in big
    assert names == ["t2", "t3"] and total == 3 * (3 << 20)


def test_a_full_store_recovers_once_versions_are_freed(small_fs: Path) -> None:
    """Writemap on a full filesystem: the put that does not fit names what
    can be freed; once the staging version is aborted its pages are written
    again, without a restart, and so are a deleted version's after one
    (they used to count as taken for good, so every later write failed)."""
    script = """
import json, sys
import numpy as np
from ptcfs.errors import StoreError
from ptcfs.store import LmdbStore
out = []
def put(s, v, name, mib):
    data = np.full(mib << 20, mib, dtype=np.uint8)
    try:
        s.put("j", v, name, "full", data, data.shape, "uint8")
        out.append("ok")
    except StoreError as e:
        out.append(str(e))
with LmdbStore(sys.argv[1], writemap=True, map_size=1 << 30) as s:
    v = s.begin("j"); put(s, v, "a", 1); s.commit("j", v)
    v = s.begin("j"); put(s, v, "b", 3); put(s, v, "c", 3); put(s, v, "d", 3); s.abort("j", v)
    v = s.begin("j"); put(s, v, "e", 3); put(s, v, "f", 2); s.commit("j", v)
with LmdbStore(sys.argv[1], writemap=True, map_size=1 << 30) as s:
    s.delete_version("j", 1)
    v = s.begin("j"); put(s, v, "g", 1); s.commit("j", v)
    out.append([int(s.get("j", w, t, "full").sum()) for w, t in ((3, "e"), (4, "g"))])
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", script, str(small_fs / "store")],
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr)
    *results, sums = json.loads(r.stdout)
    assert results[:2] + results[4:] == ["ok"] * 5, results  # a, b; then e, f and g
    for full in results[2:4]:  # c and d: 3 MiB more do not fit in 8 MiB
        assert "no room" in full and "staging versions that can be aborted: j v2" in full
    assert sums == [3 * (3 << 20), 1 << 20]


def test_one_store_directory_opens_once_per_process(tmp_path: Path) -> None:
    s = LmdbStore(tmp_path / "s")
    with pytest.raises(StoreError, match="open in this process already"):
        LmdbStore(tmp_path / ".." / tmp_path.name / "s")
    s.close()
    LmdbStore(tmp_path / "s").close()


def test_read_only_stores(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="cannot open"):
        LmdbStore(tmp_path / "absent", readonly=True)
    with LmdbStore(tmp_path / "s") as s:
        v = s.begin("j")
        s.put("j", v, "w", "full", values((10,)), (10,), "fp32")
        s.commit("j", v)
    with LmdbStore(tmp_path / "s", readonly=True) as s:
        np.testing.assert_array_equal(s.get("j", 1, "w", "full"), values((10,)))
        with pytest.raises(StoreError, match="read-only"):
            s.begin("j")


# --- other processes -----------------------------------------------------------
CHILD = """
import hashlib, json, sys
import numpy as np
from ptcfs.store import LmdbStore

mode, path = sys.argv[1], sys.argv[2]
if mode == "digest":  # print the sha256 of every entry of version 1
    with LmdbStore(path, readonly=True) as s, s.reader() as r:
        out = {}
        for e in s.entries("job", 1):
            h = hashlib.sha256()
            for view in r.ranges("job", 1, e.tensor, e.part):
                h.update(view)
            out[e.tensor] = h.hexdigest()
    print(json.dumps(out), flush=True)
    sys.exit(0)
s = LmdbStore(path, chunk_bytes=4096)
v = s.begin("job")
if mode == "commit":  # stage and commit version 2
    s.put("job", v, "new", "full", np.arange(1000, dtype=np.int64), (1000,), "int64")
    s.commit("job", v, {"by": "child"})
    sys.exit(0)
if mode == "txn":  # die while holding LMDB's write lock, inside a transaction
    with s._write() as txn:
        txn.put(b"half-done", b"x" * 100000, db=s._db["meta"])
        print("ready", v, flush=True)
        sys.stdin.read()
n = 1 << 18 if mode == "loop" else 3000
i = 0
while True:  # "stage": 4 puts, then wait; "loop": 1 MiB puts until killed
    s.put("job", v, f"t{i}", "full", np.arange(n, dtype=np.float32) + i, (n,), "fp32")
    i += 1
    if i == (1 if mode == "loop" else 4):
        print("ready", v, flush=True)
        if mode == "stage":
            sys.stdin.read()
"""


@pytest.fixture(params=[False, True], ids=["pwrite", "writemap"])
def writemap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test with LMDB writing by pwrite, then into its map (set for children too)."""
    monkeypatch.setenv("PTC_STORE_WRITEMAP", "1" if request.param else "0")
    return bool(request.param)


def _child(mode: str, path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, str(path)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _version_one(path: Path) -> dict[str, np.ndarray]:
    """Create a store at ``path`` whose committed version 1 spans many chunks."""
    data = {f"w{i}": values((1000 + 777 * i,), seed=i) for i in range(5)}
    with LmdbStore(path, chunk_bytes=4096) as s:
        v = s.begin("job", {"step": 10})
        for name, a in data.items():
            s.put("job", v, name, "full", a, a.shape, "fp32")
        s.commit("job", v)
    return data


def _kill_when_ready(proc: subprocess.Popen[str]) -> None:
    """Wait for the child's "ready" line (it is mid-way through staging), then SIGKILL it."""
    assert proc.stdout is not None
    line = ""
    if select.select([proc.stdout], [], [], 60)[0]:  # a bound, not a synchronisation
        line = proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert line.split() == ["ready", "2"], f"child said {line!r}, stderr: {err}"
    assert proc.returncode == -signal.SIGKILL


def _check_after_crash(path: Path, data: dict[str, np.ndarray]) -> LmdbStore:
    s = LmdbStore(path, chunk_bytes=4096)
    assert s.current("job") == 1
    assert [(i.version, i.state) for i in s.versions("job")] == [(1, "committed"),
                                                                 (2, "staging")]
    assert s.versions("job")[0].meta == {"step": 10}
    assert [e.tensor for e in s.entries("job", 1)] == sorted(data)
    with s.reader() as r:
        for name, a in data.items():
            assert r.read("job", 1, name, "full") == a.tobytes()
    return s


def _finish(s: LmdbStore) -> None:
    s.abort("job", 2)
    assert [i.version for i in s.versions("job")] == [1]
    v = s.begin("job")
    assert v == 3
    s.put("job", v, "w0", "full", values((3,)), (3,), "fp32")
    s.commit("job", v)
    assert s.current("job") == 3


def test_two_processes_read_one_store(tmp_path: Path) -> None:
    data = _version_one(tmp_path / "s")
    with LmdbStore(tmp_path / "s") as mine:  # this process keeps it open meanwhile
        procs = [_child("digest", tmp_path / "s") for _ in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        want = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in data.items()}
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err
            assert json.loads(out) == want
        writer = _child("commit", tmp_path / "s")
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        assert mine.current("job") == 2  # another process's commit, seen without reopening
        np.testing.assert_array_equal(mine.get("job", 2, "new", "full"), np.arange(1000))


def test_a_writer_killed_before_commit_leaves_the_old_version(tmp_path: Path,
                                                             writemap: bool) -> None:
    data = _version_one(tmp_path / "s")
    proc = _child("stage", tmp_path / "s")
    _kill_when_ready(proc)
    s = _check_after_crash(tmp_path / "s", data)
    assert s.writemap == writemap
    staged = {e.tensor: e for e in s.entries("job", 2)}
    assert sorted(staged) == ["t0", "t1", "t2", "t3"]  # its finished puts are kept, staging
    np.testing.assert_array_equal(s.get("job", 2, "t2", "full"),
                                  np.arange(3000, dtype=np.float32) + 2)
    _finish(s)
    s.close()


def test_a_writer_killed_in_a_put_loop(tmp_path: Path, writemap: bool) -> None:
    data = _version_one(tmp_path / "s")
    with LmdbStore(tmp_path / "s") as peer:  # a live peer process sees it too
        _kill_when_ready(_child("loop", tmp_path / "s"))
        assert peer.current("job") == 1
    s = _check_after_crash(tmp_path / "s", data)
    staged = s.entries("job", 2)
    assert staged, "the first put returned before the child said ready"
    with s.reader() as r:  # each put is all or nothing
        for e in staged:
            i = int(e.tensor[1:])
            assert r.read("job", 2, e.tensor, "full") == (
                np.arange(1 << 18, dtype=np.float32) + i).tobytes()
    _finish(s)
    s.close()


def test_a_writer_killed_inside_a_transaction_releases_the_lock(tmp_path: Path,
                                                                writemap: bool) -> None:
    data = _version_one(tmp_path / "s")
    _kill_when_ready(_child("txn", tmp_path / "s"))
    outcome: list[BaseException | None] = []

    def recover() -> None:  # opening and writing block forever if the lock stayed held
        try:
            s = _check_after_crash(tmp_path / "s", data)
            assert s.entries("job", 2) == []
            with s._read() as txn:  # the dead writer's transaction left nothing behind
                assert txn.get(b"half-done", db=s._db["meta"]) is None
            _finish(s)
            s.close()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            outcome.append(e)

    t = threading.Thread(target=recover, daemon=True)
    t.start()
    t.join(timeout=30)
    assert outcome, "a writer killed inside a transaction left LMDB's write lock held"
    if outcome[0] is not None:
        raise outcome[0]


def _room_end(s: LmdbStore) -> int:
    """Where the data file's written pages end (past them: no room)."""
    st = s.stats()
    return int(st["bytes_used"] + st["room_bytes"])


def _resident(s: LmdbStore) -> int:
    """Bytes of this process's map of the store's data file that are in memory."""
    data, rss, inside = str(s.path / "data.mdb"), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) == 6 and os.path.realpath(head[5]) == os.path.realpath(data)
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


def test_writemap_is_on_by_default_for_stores_in_memory(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PTC_STORE_WRITEMAP", raising=False)
    on_disk = next((p for p in (tmp_path, ROOT) if not in_memory(p)), None)
    if on_disk is None:
        pytest.skip("no folder on disk here (the temporary folder and the checkout are in memory)")
    shm, disk = Path(tempfile.mkdtemp(dir="/dev/shm")), Path(tempfile.mkdtemp(dir=on_disk))
    try:
        assert in_memory(shm) and not in_memory(disk)
        with LmdbStore(shm / "s") as s:
            assert s.writemap and s.stats()["writemap"]
        with LmdbStore(disk / "s") as s:
            assert not s.writemap
        with LmdbStore(shm / "s", readonly=True) as s:
            assert not s.writemap
        monkeypatch.setenv("PTC_STORE_WRITEMAP", "0")
        with LmdbStore(shm / "s") as s:
            assert not s.writemap
        monkeypatch.setenv("PTC_STORE_WRITEMAP", "1")
        with LmdbStore(disk / "s") as s:
            assert s.writemap
        with LmdbStore(disk / "s", writemap=False) as s:
            assert not s.writemap
    finally:
        shutil.rmtree(shm)
        shutil.rmtree(disk)


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_make_room_past_the_pages_in_use(tmp_path: Path, writemap: bool, where: str) -> None:
    mib = 1 << 20
    a = np.arange(3 * mib, dtype=np.uint8)
    b = a[::-1].copy()
    base = tmp_path if where == "disk" else Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        with LmdbStore(base / "s", chunk_bytes=mib) as s:
            v1 = s.begin("j")
            s.put("j", v1, "a", "full", a, a.shape, "uint8")
            s.commit("j", v1)
            # (writemap: each write gives the file blocks for 1 MiB more, posix_fallocate)
            assert s.stats()["room_bytes"] < (2 * mib if writemap else mib)
            assert s.make_room(4 * mib, stop=lambda: True) == 0
            resident = _resident(s)
            made = s.make_room(4 * mib)
            # all of it and 1/64 for the trees, but the few pages they have
            assert 4 * mib <= s.stats()["room_bytes"] <= 4 * mib + (4 * mib) // 64 + 2 * mib
            assert 0 < made <= s.stats()["room_bytes"]
            if writemap:  # faulted in, writable, in this process's map
                assert _resident(s) >= resident + made
            assert s.make_room(4 * mib) == 0  # there is room already
            end = _room_end(s)
            v2 = s.begin("j")
            s.put("j", v2, "b", "full", b, b.shape, "uint8")
            s.commit("j", v2)
            assert s.stats()["bytes_used"] <= end  # written into the room
            if not writemap:  # (writemap's reservation may give blocks past it)
                assert _room_end(s) == end
            s.delete_version("j", v1)
            assert s.make_room(3 * mib) == 0  # the pages a held count
        with LmdbStore(base / "s", chunk_bytes=mib) as s:
            np.testing.assert_array_equal(s.get("j", v2, "b", "full"), b)
            assert s.make_room(0) == 0
    finally:
        if where == "tmpfs":
            shutil.rmtree(base)


def test_make_room_while_another_thread_writes(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step holds the write lock: no write lands where zeros go after."""
    monkeypatch.setattr("ptcfs.store.lmdb_store.ROOM_STEP", 1 << 20)  # many steps
    arrays = [np.full(300_000 + i, i, dtype=np.uint8) for i in range(24)]
    with LmdbStore(tmp_path / "s", chunk_bytes=1 << 16) as s:
        v = s.begin("j")
        made: list[int] = []
        t = threading.Thread(target=lambda: made.append(s.make_room(96 << 20)))
        t.start()
        for i, x in enumerate(arrays):
            s.put("j", v, f"t{i}", "full", x, x.shape, "uint8")
        t.join()
        s.commit("j", v)
        assert made[0] > 0
    with LmdbStore(tmp_path / "s", readonly=True) as s:
        for i, x in enumerate(arrays):
            np.testing.assert_array_equal(s.get("j", v, f"t{i}", "full"), x)


def test_make_room_leaves_half_the_filesystem_free(small_fs: Path) -> None:
    with LmdbStore(small_fs / "s", map_size=1 << 30) as s:
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        assert 0 < s.make_room(64 << 20) <= free // 2
        v = s.begin("j")
        x = np.ones(1 << 20, dtype=np.uint8)
        s.put("j", v, "x", "full", x, x.shape, "uint8")
        s.commit("j", v)
        assert int(s.get("j", v, "x", "full").sum()) == 1 << 20
    with LmdbStore(small_fs / "w", map_size=1 << 30, writemap=True) as s:
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        made = s.make_room(64 << 20)
        assert 0 < made <= free // 2 and s.stats()["room_bytes"] >= made
        v = s.begin("j")
        x = np.full(1 << 20, 2, dtype=np.uint8)
        s.put("j", v, "x", "full", x, x.shape, "uint8")
        s.commit("j", v)
        assert int(s.get("j", v, "x", "full").sum()) == 2 << 20
