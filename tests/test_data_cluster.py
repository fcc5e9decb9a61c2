"""Datasets on real daemons: ``ptcctl data``, read positions committed on
every host, and every rank's view read through real mounts with ordinary
readers, across data-parallel changes and epoch boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import commit_position, dataset_record, has_dataset
from tests.datasets import (
    jsonl_records,
    make_images,
    make_jsonl,
    make_megatron,
    make_npy,
    megatron_docs,
    read_megatron_index,
)
from tests.test_cluster import ptcctl

pytestmark = pytest.mark.multihost

TINY = "gpt:layers=1,hidden=16,heads=2,vocab=64,seq=8"


def store_versions(cluster: Cluster, job: str) -> dict[str, list[int]]:
    answers, _ = cluster.call_all("versions", job=f"{job}@data")
    return {h: [v["version"] for v in vs] for h, vs in answers.items()}


def test_ingest_status_seek_and_drop(local_cluster, tmp_path):
    lc = local_cluster(3)
    cf = lc.cluster_file
    make_npy(tmp_path / "t.npy", 100)
    out = json.loads(ptcctl(cf, "data", "ingest", "d", str(tmp_path / "t.npy"), "--format",
                            "npy", "--global-batch", "8", "--seed", "3", "--dp", "2",
                            "--chunk-bytes", "256", "--json").stdout)
    assert (out["samples"], out["bytes"], out["chunks"]) == (100, 1600, 7)
    assert out["position"]["dp"] == 2 and out["position"]["step"] == 0
    cluster = Cluster.load(cf)
    try:
        rec = dataset_record(cluster, "d")
        # the record is on every host; each chunk on `replicas` = 2 of them
        assert all(vs == [1] for vs in store_versions(cluster, "d").values())
        entries, _ = cluster.call_all("entries", job="d@data", version=1)
        for i, c in enumerate(rec.chunks):
            held = {h for h, es in entries.items()
                    if any(e["tensor"] == "chunk" and e["part"] == f"{i:08d}" for e in es)}
            assert held == set(c.hosts) and len(held) == 2
        assert all(sum(e["tensor"] == "index" for e in es) == 2 for es in entries.values())
        r = ptcctl(cf, "data", "ingest", "d", str(tmp_path / "t.npy"), "--format", "npy",
                   check=False)
        assert r.returncode == 1 and "has a dataset already" in r.stderr
        # a seek is a new version on every host; old positions are dropped
        for step in (3, 14, 20):
            ptcctl(cf, "data", "seek", "d", "--step", str(step), "--dp", "3")
        st = json.loads(ptcctl(cf, "data", "status", "d", "--json").stdout)["position"]
        assert (st["epoch"], st["step"], st["offset"], st["dp"]) == (1, 20, 60, 3)
        assert all(vs == [1, 3, 4] for vs in store_versions(cluster, "d").values())
        ptcctl(cf, "data", "drop", "d")
        assert not has_dataset(cluster, "d")
        # nothing is left: no remnant version, no job in any store
        assert all(not jobs for jobs in cluster.call_all("jobs")[0].values())
        assert ptcctl(cf, "data", "status", "d", check=False).returncode == 1
    finally:
        cluster.close()


def _empty_npy() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros((0, 4), dtype=np.int32))
    return buf.getvalue()


@pytest.mark.parametrize("name,content,says", [
    ("bad.jsonl", b'{"a": 1}\n{"a": \n', "bad.jsonl: line 2: not valid JSON"),
    ("bad.npy", b"\x93NUMPY garbage", "bad.npy: "),
    # a 0-row .npy was ingested, and then every host's mount root failed with EIO
    ("empty.npy", _empty_npy(), "empty.npy: the dataset has no samples"),
    ("empty.jsonl", b"", "empty.jsonl: no JSON records in it"),
])
def test_bad_input_is_one_line_and_leaves_nothing(local_cluster, tmp_path, name, content, says):
    lc = local_cluster(2)
    (tmp_path / name).write_bytes(content)
    r = ptcctl(lc.cluster_file, "data", "ingest", "x", str(tmp_path / name), "--format",
               name.split(".")[1], check=False)
    assert r.returncode == 2 and says in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    cluster = Cluster.load(lc.cluster_file)
    try:
        assert store_versions(cluster, "x") == {"h0": [], "h1": []}
    finally:
        cluster.close()


def test_commit_and_reconfigure_move_the_read_position(local_cluster, tmp_path):
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "g", "--model", TINY, "--config", "dp=4",
           "--hosts", "h0:2,h1:2", "--seed", "1")
    make_npy(tmp_path / "t.npy", 30)
    out = json.loads(ptcctl(cf, "data", "ingest", "g", str(tmp_path / "t.npy"), "--format",
                            "npy", "--global-batch", "12", "--json").stdout)
    assert out["position"]["dp"] == 4  # from the job's model state
    r = ptcctl(cf, "data", "seek", "g", "--step", "1", check=False)
    assert r.returncode == 1 and "has model state" in r.stderr
    ptcctl(cf, "reconfigure", "g", "--to", "dp=2", "--hosts", "h0:1,h1:1")
    cluster = Cluster.load(cf)
    try:
        pos = dataset_record(cluster, "g").position
        assert (pos.step, pos.dp) == (0, 2)
    finally:
        cluster.close()


# --- through the mount -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """Three hosts with mounts, one copy of each chunk (so most reads are remote)."""
    from ptcfs.server.testing.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("datamnt"))
    try:
        lc.up(3, gpus=2, replicas=1, mount=True)
        yield lc
    finally:
        lc.down()


def with_model(lc, job: str, dp: int = 4) -> None:
    ptcctl(lc.cluster_file, "job", "create", job, "--model", TINY, "--config", f"dp={dp}",
           "--hosts", "h0:2,h1:2", "--seed", "1")


def rank_dir(lc, job: str, rank: int) -> Path:
    """Rank d reads through host d mod 3's mount."""
    return lc.mount_dir(f"h{rank % 3}") / job / "data" / "ranks" / str(rank)


def step_rows(lc, job: str, rank: int, first: int, step: int) -> np.ndarray:
    d = rank_dir(lc, job, rank)
    counts = np.load(d / "batches.npy")
    rows = np.load(d / "samples.npy", mmap_mode="r")
    at = int(counts[:step - first].sum())
    return np.array(rows[at:at + counts[step - first]])


def run(lc, cluster: Cluster, job: str, plan: dict[int, int], total: int) -> list[np.ndarray]:
    """Train ``total`` steps reading through the mounts, changing dp at the
    steps of ``plan`` and committing a position when a view runs out."""
    seen = []
    step, dp = 0, plan[0]
    commit_position(cluster, job, 0, dp)
    while step < total:
        pos = json.loads((lc.mount_dir("h2") / job / "data" / "position.json").read_text())
        assert (pos["step"], pos["dp"]) == (step, dp)
        first, stop = pos["view_steps"]
        nxt = min([stop, total] + [s for s in plan if s > step])
        for s in range(step, nxt):
            seen.append(np.concatenate([step_rows(lc, job, d, first, s) for d in range(dp)]))
        step, dp = nxt, plan.get(nxt, dp)
        commit_position(cluster, job, step, dp)
    return seen


@pytest.mark.fuse
def test_dp_4_2_3_mid_epoch_and_across_epochs_exactly_once(mounted, tmp_path):
    lc = mounted
    arr = make_npy(tmp_path / "t.npy", 30)
    for job in ("e", "ref"):
        with_model(lc, job)
        ptcctl(lc.cluster_file, "data", "ingest", job, str(tmp_path / "t.npy"), "--format",
               "npy", "--global-batch", "12", "--seed", "9", "--chunk-bytes", "64")
    cluster = Cluster.load(lc.cluster_file)
    try:
        # dp 4 → 2 at step 1 (mid-epoch), → 3 at step 4 (mid-epoch 1, after a
        # batch that straddled epochs 0 and 1), on across epoch 2
        got = run(lc, cluster, "e", {0: 4, 1: 2, 4: 3}, 8)
        want = run(lc, cluster, "ref", {0: 1}, 8)
    finally:
        cluster.close()
    assert [b.tolist() for b in got] == [b.tolist() for b in want]
    ids = np.concatenate(got)[:, 0] // arr.shape[1]
    for e in range(len(ids) // 30):
        assert sorted(ids[e * 30:(e + 1) * 30].tolist()) == list(range(30))
    # the position is now step 8 = sample 96, in epoch 3, whose order the mount shows
    order = np.load(lc.mount_dir("h0") / "ref" / "data" / "epochs" / "3" / "order.npy")
    assert len(ids) == 96 and ids[90:].tolist() == order[:6].tolist()


@pytest.mark.fuse
def test_every_format_through_the_mount_with_ordinary_readers(mounted, tmp_path):
    lc = mounted
    cf = lc.cluster_file
    records = jsonl_records(40)
    make_jsonl(tmp_path / "d.jsonl", records)
    images = make_images(tmp_path / "imgs", 24)
    docs = megatron_docs(40)
    make_megatron(tmp_path / "m", docs)
    arr = make_npy(tmp_path / "t.npy", 40)
    sources = {"fn": ("npy", tmp_path / "t.npy", []),
               "fj": ("jsonl", tmp_path / "d.jsonl", ["--balance", "tokens"]),
               "ff": ("files", tmp_path / "imgs", []),
               "fm": ("megatron", tmp_path / "m", ["--balance", "tokens"])}
    for job, (fmt, src, extra) in sources.items():
        with_model(lc, job, dp=4)
        ptcctl(cf, "data", "ingest", job, str(src), "--format", fmt, "--global-batch", "8",
               "--chunk-bytes", "300", *extra)
    seen: dict[str, list[int]] = {job: [] for job in sources}
    names = sorted(images)
    for d in range(4):
        base = rank_dir(lc, "fn", d)
        seen["fn"] += (np.load(base / "samples.npy", mmap_mode="r")[:, 0] // 4).tolist()
        with open(rank_dir(lc, "fj", d) / "samples.jsonl", encoding="utf-8") as f:
            seen["fj"] += [json.loads(line)["id"] for line in f]
        fdir = rank_dir(lc, "ff", d)
        lines = (fdir / "index.txt").read_text().splitlines()
        listed = sorted(p.name for p in (fdir / "samples").iterdir())
        assert listed == [line.split("\t")[0] for line in lines]  # sorted = consumption order
        for line in lines:
            name, cls, rel = line.split("\t")
            data = (fdir / "samples" / name).read_bytes()
            assert data == images[rel] and cls == rel.split("/")[0]
            seen["ff"].append(names.index(rel))
        mdir = rank_dir(lc, "fm", d)
        dtype, sizes, pointers, doc_idx = read_megatron_index((mdir / "data.idx").read_bytes())
        tokens = np.memmap(mdir / "data.bin", dtype=dtype, mode="r")
        for k in range(len(doc_idx) - 1):
            doc = tokens[pointers[k] // dtype.itemsize:][:sizes[k]]
            assert (doc == doc[0]).all() and len(doc) == len(docs[int(doc[0])])
            seen["fm"].append(int(doc[0]))
    for job, (fmt, _, _) in sources.items():  # B = 8 divides n: the view is one epoch
        n = {"ff": 24}.get(job, 40)
        assert sorted(seen[job]) == list(range(n)), fmt
        pos = json.loads((lc.mount_dir("h1") / job / "data" / "position.json").read_text())
        assert sum(pos["rank_samples"]) == n and pos["view_steps"] == [0, n // 8]
    assert np.load(rank_dir(lc, "fn", 0) / "samples.npy").shape[1:] == arr.shape[1:]


def test_data_is_dealt_to_the_data_parallel_ranks_dp_times_fsdp(local_cluster, tmp_path):
    """cp and tp ranks read their group's view; dp and fsdp ranks read their own."""
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "f", "--model", TINY, "--config", "fsdp=2,cp=2",
           "--hosts", "h0:2,h1:2", "--seed", "1")
    make_npy(tmp_path / "t.npy", 30)
    out = json.loads(ptcctl(cf, "data", "ingest", "f", str(tmp_path / "t.npy"), "--format",
                            "npy", "--global-batch", "12", "--json").stdout)
    assert out["position"]["dp"] == 2
    ptcctl(cf, "reconfigure", "f", "--to", "dp=2,fsdp=2", "--hosts", "h0:2,h1:2")
    cluster = Cluster.load(cf)
    try:
        assert dataset_record(cluster, "f").position.dp == 4
    finally:
        cluster.close()


def test_status_shows_a_dataset_only_job(local_cluster, tmp_path):
    """After an ingest into a job with no model state, `ptcctl status` failed
    with KeyError('config')."""
    lc = local_cluster(1)
    cf = lc.cluster_file
    make_npy(tmp_path / "t.npy", 30)
    ptcctl(cf, "data", "ingest", "d", str(tmp_path / "t.npy"), "--format", "npy",
           "--global-batch", "6")
    out = json.loads(ptcctl(cf, "status", "--json").stdout)
    assert out["jobs"]["d"]["dataset"]["samples"] == 30
    assert "version" not in out["jobs"]["d"]
    text = ptcctl(cf, "status").stdout
    assert "dataset: 30 npy samples" in text


def test_a_reconfiguration_never_moves_the_read_position_back(local_cluster, tmp_path):
    """`data seek --step 5 --force` on a job whose model is at step 0, then
    `reconfigure`: the position went back to step 0 without a word."""
    lc = local_cluster(2)
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "g", "--model", TINY, "--config", "dp=2",
           "--hosts", "h0:1,h1:1", "--seed", "1")
    make_npy(tmp_path / "t.npy", 30)
    ptcctl(cf, "data", "ingest", "g", str(tmp_path / "t.npy"), "--format", "npy",
           "--global-batch", "6")
    ptcctl(cf, "data", "seek", "g", "--step", "5", "--force")
    ptcctl(cf, "reconfigure", "g", "--to", "dp=1", "--hosts", "h1:1")
    cluster = Cluster.load(cf)
    try:
        pos = dataset_record(cluster, "g").position
        assert (pos.step, pos.dp) == (5, 1)  # re-dealt to dp=1 where it was
        # a save committed at a step before the read position is refused unless --force
        from ptcfs.client.control.coordinator import Coordinator
        from ptcfs.client.control.saving import begin_save
        from ptcfs.client.torch.state import load_rank, put_rank

        co = Coordinator(cluster)
        st = co.state("g")
        version = begin_save(co, "g")
        put_rank(cluster, st, version, 0, load_rank(cluster, "g", 0, device="cpu").tensors)
        r = ptcctl(cf, "commit", "g", "--step", "3", check=False)
        assert r.returncode == 1 and "read up to step 5; going back to step 3" in r.stderr
        assert co.state("g").step == 0
        assert dataset_record(cluster, "g").position.step == 5
        ptcctl(cf, "commit", "g", "--step", "3", "--force")
        assert co.state("g").step == 3 and dataset_record(cluster, "g").position.step == 3
    finally:
        cluster.close()
