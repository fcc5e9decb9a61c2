"""Dataset formats and views on real LMDB stores (no daemons): each format is
ingested into two hosts' stores, and every rank's view is read back from
the byte ranges it names and checked against the deal."""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from ptcfs.data import open_source
from ptcfs.data.deal import deal_steps, view_steps
from ptcfs.data.ingest import ingest, plan_chunks
from ptcfs.data.views import data_tree, data_version, load_record
from ptcfs.errors import BadDataset
from ptcfs.store.lmdb_store import LmdbStore
from ptcfs.vfile import StoreRange
from tests.datasets import (
    L,
    StoreSink,
    jsonl_records,
    make_images,
    make_jsonl,
    make_megatron,
    make_npy,
    megatron_docs,
    read_megatron_index,
    read_vfile,
)


@pytest.fixture
def stores(tmp_path):
    s = {h: LmdbStore(tmp_path / "stores" / h, map_size=1 << 30) for h in ("h0", "h1")}
    yield s
    for store in s.values():
        store.close()


def put(stores, src_fmt, path, job="j", step=0, dp=3, batch=12, balance="samples",
        chunk_bytes=200, seed=5, **kw):
    with open_source(src_fmt, path, need_lengths=balance == "tokens", **kw) as src:
        return ingest(src, StoreSink(stores, job), job, seed=seed, global_batch=batch,
                      balance=balance, step=step, dp=dp, chunk_bytes=chunk_bytes)


def expected(rec, tokens=None):
    first, stop = view_steps(rec.count, rec.global_batch, rec.position.step)
    return deal_steps(rec.count, rec.seed, rec.global_batch, first, stop, rec.position.dp,
                      tokens)


def test_plan_chunks_keeps_samples_whole_and_spreads_copies():
    chunks = plan_chunks(np.array([5, 5, 5, 30, 1, 1]), 10, ["a", "b", "c"], 2)
    assert [(c.first, c.stop) for c in chunks] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert [c.hosts for c in chunks] == [("a", "b"), ("b", "c"), ("c", "a"), ("a", "b")]


def test_npy_views(stores, tmp_path):
    arr = make_npy(tmp_path / "t.npy", 30)
    rec = put(stores, "npy", tmp_path / "t.npy", step=1, dp=4)
    assert (rec.count, rec.sample_shape, rec.dtype) == (30, (L,), "<i4")
    assert len(rec.chunks) == 3 and {c.hosts for c in rec.chunks} == {("h0",), ("h1",)}
    tree = data_tree("j", stores["h1"])
    assert tree is not None
    pos = json.loads(read_vfile(tree["position.json"], stores))
    assert (pos["epoch"], pos["step"], pos["offset"], pos["dp"], pos["global_batch"]) == \
        (0, 1, 12, 4, 12)
    for v in expected(rec):
        got = np.load(io.BytesIO(read_vfile(tree[f"ranks/{v.rank}/samples.npy"], stores)))
        np.testing.assert_array_equal(got, arr[v.samples])
        batches = np.load(io.BytesIO(read_vfile(tree[f"ranks/{v.rank}/batches.npy"], stores)))
        assert batches.tolist() == v.counts.tolist() == [3, 3]
    order = np.load(io.BytesIO(read_vfile(tree["epochs/0/order.npy"], stores)))
    assert sorted(order.tolist()) == list(range(30)) and "epochs/1/order.npy" in tree
    # the views point at both hosts' chunks; reading a slice of a file works too
    holders = {seg.hosts for s in ("0", "1", "2", "3")
               for seg in tree[f"ranks/{s}/samples.npy"].segments if isinstance(seg, StoreRange)}
    assert holders == {("h0",), ("h1",)}
    f = tree["ranks/0/samples.npy"]
    assert read_vfile(f, stores, 100, 9) == read_vfile(f, stores)[100:109]


def test_jsonl_views_balanced(stores, tmp_path):
    records = jsonl_records(50)
    make_jsonl(tmp_path / "d.jsonl", records)
    (tmp_path / "d.jsonl").write_bytes((tmp_path / "d.jsonl").read_bytes() + b"\n  \n")
    rec = put(stores, "jsonl", tmp_path / "d.jsonl", balance="tokens", dp=3, batch=10)
    tokens = np.array([r["length"] for r in records])
    tree = data_tree("j", stores["h0"])
    assert tree is not None
    for v in expected(rec, tokens):
        lines = read_vfile(tree[f"ranks/{v.rank}/samples.jsonl"], stores).decode().splitlines()
        assert [json.loads(x) for x in lines] == [records[i] for i in v.samples]


def test_files_views(stores, tmp_path):
    files = make_images(tmp_path / "imgs", 20)
    rec = put(stores, "files", tmp_path / "imgs", dp=2, batch=6, chunk_bytes=100)
    names = sorted(files)
    tree = data_tree("j", stores["h1"])
    assert tree is not None
    for v in expected(rec):
        index = read_vfile(tree[f"ranks/{v.rank}/index.txt"], stores).decode().splitlines()
        assert len(index) == len(v.samples)
        for seq, (line, i) in enumerate(zip(index, v.samples)):
            name, cls, rel = line.split("\t")
            assert rel == names[i] and cls == rel.split("/")[0]
            assert name == f"{seq:06d}.{rel.replace('/', '.')}"
            assert read_vfile(tree[f"ranks/{v.rank}/samples/{name}"], stores) == files[rel]


def test_megatron_views_read_by_an_index_reader(stores, tmp_path):
    docs = megatron_docs(40)
    make_megatron(tmp_path / "m", docs)
    rec = put(stores, "megatron", tmp_path / "m.idx", balance="tokens", dp=4, batch=8,
              step=2)
    tree = data_tree("j", stores["h0"])
    assert tree is not None
    for v in expected(rec, np.array([len(d) for d in docs])):
        dtype, sizes, pointers, doc_idx = read_megatron_index(
            read_vfile(tree[f"ranks/{v.rank}/data.idx"], stores))
        data = read_vfile(tree[f"ranks/{v.rank}/data.bin"], stores)
        assert dtype == np.int32 and doc_idx.tolist() == list(range(len(v.samples) + 1))
        for k, i in enumerate(v.samples):
            got = np.frombuffer(data, dtype, int(sizes[k]), int(pointers[k]))
            np.testing.assert_array_equal(got, docs[i])


def test_sentence_split_megatron_keeps_documents_whole(stores, tmp_path):
    # 3 documents of 2, 1 and 3 sequences: samples are documents
    seqs = [np.full(k, s, dtype=np.uint16) for s, k in enumerate([3, 1, 2, 5, 4, 1])]
    make_megatron(tmp_path / "s", seqs)
    idx = tmp_path / "s.idx"
    raw = bytearray(idx.read_bytes())
    raw[26:34] = struct.pack("<Q", 4)
    idx.write_bytes(bytes(raw[:-7 * 8]) + np.array([0, 2, 3, 6], dtype="<i8").tobytes())
    rec = put(stores, "megatron", tmp_path / "s", dp=1, batch=3)
    assert rec.count == 3 and rec.dtype == "<u2"
    tree = data_tree("j", stores["h0"])
    assert tree is not None
    _, sizes, _, doc_idx = read_megatron_index(read_vfile(tree["ranks/0/data.idx"], stores))
    docs = [[3, 1], [2], [5, 4, 1]]
    order = expected(rec)[0].samples
    assert np.split(sizes, doc_idx[1:-1]) and \
        [s.tolist() for s in np.split(sizes, doc_idx[1:-1])] == [docs[i] for i in order]


def bad_npy(tmp_path: Path) -> Path:
    p = tmp_path / "ragged.npy"
    np.save(p, np.array([[1, 2], [3]], dtype=object), allow_pickle=True)
    return p


def broken_jsonl(tmp_path: Path) -> Path:
    p = tmp_path / "broken.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3,,}\n{"a": 4}\n')
    return p


def dangling_file(tmp_path: Path) -> Path:
    make_images(tmp_path / "imgs", 4)
    os.symlink(tmp_path / "nowhere.png", tmp_path / "imgs" / "cat" / "zzz.png")
    return tmp_path / "imgs"


def truncated_idx(tmp_path: Path) -> Path:
    make_megatron(tmp_path / "m", megatron_docs(10))
    idx = tmp_path / "m.idx"
    idx.write_bytes(idx.read_bytes()[:-20])
    return tmp_path / "m"


@pytest.mark.parametrize("fmt,make,says", [
    ("npy", bad_npy, r"ragged\.npy: not a numeric \.npy array.*ragged"),
    ("jsonl", broken_jsonl, r"broken\.jsonl: line 3: not valid JSON"),
    ("files", dangling_file, r"zzz\.png: cannot read it"),
    ("megatron", truncated_idx, r"m\.idx: truncated in the document indices: record 8 of 11"),
])
def test_bad_input_names_the_file_and_the_record(fmt, make, says, tmp_path, stores):
    with pytest.raises(BadDataset, match=says):
        put(stores, fmt, make(tmp_path))
    assert data_version("j", stores["h0"]) is None


def test_a_failure_while_storing_leaves_nothing_behind(stores, tmp_path):
    files = make_images(tmp_path / "imgs", 30)
    with open_source("files", tmp_path / "imgs") as src:
        (tmp_path / "imgs" / sorted(files)[-1]).unlink()  # vanishes after the listing
        with pytest.raises(BadDataset, match="img029.png: cannot read it"):
            ingest(src, StoreSink(stores, "j"), "j", seed=0, global_batch=4, chunk_bytes=50)
    for s in stores.values():
        assert s.versions("j@data") == [] and "j@data" not in s.jobs()
    assert load_record("j", stores["h0"]) is None and data_tree("j", stores["h1"]) is None


def test_balance_tokens_needs_lengths(stores, tmp_path):
    (tmp_path / "n.jsonl").write_text('{"length": 3}\n{"text": "no length"}\n')
    with pytest.raises(BadDataset, match="line 2: no usable 'length'"):
        put(stores, "jsonl", tmp_path / "n.jsonl", balance="tokens")
    files = make_images(tmp_path / "imgs", 3)
    assert files
    with pytest.raises(ValueError, match="--balance tokens needs a length"):
        put(stores, "files", tmp_path / "imgs", balance="tokens")
