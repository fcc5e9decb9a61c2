"""The /ptc filesystem on real mounts of real daemons: reads, slices,
versions, reconfiguration under readers, writes and commits, stale mounts."""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.dtypes import numpy_dtype
from ptcfs.plan.reshard import cut
from ptcfs.sharding import rank_coords, rank_tensors
from ptcfs.vfile import VFile
from tests.test_cluster import SMALL, checksums, ptcctl

pytestmark = [pytest.mark.fuse, pytest.mark.multihost]

VIT = "vit:layers=2,hidden=64,heads=4,image=32,patch=8,classes=10"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two hosts, one copy of everything (so h0's mount reads h1's pieces
    from h1), each with its filesystem mounted."""
    from ptcfs.server.testing.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("fuse"))
    # every file takes both read paths: direct at its first open, then the page cache
    os.environ["PTC_MOUNT_WARM_MIN_BYTES"] = "1"
    try:
        lc.up(2, gpus=2, replicas=1, mount=True, metrics=True)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "g", "--model", SMALL, "--optimizer", "adam",
               "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "3")
        ptcctl(cf, "job", "create", "v", "--model", VIT, "--dtype", "fp32",
               "--config", "tp=2,pp=2", "--hosts", "h0:2,h1:2", "--seed", "4")
        co = Coordinator(Cluster.load(cf))
        yield lc, co
        co.cluster.close()
    finally:
        del os.environ["PTC_MOUNT_WARM_MIN_BYTES"]
        lc.down()


def entry(co: Coordinator, job: str, host: str, spec, sl) -> np.ndarray:
    state = co.state(job)
    data = co.cluster.client(host).read_box(job, state.version, spec.name, sl.key(),
                                            tuple((0, n) for n in sl.local_shape(spec.shape)))
    return np.frombuffer(data, dtype=numpy_dtype(spec.dtype)).reshape(
        sl.local_shape(spec.shape))


def test_every_tensor_and_rank_file_matches_the_cluster(cluster):
    lc, co = cluster
    mnt = lc.mount_dir("h0")
    for job in ("g", "v"):
        state = co.state(job)
        model = state.model_spec()
        for spec in model.tensors_for(state.config.pp):
            got = np.load(mnt / job / "tensors" / f"{spec.name}.npy")
            np.testing.assert_array_equal(got, co.fetch_tensor(state, spec.name))
        for rank in range(state.config.world):
            host = rank_coords(state.config)[rank].host
            rdir = mnt / job / "ranks" / str(rank)
            with safe_open(str(rdir / "state.safetensors"), "np") as st:
                for spec, sl in rank_tensors(model, state.config, rank):
                    want = entry(co, job, host, spec, sl)
                    np.testing.assert_array_equal(np.load(rdir / f"{spec.name}.npy"), want)
                    np.testing.assert_array_equal(st.get_tensor(spec.name), want)
    # the same bytes as ptcctl tensor get, with and without a slice
    name = "encoder.layers.1.mlp.dense_4h_to_h.weight"
    out = lc.dir / "get.npy"
    ptcctl(lc.cluster_file, "tensor", "get", "g", name, "--slice", "3:9,-40:", "--out", str(out))
    np.testing.assert_array_equal(np.load(mnt / "g" / "tensors" / f"{name}.npy[3:9,-40:]"),
                                  np.load(out))


def test_local_reads_are_answered_as_ranges_of_the_store_file(cluster):
    """What the mount splices: rank 0's file on h0 is header literals and
    ranges of h0's LMDB data file, whose bytes are the file's; rank 1's
    pieces live on h1, so h0 copies them through its reader instead."""
    from ptcfs.fuse.paths import parse_path
    from ptcfs.fuse.reading import IDLE_S, FileRange, ReadServer
    from ptcfs.fuse.tree import Catalog
    from ptcfs.store.lmdb_store import LmdbStore

    lc, co = cluster
    store = LmdbStore(lc.dir / "h0", readonly=True)
    try:
        server = ReadServer(store, "h0", remote=None)  # type: ignore[arg-type]
        catalog = Catalog(store)
        item = catalog.resolve(parse_path("/g/ranks/0/state.safetensors")).item
        whole = (lc.mount_dir("h0") / "g" / "ranks" / "0" / "state.safetensors").read_bytes()
        assert len(whole) == item.size
        ranges = 0
        for offset, size in ((0, 4096), (item.size // 2, 128 << 10), (item.size - 5000, 1 << 20)):
            pieces = server.pieces(item, offset, size)
            assert pieces is not None
            got = b"".join(os.pread(p.fd, p.size, p.pos) if isinstance(p, FileRange) else p
                           for p in pieces)
            assert got == whole[offset:offset + size]
            ranges += sum(isinstance(p, FileRange) for p in pieces)
        assert ranges > 0
        other = catalog.resolve(parse_path("/g/ranks/1/state.safetensors")).item
        assert server.pieces(other, 0, 1 << 20) is None
        # rows of a tensor are one run of it: such a slice is spliced too, from
        # each rank's entry (dense_h_to_4h is split by rows over tp=2)
        mnt = lc.mount_dir("h0") / "g"
        for path in ("ranks/0/encoder.layers.1.mlp.dense_h_to_4h.weight.npy[3:9]",
                     "ranks/0/encoder.layers.1.mlp.dense_h_to_4h.weight.npy[5]",
                     "tensors/encoder.layers.1.mlp.dense_h_to_4h.weight.npy[10:-10,:]",
                     "tensors/embedding.position_embeddings.weight.npy[2:2]"):
            sliced = catalog.resolve(parse_path(f"/g/{path}")).item
            assert isinstance(sliced, VFile), path
            data = (mnt / path).read_bytes()
            whole_array = np.load(mnt / path.split("[")[0])
            index = tuple(int(a) if ":" not in a else
                          slice(*(int(v) if v else None for v in a.split(":")))
                          for a in path.split("[")[1].rstrip("]").split(","))
            np.testing.assert_array_equal(np.load(io.BytesIO(data)), whole_array[index])
            if path.startswith("ranks"):
                pieces = server.pieces(sliced, 0, sliced.size)
                assert pieces is not None
                assert b"".join(os.pread(p.fd, p.size, p.pos) if isinstance(p, FileRange)
                                else p for p in pieces) == data
        assert not isinstance(catalog.resolve(parse_path(
            "/g/tensors/encoder.layers.1.mlp.dense_h_to_4h.weight.npy[:,1:]")).item, VFile)
        # a thread keeps its snapshot between reads (by thread id: libfuse's threads
        # enter Python afresh on every call); an idle thread's is closed by the sweeper
        state = server._tls
        kept = state.reader
        assert kept is not None and server.pieces(item, 0, 4096) is not None
        assert server._tls is state and state.reader is kept
        state.used -= IDLE_S + 1
        server._sweep(time.monotonic())
        assert state.reader is None and server._tls is not state
        # where an entry lies is kept for every thread and snapshot: the new
        # state finds it without walking the entry's chunks again
        placed = dict(server._placed)
        assert placed and server.pieces(item, 0, 4096) is not None
        assert server._placed == placed
        assert all(any(v is p for p in placed.values())
                   for v in server._tls.extents.values() if v is not None)
        server.close()
    finally:
        store.close()


@pytest.mark.parametrize("job, name, index", [
    ("g", "encoder.layers.0.mlp.dense_h_to_4h.bias", "100:300"),
    ("g", "encoder.layers.0.mlp.dense_h_to_4h.bias", "-1"),
    ("g", "encoder.layers.0.self_attention.dense.weight", "5:77,60:70"),
    ("g", "encoder.layers.0.self_attention.dense.weight", "7"),
    ("g", "embedding.word_embeddings.weight", ":,1:2"),
    ("v", "embedding.position_embeddings", "0,1:5,:"),
    ("v", "embedding.position_embeddings", ":,-3:,2:7"),
    ("v", "embedding.patch_embeddings.weight", "10:20,1,:,3:5"),
    ("g", "optim/exp_avg/encoder.layers.0.self_attention.dense.weight", "2:4,100:"),
])
def test_slices_on_every_rank_are_numpy_slices(cluster, job, name, index):
    lc, co = cluster
    whole = np.load(lc.mount_dir("h0") / job / "tensors" / f"{name}.npy")
    for h in ("h0", "h1"):
        got = np.load(lc.mount_dir(h) / job / "tensors" / f"{name}.npy[{index}]")
        want = eval(f"whole[{index}]", {}, {"whole": whole})  # numpy reads the same text
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_ls_du_find_and_exact_sizes(cluster):
    lc, co = cluster
    mnt = lc.mount_dir("h1")
    assert sorted(os.listdir(mnt)) == ["g", "v"]
    assert sorted(os.listdir(mnt / "g")) == ["config.json", "dcp", "ranks", "tensors", "versions"]
    cfg = json.loads((mnt / "g" / "config.json").read_text())
    assert cfg["config"]["tp"] == 2 and cfg["version"] == co.state("g").version
    found = subprocess.run(["find", "-L", str(mnt / "g" / "tensors"), "-type", "f"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(found) == len(co.state("g").model_spec().tensors_for(1))
    for f in found[:20]:
        assert os.stat(f).st_size == len(Path(f).read_bytes())
    ls = subprocess.run(["ls", "-l", str(mnt / "g" / "ranks" / "0")], capture_output=True,
                        text=True, check=True).stdout
    assert "state.safetensors" in ls and "optim" in ls
    du = subprocess.run(["du", "-sbL", str(mnt / "v" / "tensors")], capture_output=True,
                        text=True, check=True).stdout
    assert int(du.split()[0]) > 0


@pytest.mark.parametrize("path, code", [
    ("g/tensors/nope.npy", errno.ENOENT),
    ("g/tensors/optim/nope", errno.ENOENT),
    ("nojob/config.json", errno.ENOENT),
    ("g/versions/99/config.json", errno.ENOENT),
    ("g/ranks/9/state.safetensors", errno.ENOENT),
    ("g/tensors/encoder.final_layernorm.bias.npy[0:999]", errno.EINVAL),
    ("g/tensors/encoder.final_layernorm.bias.npy[::2]", errno.EINVAL),
    ("g/tensors/encoder.final_layernorm.bias.npy[0:4", errno.EINVAL),
    ("g/tensors/encoder.final_layernorm.bias.npy[0,0]", errno.EINVAL),
])
def test_bad_paths_give_the_right_errno(cluster, path, code):
    lc, _ = cluster
    with pytest.raises(OSError) as e:
        open(lc.mount_dir("h0") / path, "rb").read()
    assert e.value.errno == code


def test_writes_outside_a_ranks_folder_are_refused(cluster):
    lc, _ = cluster
    for path in ("g/tensors/encoder.final_layernorm.bias.npy", "g/config.json", "g/new.npy",
                 "g/versions/99/ranks/0/state.safetensors"):
        with pytest.raises(OSError) as e:
            open(lc.mount_dir("h0") / path, "wb").close()
        assert e.value.errno in (errno.EACCES, errno.EROFS, errno.ENOENT, errno.EPERM), path


def test_what_the_mount_does_not_do_is_eacces_not_enosys(cluster):
    """mkdir in a dataset view gave ENOSYS ("Function not implemented"), so
    Megatron-Core's GPTDataset could not say what was wrong."""
    lc, _ = cluster
    mnt = lc.mount_dir("h0")
    rank = mnt / "g" / "ranks" / "0"
    calls = [
        lambda: os.mkdir(rank / "cache"),
        lambda: os.mkdir(mnt / "g" / "tensors" / "x"),
        lambda: os.rmdir(mnt / "g" / "versions"),
        lambda: os.symlink("x", rank / "link"),
        lambda: os.link(rank / "state.safetensors", rank / "hard"),
        lambda: os.chmod(rank / "state.safetensors", 0o777),
        lambda: os.chown(rank / "state.safetensors", 1, 1),
        lambda: os.mknod(rank / "fifo", 0o600 | stat.S_IFIFO),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EACCES, (i, e.value)


def trained(spec, step: int) -> np.ndarray:
    n = int(np.prod(spec.shape))
    return (np.arange(n) % 89 * 0.01 + step).reshape(spec.shape).astype(numpy_dtype(spec.dtype))


def test_save_through_the_mount_then_commit(cluster, tmp_path):
    lc, co = cluster
    state = co.state("g")
    model = state.model_spec()
    before = checksums(lc.cluster_file, "g")
    # a file that does not match rank 0's tensors is refused at close (cp fails), and
    # nothing changes
    bad = tmp_path / "bad.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(bad))
    r0 = lc.mount_dir("h0") / "g" / "ranks" / "0"
    cp = subprocess.run(["cp", str(bad), str(r0 / "state.safetensors")], capture_output=True,
                        text=True)
    assert cp.returncode != 0 and "Invalid argument" in cp.stderr
    with pytest.raises(OSError) as e:
        with open(r0 / "encoder.final_layernorm.bias.npy", "wb") as f:
            np.save(f, np.zeros(7, np.float16))  # the wrong shape
    assert e.value.errno == errno.EINVAL
    # rank 0 saves through h0's mount with safetensors (a temporary file, then a rename);
    # rank 1 through h1's, one .npy at a time
    files = {}
    for rank in (0, 1):
        files[rank] = {spec.name: np.ascontiguousarray(cut(spec, sl, trained(spec, 5)))
                       for spec, sl in rank_tensors(model, state.config, rank)}
    # while a reader holds the current file open (as the mount's own cache filler
    # may): the rename replaces it, and the reader keeps reading what it opened
    current = r0 / "state.safetensors"
    with open(current, "rb") as held:
        head = held.read(100)
        save_file(files[0], str(current))
        rest = held.read()
    assert not [n for n in os.listdir(r0) if n.startswith(".fuse_hidden")]
    opened = lc.mount_dir("h0") / "g" / "versions" / str(state.version) / "ranks" / "0"
    assert head + rest == (opened / "state.safetensors").read_bytes()
    r = ptcctl(lc.cluster_file, "commit", "g", "--step", "5", check=False)
    assert r.returncode != 0 and "not written" in r.stderr  # rank 1 has not saved yet
    assert checksums(lc.cluster_file, "g") == before
    for name, arr in files[1].items():
        np.save(lc.mount_dir("h1") / "g" / "ranks" / "1" / f"{name}.npy", arr)
    out = json.loads(ptcctl(lc.cluster_file, "commit", "g", "--step", "5", "--json").stdout)
    assert out["step"] == 5 and out["version"] > state.version
    new = co.state("g")
    for spec in model.tensors_for(1):
        np.testing.assert_array_equal(
            np.load(lc.mount_dir("h1") / "g" / "tensors" / f"{spec.name}.npy"),
            trained(spec, 5))
    assert json.loads((lc.mount_dir("h0") / "g" / "config.json").read_text())["step"] == 5
    # the previous version stays readable, and read-only, under versions/
    old = lc.mount_dir("h0") / "g" / "versions" / str(state.version)
    name = "encoder.final_layernorm.bias"
    np.testing.assert_array_equal(np.load(old / "tensors" / f"{name}.npy"),
                                  co.fetch_tensor(state, name))
    with pytest.raises(PermissionError):
        open(old / "ranks" / "0" / "state.safetensors", "wb").close()
    assert os.readlink(lc.mount_dir("h0") / "g" / "tensors") == \
        f"versions/{new.version}/tensors"


def test_a_file_of_a_tensor_the_rank_does_not_hold_is_einval_at_close(cluster):
    """``ranks/0/x.npy`` closed without an error and was dropped, where the
    README promises EINVAL at close."""
    lc, _ = cluster
    r0 = lc.mount_dir("h0") / "g" / "ranks" / "0"
    with pytest.raises(OSError) as e:
        with open(r0 / "x.npy", "wb") as f:
            np.save(f, np.zeros(3, np.float32))
    assert e.value.errno == errno.EINVAL
    assert "x.npy" not in os.listdir(r0)


def test_a_save_being_written_is_invisible_to_readers(cluster):
    """While a rank's state file is being written through the mount, a
    reader opening the committed one gets it whole (it used to be cut to the
    bytes written so far)."""
    lc, _ = cluster
    path = lc.mount_dir("h0") / "v" / "ranks" / "0" / "state.safetensors"
    old = path.read_bytes()
    w = open(path, "wb")
    try:
        w.write(old[: len(old) // 3])
        w.flush()
        size = os.stat(path).st_size
        whole = path.read_bytes()
    finally:
        with pytest.raises(OSError) as e:
            w.close()
    assert size == len(old)
    assert whole == old
    assert e.value.errno == errno.EINVAL  # a third of a file is not rank 0's state
    assert path.read_bytes() == old


def test_readers_see_the_old_or_the_new_version_never_a_mix(cluster):
    lc, co = cluster
    path = lc.mount_dir("h0") / "v" / "ranks" / "0" / "state.safetensors"
    old, version = path.read_bytes(), co.state("v").version
    seen: list[bytes] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(path.read_bytes())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        r = ptcctl(lc.cluster_file, "reconfigure", "v", "--to", "tp=4,pp=1", "--hosts",
                   "h0:2,h1:2")
    finally:
        stop.set()
        for t in threads:
            t.join()
    # a host that missed the commit (a loaded machine: its daemon slow to answer) is
    # rolled forward by the next read of the job's state (the command says so)
    assert co.state("v").version == version + 1
    new = path.read_bytes()
    assert old != new and not errors, (r.stdout, r.stderr, errors,
                                       os.readlink(lc.mount_dir("h0") / "v" / "ranks"))
    assert seen and all(s in (old, new) for s in seen)
    # the logical tensors did not change, whichever host serves them
    name = "embedding.position_embeddings"
    np.testing.assert_array_equal(
        np.load(lc.mount_dir("h1") / "v" / "tensors" / f"{name}.npy"),
        np.load(lc.mount_dir("h0") / "v" / "versions" / "1" / "tensors" / f"{name}.npy"))


def _versions(co: Coordinator, host: str, job: str) -> dict[int, dict]:
    return {v["version"]: v for v in co.cluster.client(host).call("versions", job=job)}


def test_an_open_or_mapped_version_is_kept_until_its_readers_close(cluster):
    """A reader holding a memory map and a reader holding an open file keep
    their version through two reconfigurations (they used to die of SIGBUS
    and ENOENT); status shows it open; it goes once they close."""
    lc, co = cluster
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "p", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "6")
    v1 = lc.mount_dir("h0") / "p" / "versions" / "1"
    name = "embedding.word_embeddings.weight"  # cut between h0's and h1's ranks
    expected = np.load(v1 / "tensors" / f"{name}.npy")
    mapped = np.load(v1 / "tensors" / f"{name}.npy", mmap_mode="r")
    held = open(v1 / "ranks" / "1" / "state.safetensors", "rb")
    try:
        head = held.read(1000)
        for to, hosts in (("tp=1", "h1:1"), ("tp=2", "h0:1,h1:1")):
            ptcctl(cf, "reconfigure", "p", "--to", to, "--hosts", hosts)
        assert co.state("p").version == 3
        assert _versions(co, "h0", "p")[1]["readers"] == 2
        assert 1 in _versions(co, "h1", "p")  # the reader may read h1's pieces
        status = json.loads(ptcctl(cf, "status", "--json").stdout)
        assert status["jobs"]["p"]["open_versions"] == [
            {"version": 1, "readers": {"h0": 2}, "deleting": False}]
        assert "version 1 is open: 2 on h0" in ptcctl(cf, "status").stdout
        np.testing.assert_array_equal(np.array(mapped), expected)
        rest = held.read()
        # a deletion asked for meanwhile (a dataset advance, a repair) waits for them
        assert co.cluster.client("h0").call("delete_version", job="p", version=1) == \
            {"deferred": True}
        assert _versions(co, "h0", "p")[1]["deleting"] is True
    finally:
        held.close()
        del mapped
    whole = (lc.mount_dir("h1") / "p" / "versions" / "1" / "ranks" / "1" /
             "state.safetensors").read_bytes()
    assert head + rest == whole
    deadline = time.monotonic() + 10  # FUSE's release comes after close() returns, and
    # h1's mount tells the close of the file read whole above in its next batch
    while (1 in _versions(co, "h0", "p") or
           _versions(co, "h1", "p")[1].get("readers", 0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 1 not in _versions(co, "h0", "p")
    assert co.prune("p", ["h0", "h1"]) == [1] and 1 not in _versions(co, "h1", "p")


def test_files_opened_one_after_another_cost_the_daemon_no_request_each(cluster):
    """A loader opening and closing the files of one version one after
    another: the daemon holds the version from the first open on, hears
    the counts in batches (not two requests a file), and lets the version
    go once the last file closes."""
    from ptcfs.fuse.pinning import FLUSH_S
    from tests.test_metrics import scrape, total

    lc, co = cluster
    state = co.state("g")
    files = sorted((lc.mount_dir("h0") / "g" / "versions" / str(state.version) /
                    "tensors").glob("*.npy"))
    before = total(scrape(lc, "h0"), "ptcd_requests_total", op="pins")
    n = 200
    with open(files[0], "rb") as held:
        assert _versions(co, "h0", "g")[state.version]["readers"] >= 1  # told before it returned
        start = time.monotonic()
        for i in range(n):
            with open(files[i % len(files)], "rb") as f:
                f.read()
        elapsed = time.monotonic() - start
        assert _wait_readers(co, "g", state.version, 1) == 1
        held.read()
    sent = total(scrape(lc, "h0"), "ptcd_requests_total", op="pins") - before
    print(f"{n} opens in {elapsed:.2f} s: {sent:.0f} pins requests")
    assert sent < n and sent <= 3 + elapsed / FLUSH_S, (sent, elapsed)
    assert _wait_readers(co, "g", state.version, 0) == 0


def _wait_readers(co: Coordinator, job: str, version: int, want: int) -> int:
    """h0's count of open files of ``version``, once it is ``want`` (at most 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        got = _versions(co, "h0", job)[version].get("readers", 0)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _mount_pid(host: str, mnt: Path) -> int:
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"ptcfs.server.mount" in cmd and str(mnt).encode() in cmd:
                return int(p.name)
    raise AssertionError(f"no mount process for {mnt}")


def test_a_killed_mount_is_cleared_at_the_next_start(local_cluster):
    lc = local_cluster(1, mount=True)
    mnt = lc.mount_dir("h0")
    ptcctl(lc.cluster_file, "job", "create", "k", "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "1")
    want = (mnt / "k" / "config.json").read_bytes()
    os.kill(_mount_pid("h0", mnt), signal.SIGKILL)
    with pytest.raises(OSError) as e:
        os.listdir(mnt)
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    lc.kill("h0")
    lc.start("h0")
    assert (mnt / "k" / "config.json").read_bytes() == want


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until ``proc`` writes its ready file (bounded; fails if it exits)."""
    import time

    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
        assert time.monotonic() < deadline, "the mount was not ready in 30 s"
        time.sleep(0.02)


def test_ptcctl_mount_unmounts_cleanly_on_fusermount_and_on_sigterm(local_cluster, tmp_path):
    from ptcfs.server.mount import is_mounted

    lc = local_cluster(1)
    ptcctl(lc.cluster_file, "job", "create", "m", "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "1")
    exe = Path(__import__("sys").executable).with_name("ptcctl")
    mnt = tmp_path / "ptc"
    # the default: files this small are not read into the cache by a background
    # reader, which keeps the mount busy for fusermount3 while it runs
    env = {k: v for k, v in os.environ.items() if k != "PTC_MOUNT_WARM_MIN_BYTES"}
    for how in ("fusermount3", "sigterm"):
        ready = tmp_path / f"{how}.ready"
        proc = subprocess.Popen([str(exe), "mount", str(mnt), "--host-id", "h0",
                                 "--cluster", str(lc.cluster_file), "--ready-file", str(ready)],
                                stderr=subprocess.PIPE, env=env)
        try:
            _wait_for(ready, proc)
            assert json.loads((mnt / "m" / "config.json").read_text())["job"] == "m"
            if how == "fusermount3":
                subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
            else:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert not is_mounted(mnt) and not ready.exists()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def test_a_restarted_daemon_learns_the_open_files_of_a_mount_that_lived_on(local_cluster,
                                                                          tmp_path):
    """A mount of its own (``ptcctl mount``) outlives its daemon: the daemon
    started again hears the versions its open files read within the mount's
    renewal, with no open or close after the restart, so a prune keeps them."""
    from ptcfs.fuse.pinning import RENEW_S

    lc = local_cluster(1)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "r", "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "1")
    exe = Path(__import__("sys").executable).with_name("ptcctl")
    mnt, ready = tmp_path / "ptc", tmp_path / "mount.ready"
    proc = subprocess.Popen([str(exe), "mount", str(mnt), "--host-id", "h0", "--cluster",
                             str(cf), "--ready-file", str(ready)], stderr=subprocess.PIPE)
    co = Coordinator(Cluster.load(cf))
    try:
        _wait_for(ready, proc)
        version = co.state("r").version
        path = next((mnt / "r" / "versions" / str(version) / "tensors").glob("*.npy"))
        with open(path, "rb") as held:
            held.read(6)
            assert _wait_readers(co, "r", version, 1) == 1
            lc.kill("h0", signal.SIGKILL)
            lc.start("h0")
            start = time.monotonic()
            assert _wait_readers(co, "r", version, 1) == 1, "the restarted daemon never heard"
            print(f"heard again {time.monotonic() - start:.2f} s after the start "
                  f"(renewal every {RENEW_S} s)")
            held.read()
        assert _wait_readers(co, "r", version, 0) == 0
    finally:
        co.cluster.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def test_a_job_with_only_a_dataset_shows_its_views(cluster, tmp_path):
    lc, _ = cluster
    tokens = np.arange(40 * 8, dtype=np.int32).reshape(40, 8)
    np.save(tmp_path / "tok.npy", tokens)
    ptcctl(lc.cluster_file, "data", "ingest", "d", str(tmp_path / "tok.npy"), "--format", "npy",
           "--global-batch", "4", "--dp", "2", "--quiet")
    mnt = lc.mount_dir("h1")
    assert "d" in os.listdir(mnt) and os.listdir(mnt / "d") == ["data"]
    a = np.load(mnt / "d" / "data" / "ranks" / "0" / "samples.npy", mmap_mode="r")
    b = np.load(mnt / "d" / "data" / "ranks" / "1" / "samples.npy")
    assert a.shape == b.shape == (20, 8)
    seen = np.concatenate([np.asarray(a), b])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, tokens.tolist()))


def test_a_file_opened_again_while_open_can_be_mapped(cluster, tmp_path):
    """np.load(mmap_mode=) opens a file, then opens it again to map it while
    it holds the first: the second open must not be direct_io, which the
    kernel refuses to map (ENODEV). Every file here is direct at its first
    open (PTC_MOUNT_WARM_MIN_BYTES=1); this one was never read before."""
    import mmap

    lc, _ = cluster
    tokens = np.arange(24 * 8, dtype=np.int32).reshape(24, 8)
    np.save(tmp_path / "tok.npy", tokens)
    ptcctl(lc.cluster_file, "data", "ingest", "mapped", str(tmp_path / "tok.npy"), "--format",
           "npy", "--global-batch", "4", "--dp", "2", "--quiet")
    path = lc.mount_dir("h0") / "mapped" / "data" / "ranks" / "1" / "samples.npy"
    with open(path, "rb") as held:
        assert held.read(6) == b"\x93NUMPY"
        with open(path, "rb") as again:
            m = mmap.mmap(again.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                assert m[:6] == b"\x93NUMPY"
            finally:
                m.close()
    a = np.load(lc.mount_dir("h1") / "mapped" / "data" / "ranks" / "0" / "samples.npy",
                mmap_mode="r")
    assert a.shape == (12, 8)


def test_max_read_leaves_room_to_splice_in_the_pipe(cluster, tmp_path):
    """libfuse splices a reply only through a pipe that holds its bytes, a page
    per piece and three more; a pipe grows to pipe-max-size at most."""
    from ptcfs.fuse.bufvec import KERNEL_MAX_READ, splice_max_read
    from ptcfs.fuse.reading import MAX_PIECES

    limit = tmp_path / "pipe-max-size"
    page = os.sysconf("SC_PAGESIZE")
    for pipe_max in (1 << 20, 1 << 19, 1000000):
        limit.write_text(f"{pipe_max}\n")
        got = splice_max_read(limit)
        assert got is not None and got % page == 0
        assert got + page * (MAX_PIECES + 3) <= pipe_max < got + page * (MAX_PIECES + 4)
    limit.write_text(f"{2 << 20}\n")
    assert splice_max_read(limit) is None  # the kernel's largest read fits
    limit.write_text("not a number")
    assert splice_max_read(limit) == KERNEL_MAX_READ - page * (MAX_PIECES + 3)
    # and the running mounts took it
    lc, _ = cluster
    want = splice_max_read()
    opts = {line.split()[1]: line.split()[3] for line in Path("/proc/mounts").read_text()
            .splitlines()}[str(lc.mount_dir("h0"))]
    assert (f"max_read={want}" in opts) if want else ("max_read" not in opts)


def _log_has(log: Path, line: str) -> bool:
    return line in log.read_text(errors="replace")


def _wait_log(log: Path, line: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _log_has(log, line):
        assert time.monotonic() < deadline, f"{line!r} never appeared in {log}"
        time.sleep(0.05)  # polling a log file: nothing to wait on


def _cache_fillers(mnt: Path) -> list[str]:
    """States (R, S, T, ...) of the processes (cat) reading files of ``mnt``
    into the page cache."""
    prefix = f"{mnt}/".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if args[0].endswith(b"cat") and any(a.startswith(prefix) for a in args):
            out.append(state)
    return out


def test_the_cache_is_filled_only_while_no_file_is_open(cluster):
    """A first read goes around the page cache; the file is read into it in
    the background, but only once no other file is open through the mount."""
    lc, co = cluster
    mnt = lc.mount_dir("h1")
    log = lc.dir / "h1.log"
    v = co.state("v").version
    held = mnt / "v" / "versions" / str(v) / "config.json"
    # a path no other test reads (a slice), so that nothing has cached it yet
    first = f"/v/versions/{v}/tensors/embedding.patch_embeddings.weight.npy[1:3]"
    with open(held, "rb"):
        data = (mnt / first.lstrip("/")).read_bytes()
        _wait_log(log, f"will fill the cache with {first} once no file is open")
        assert not _log_has(log, f"filling the cache with {first}")
        # earlier fillers are paused (T: stopped once their read in flight
        # returns) or done (Z)
        deadline = time.monotonic() + 30
        while not all(s in "TZ" for s in _cache_fillers(mnt)):
            assert time.monotonic() < deadline, _cache_fillers(mnt)
            time.sleep(0.05)  # polling process states: nothing to wait on
    _wait_log(log, f"filling the cache with {first}")
    assert (mnt / first.lstrip("/")).read_bytes() == data


# --- the page cache filled at commit ------------------------------------------------
class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback",
                                                 "nr_evicted", "nr_recently_evicted")]


def _cached_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` read into the page cache, pages of the whole file),
    seen with the kernel's cachestat call (Linux 6.5; the test is skipped
    without). A page read counts whether it is still there or was evicted
    since (memory pressure on a busy machine takes pages read once first);
    a page invalidated or never read counts as neither."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        st = _CacheStat()
        if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(st), 0) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOSYS:
                pytest.skip("this kernel has no cachestat (Linux >= 6.5) to see the page cache")
            raise OSError(err, os.strerror(err), str(path))
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return int(st.nr_cache + st.nr_evicted), -(-size // os.sysconf("SC_PAGESIZE"))


def _wait_warm(co: Coordinator, host: str, job: str) -> dict:
    """The mount's warming state once it has queued the current version of
    ``job`` and read everything queued."""
    version = co.state(job).version
    deadline = time.monotonic() + 60
    while True:
        health, _ = co.cluster.call_all("health", hosts=[host])
        m = health[host]["mount"]
        if m is not None and m["versions"].get(job) == version and not m["warming"]:
            return m
        assert time.monotonic() < deadline, f"{host}'s mount did not warm {job}: {m}"
        time.sleep(0.05)  # polling the daemon's health: nothing to wait on


def _tensor_files(mnt: Path, job: str, version: int) -> list[Path]:
    root = mnt / job / "versions" / str(version) / "tensors"
    return sorted(p for p in root.rglob("*.npy"))


def _mounted_job(local_cluster, monkeypatch, job: str, **env: str):
    """One host with its mount (files of 4 KiB and more are warmed), and
    ``job`` created on it: the cluster and a coordinator."""
    monkeypatch.setenv("PTC_MOUNT_WARM_MIN_BYTES", "4096")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    lc = local_cluster(1, gpus=2, replicas=1, mount=True)
    ptcctl(lc.cluster_file, "job", "create", job, "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "5")
    return lc, Coordinator(Cluster.load(lc.cluster_file))


def test_a_committed_version_is_read_into_the_page_cache(local_cluster, monkeypatch):
    lc, co = _mounted_job(local_cluster, monkeypatch, "w")
    try:
        mnt = lc.mount_dir("h0")
        for version in (1, 2):
            if version == 2:
                ptcctl(lc.cluster_file, "reconfigure", "w", "--to", "tp=2", "--hosts", "h0:2")
            status = _wait_warm(co, "h0", "w")
            files = _tensor_files(mnt, "w", version)
            big = [p for p in files if p.stat().st_size >= 4096]
            assert big and len(big) < len(files)  # the small ones are left to their readers
            # version 2 adds its files to version 1's (still kept) and to the
            # slice read below, which was read into the cache once closed
            assert status["cached_files"] == (len(big) if version == 1 else 2 * len(big) + 1)
            for p in big:
                cached, pages = _cached_pages(p)
                assert cached == pages, p
            # a path nobody has read (the same bytes under a slice) is not cached
            assert _cached_pages(big[0].with_name(big[0].name + "[0:]"))[0] == 0
        assert np.array_equal(np.load(big[0]), np.load(str(big[0]) + "[0:]"))
        shown = json.loads(ptcctl(lc.cluster_file, "status", "--json").stdout)
        assert shown["hosts"]["h0"]["mount"]["versions"] == {"w": 2}
        assert shown["hosts"]["h0"]["mount"]["cached_bytes"] >= status["cached_bytes"]
        text = ptcctl(lc.cluster_file, "status").stdout
        assert "in the page cache" in text
    finally:
        co.cluster.close()


def test_warming_keeps_to_its_budget(local_cluster, monkeypatch):
    lc, co = _mounted_job(local_cluster, monkeypatch, "b", PTC_MOUNT_WARM_BYTES="0")
    try:
        assert _wait_warm(co, "h0", "b")["cached_files"] == 0
        files = sorted(_tensor_files(lc.mount_dir("h0"), "b", 1), key=lambda p: -p.stat().st_size)
        largest = files[0].stat().st_size
        assert largest > files[1].stat().st_size
        assert _cached_pages(files[0])[0] == 0
        # the mount starts again with room for the largest file only
        lc.kill("h0", signal.SIGTERM)
        lc.start("h0", env={"PTC_MOUNT_WARM_BYTES": str(largest)})
        status = _wait_warm(co, "h0", "b")
        assert (status["cached_files"], status["cached_bytes"]) == (1, largest)
        cached, pages = _cached_pages(files[0])
        assert cached == pages
        assert _cached_pages(files[1])[0] == 0
    finally:
        co.cluster.close()


def test_files_with_pieces_on_other_hosts_are_not_read_ahead(cluster):
    lc, co = cluster
    ptcctl(lc.cluster_file, "job", "create", "c", "--model", SMALL, "--config", "tp=2",
           "--hosts", "h0:1,h1:1", "--seed", "7")
    _wait_warm(co, "h0", "c")
    held, _ = co.cluster.call_all("entries", job="c", version=1)
    parts: dict[str, set[tuple[str, str]]] = {}
    for host, entries in held.items():
        for e in entries:
            parts.setdefault(e["tensor"], set()).add((host, e["part"]))
    local = {t for t, ps in parts.items()
             if {p for _, p in ps} <= {p for h, p in ps if h == "h0"}}
    assert local and len(local) < len(parts)
    root = lc.mount_dir("h0") / "c" / "versions" / "1" / "tensors"
    for t in parts:
        cached, pages = _cached_pages(root / f"{t}.npy")
        assert cached == (pages if t in local else 0), t


def test_a_save_the_daemon_refuses_fails_with_its_own_errno(local_cluster):
    """A put the daemon refuses while the mount stores a rank's file gives
    the writer that error's errno (it used to be EIO: the failed put's views
    of the file kept its map from closing, and BufferError hid the error)."""
    lc = local_cluster(1, mount=True)
    ptcctl(lc.cluster_file, "job", "create", "s", "--model", SMALL, "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "8")
    co = Coordinator(Cluster.load(lc.cluster_file))
    try:
        state = co.state("s")
        tensors = {spec.name: np.ascontiguousarray(cut(spec, sl, trained(spec, 3)))
                   for spec, sl in rank_tensors(state.model_spec(), state.config, 0)}
    finally:
        co.cluster.close()
    lc.kill("h0", signal.SIGTERM)  # back with a limit that every put here exceeds
    lc.start("h0", env={"PTC_WIRE_MAX_REQUEST_BYTES": "1024"})
    with pytest.raises(Exception) as e:  # safetensors' error names the OS's
        save_file(tensors, str(lc.mount_dir("h0") / "s" / "ranks" / "0" / "state.safetensors"))
    assert "os error 22" in str(e.value)  # EINVAL: the request is too big


def test_a_padded_view_is_spliced_with_its_zeros(cluster):
    """After a reshard within a host, the embedding of a padded vocabulary
    (1000 rows, padded to 1024) is a view whose padding rows refer to no
    bytes: its file is still answered as ranges of the store file, with
    the padding as zeros, and reads the same as the whole tensor."""
    from ptcfs.fuse.paths import parse_path
    from ptcfs.fuse.reading import FileRange, ReadServer
    from ptcfs.fuse.tree import Catalog
    from ptcfs.store.lmdb_store import LmdbStore

    lc, co = cluster
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "pad", "--model", SMALL, "--config", "tp=2", "--hosts", "h0:2",
           "--seed", "5")
    ptcctl(cf, "reconfigure", "pad", "--to", "tp=1,dp=2", "--hosts", "h0:2")
    name = "embedding.word_embeddings.weight"
    path = f"/pad/ranks/1/{name}.npy"
    data = (lc.mount_dir("h0") / path.lstrip("/")).read_bytes()
    got = np.load(io.BytesIO(data))
    want = np.load(lc.mount_dir("h0") / "pad" / "tensors" / f"{name}.npy")
    assert got.shape[0] == 1024 and want.shape[0] == 1000
    np.testing.assert_array_equal(got[:1000], want)
    assert not got[1000:].any()
    store = LmdbStore(lc.dir / "h0", readonly=True)
    try:
        server = ReadServer(store, "h0", remote=None)  # type: ignore[arg-type]
        item = Catalog(store).resolve(parse_path(path)).item
        pieces = server.pieces(item, 0, item.size)
        assert pieces is not None  # spliced, padding and all
        assert any(isinstance(p, FileRange) for p in pieces)
        assert b"".join(os.pread(p.fd, p.size, p.pos) if isinstance(p, FileRange) else p
                        for p in pieces) == data
        server.close()
    finally:
        store.close()


def test_a_snapshot_that_saw_a_version_staging_never_serves_it(tmp_path):
    """A save opens version 2 and writes it; a reconfiguration takes the
    number (the save is dropped), writes its own bytes and commits. A read
    thread whose snapshot was taken while the save's version 2 was open
    must read the committed bytes, not the save's (the chaos soak saw a
    mount serve a dropped save's step as the committed version, and the
    kernel then kept those pages)."""
    from ptcfs.fuse.reading import FileRange, ReadServer
    from ptcfs.jobstate import SAVE_MARK
    from ptcfs.store.lmdb_store import LmdbStore
    from ptcfs.vfile import StoreRange, VFile

    def fill(version: int, value: float, meta: dict | None = None) -> None:
        store.begin_at("j", version, meta)
        store.put("j", version, "t", "full", np.full(1024, value, np.float32).data, (1024,),
                  "fp32")

    def file(version: int) -> VFile:
        return VFile((StoreRange("j", version, "t", "full", 0, 4096, ("h0",)),))

    store = LmdbStore(tmp_path / "s")
    server = ReadServer(store, "h0", remote=None)  # type: ignore[arg-type]
    try:
        fill(1, 1.0)
        store.commit("j", 1)
        fill(2, 86.0, {SAVE_MARK: True})  # the save's bytes, staging
        # this thread's snapshot is taken now: version 2 is the save's
        assert np.frombuffer(server.read_bytes(file(1), 0, 4096), np.float32)[0] == 1.0
        with pytest.raises(FileNotFoundError):  # staging: not served
            server.read_bytes(file(2), 0, 4096)
        assert server.pieces(file(1), 0, 4096) is not None
        store.abort("j", 2)  # the reconfiguration takes number 2
        fill(2, 85.0)
        store.commit("j", 2)
        for read in (lambda: server.read_bytes(file(2), 0, 4096),
                     lambda: b"".join(os.pread(p.fd, p.size, p.pos) if isinstance(p, FileRange)
                                      else p for p in server.pieces(file(2), 0, 4096) or [])):
            assert set(np.frombuffer(read(), np.float32)) == {85.0}
    finally:
        server.close()
        store.close()


def test_the_catalog_reads_the_records_again_after_any_write(cluster):
    """The mount's catalog keeps each job's committed records until the
    store is written (``changes()``, LMDB's last transaction, which the
    daemon's writes in its own process move): reads in between change
    nothing, and a record changed in place (``job chmod``) shows at once."""
    from ptcfs.fuse.tree import Catalog
    from ptcfs.store.lmdb_store import LmdbStore

    lc, _ = cluster
    store = LmdbStore(lc.dir / "h0", readonly=True)
    try:
        catalog = Catalog(store)
        mark, mode = store.changes(), catalog.access("g")
        assert catalog.committed("g") == catalog.committed("g") and store.changes() == mark
        ptcctl(lc.cluster_file, "job", "chmod", "g", "0600")
        try:
            assert store.changes() != mark
            assert catalog.access("g") == (*mode[:2], 0o600)
        finally:
            ptcctl(lc.cluster_file, "job", "chmod", "g", f"{mode[2]:04o}")
        assert catalog.access("g") == mode
    finally:
        store.close()
