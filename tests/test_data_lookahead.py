"""The look-ahead of a job's data (:mod:`ptcfs.data.lookahead`): the lengths
of the coming steps, per data-parallel rank, equal to what the ranks then
read, step for step, across a change of the data-parallel degree; the same
on every host's mount and through the client."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.datastate import commit_position
from ptcfs.client.control.lookahead import coming_steps
from ptcfs.data.deal import deal_steps
from ptcfs.data.lookahead import lookahead
from ptcfs.data.record import Chunk, DatasetRecord, Position
from tests.datasets import jsonl_records, make_jsonl
from tests.test_cluster import ptcctl

TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,ffn=96"


def _record(count: int, batch: int, seed: int, dp: int, step: int = 0,
            balance: str = "tokens") -> DatasetRecord:
    return DatasetRecord("j", "jsonl", count, 0, seed, batch, balance, 1,
                         (Chunk(0, count, ("h0",)),), Position(step, dp), has_tokens=True)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=8, max_size=60),
       batch=st.integers(1, 16), dp=st.integers(1, 6), seed=st.integers(0, 99),
       step=st.integers(0, 9))
def test_packed_ranks_are_balanced_within_the_longest_sample(lengths, batch, dp, seed, step):
    tokens = np.array(lengths, dtype=np.int64)
    rec = _record(len(lengths), batch, seed, dp, step)
    ahead = lookahead(rec, {"tokens": tokens}, 3)
    views = deal_steps(len(lengths), seed, batch, step, step + 3, dp, tokens)
    for i, s in enumerate(ahead["step_lengths"]):
        totals = [r["total"] for r in s["ranks"]]
        assert s["spread"] == max(totals) - min(totals) <= s["bound"]
        assert sorted(s["lengths"]) == sorted(n for r in s["ranks"] for n in r["lengths"])
        for d, v in enumerate(views):
            assert s["ranks"][d]["samples"] == v.step_samples(step + i).tolist()
    # the global batches do not depend on the degree
    other = lookahead(rec, {"tokens": tokens}, 3, dp=dp + 1)
    assert [s["lengths"] for s in other["step_lengths"]] == \
        [s["lengths"] for s in ahead["step_lengths"]]


def test_without_token_counts_lengths_are_bytes():
    rec = DatasetRecord("j", "files", 4, 10, 0, 2, "samples", 1, (Chunk(0, 4, ("h0",)),))
    ahead = lookahead(rec, {"offsets": np.array([0, 1, 3, 6, 10])}, 2)
    assert ahead["unit"] == "bytes"
    assert sorted(n for s in ahead["step_lengths"] for n in s["lengths"]) == [1, 2, 3, 4]


# --- through the mounts of a real cluster -----------------------------------------------------
@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    from ptcfs.server.testing.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("ahead"))
    try:
        lc.up(3, gpus=2, replicas=1, mount=True)
        yield lc
    finally:
        lc.down()


def _read(lc, job: str, dp: int) -> tuple[list[list[list[int]]], dict]:
    """Every rank's per-step lengths as read from its own samples.jsonl (rank d
    through host d mod 3's mount), and the look-ahead as host h0 shows it."""
    pos = json.loads((lc.mount_dir("h0") / job / "data" / "position.json").read_text())
    first, stop = pos["view_steps"]
    per_rank = []
    for d in range(dp):
        base = lc.mount_dir(f"h{d % 3}") / job / "data" / "ranks" / str(d)
        counts = np.load(base / "batches.npy")
        lines = (base / "samples.jsonl").read_text(encoding="utf-8").splitlines()
        ns = [json.loads(x)["length"] for x in lines]
        bounds = np.concatenate([[0], np.cumsum(counts)])
        per_rank.append([ns[bounds[i]:bounds[i + 1]] for i in range(stop - first)])
    ahead = json.loads((lc.mount_dir("h0") / job / "data" / "lookahead.json").read_text())
    return per_rank, ahead


@pytest.mark.fuse
@pytest.mark.multihost
def test_the_look_ahead_is_what_the_ranks_read_across_a_change_of_dp(mounted, tmp_path):
    lc = mounted
    make_jsonl(tmp_path / "d.jsonl", jsonl_records(60, seed=4))
    ptcctl(lc.cluster_file, "data", "ingest", "la", str(tmp_path / "d.jsonl"), "--format",
           "jsonl", "--global-batch", "8", "--seed", "5", "--balance", "tokens", "--dp", "2",
           "--chunk-bytes", "256")
    cluster = Cluster.load(lc.cluster_file)
    try:
        raw = [(lc.mount_dir(f"h{i}") / "la" / "data" / "lookahead.json").read_bytes()
               for i in range(3)]
        assert raw[0] == raw[1] == raw[2]  # the same on every host
        before = json.loads(raw[0])
        assert before["unit"] == "tokens" and before["dp"] == 2
        assert coming_steps(cluster, "la", before["steps"]) == before
        planned = coming_steps(cluster, "la", 4, dp=3)  # what dp=3 from step 2 would read
        read, ahead = _read(lc, "la", 2)
        assert ahead == before
        for i, s in enumerate(ahead["step_lengths"][:7]):  # the view's steps (60 / 8)
            assert [r["lengths"] for r in s["ranks"]] == [read[d][i] for d in range(2)]
            assert s["spread"] <= s["bound"]
        # the job moves on to step 2 under dp = 3
        commit_position(cluster, "la", 2, 3)
        read, ahead = _read(lc, "la", 3)
        assert ahead["from_step"] == 2 and ahead["dp"] == 3
        for i, s in enumerate(ahead["step_lengths"][:5]):
            assert [r["lengths"] for r in s["ranks"]] == [read[d][i] for d in range(3)]
            # the global batches are those the dp=2 look-ahead foresaw
            assert s["lengths"] == before["step_lengths"][i + 2]["lengths"]
        assert [s["ranks"] for s in planned["step_lengths"][2:]] == \
            [s["ranks"] for s in ahead["step_lengths"][:2]]
        cli = json.loads(ptcctl(lc.cluster_file, "data", "lookahead", "la", "--steps", "16",
                                "--json").stdout)
        assert cli == ahead
        # the mesh chooser groups the coming sequences of the job
        r = ptcctl(lc.cluster_file, "suggest", "--model", TINY_LLAMA, "--hosts", "h0:2",
                   "--global-batch", "8", "--seq", "512", "--device", "h100-sxm",
                   "--seq-lengths", "la", "--lookahead", "4", "--json")
        groups = json.loads(r.stdout)["groups"]
        assert sum(g["sequences"] for g in groups) == 4 * 8
    finally:
        cluster.close()
