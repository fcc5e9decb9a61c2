"""The daemon's staging buffers (kept between stages, prepared ahead) and
the zeroing of what no transfer writes."""

from __future__ import annotations

import numpy as np
import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.jobstate import JobState
from ptcfs.server.buffers import BufferPool, keep_bytes, whole_sizes
from ptcfs.server.executor import zero_uncovered
from ptcfs.sharding import parse_config

MIB = 1 << 20


def test_take_gives_the_smallest_kept_buffer_that_fits():
    pool = BufferPool(100 * MIB)
    bufs = [pool.take(n * MIB) for n in (4, 1, 2)]
    assert [b.nbytes for b in bufs] == [4 * MIB, MIB, 2 * MIB]
    for b in bufs:
        pool.give(b)
    assert pool.kept_bytes == 7 * MIB and pool.largest == 4 * MIB
    # several kept arrays of different sizes: taken by identity, never compared by value
    got = pool.take(MIB + 1)
    assert got is bufs[2]
    assert pool.take(3 * MIB) is bufs[0]
    assert pool.take(MIB) is bufs[1]
    fresh = pool.take(MIB)
    assert fresh is not bufs[1] and fresh.nbytes == MIB and pool.kept_bytes == 0


def test_give_keeps_the_biggest_buffers_within_the_limit():
    pool = BufferPool(5 * MIB)
    small, mid, big, huge = (np.empty(n * MIB, np.uint8) for n in (1, 2, 3, 6))
    pool.give(huge)  # over the limit on its own: not kept
    assert pool.kept_bytes == 0
    for b in (small, mid, big):
        pool.give(b)
    assert pool.kept_bytes == 5 * MIB  # big + mid; small dropped to make room
    assert pool.take(MIB) is mid
    assert pool.take(MIB) is big
    assert BufferPool(0).take(10).nbytes == 10


def test_prepare_touches_what_the_next_stage_wants_within_the_limit():
    pool = BufferPool(10 * MIB)
    assert pool.prepare([4 * MIB, 4 * MIB, 4 * MIB, MIB]) == 8 * MIB  # the third is over
    assert sorted(b.nbytes for b in pool._kept) == [4 * MIB, 4 * MIB]
    assert all(not b.any() for b in pool._kept)  # written (touched), with zeros
    assert pool.prepare([4 * MIB, 3 * MIB]) == 0  # kept ones fit already
    assert BufferPool(10 * MIB).prepare([MIB] * 4, stop=lambda: True) == 0


def test_keep_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PTC_STAGE_KEEP_BYTES", "0")
    assert keep_bytes() == 0 and BufferPool().keep_bytes == 0
    monkeypatch.setenv("PTC_STAGE_KEEP_BYTES", "1M")
    assert keep_bytes() == MIB
    for bad in ("-1", "lots", "0x10"):
        monkeypatch.setenv("PTC_STAGE_KEEP_BYTES", bad)
        with pytest.raises(InvalidConfig, match="PTC_STAGE_KEEP_BYTES"):
            keep_bytes()
    monkeypatch.delenv("PTC_STAGE_KEEP_BYTES")
    assert 0 < keep_bytes() <= 2 << 30


def test_zero_uncovered_zeroes_only_the_padding_rows():
    arr = np.full((10, 4), 7.0, dtype=np.float32)
    zero_uncovered(arr, [((0, 3), (0, 4)), ((5, 8), (0, 4))])
    assert (arr[[0, 1, 2, 5, 6, 7]] == 7).all()
    assert (arr[[3, 4, 8, 9]] == 0).all()
    # everything covered: nothing written
    arr = np.full((4, 4), 7.0, dtype=np.float32)
    zero_uncovered(arr, [((0, 4), (0, 2)), ((0, 4), (2, 4))])
    assert (arr == 7).all()
    # a box that does not span whole rows: the whole array is zeroed first
    arr = np.full((4, 4), 7.0, dtype=np.float32)
    zero_uncovered(arr, [((0, 4), (0, 2))])
    assert (arr == 0).all()
    scalar = np.full((), 3.0)
    zero_uncovered(scalar, [])
    assert scalar == 0


def test_whole_sizes_are_the_models_tensors_padded_as_for_tp_1():
    model = "gpt:layers=2,hidden=512,heads=8,vocab=4000,seq=64"
    meta = JobState("j", 3, model, "fp16", "none", parse_config("tp=4,pp=2", "h0:8")).to_meta()
    sizes = whole_sizes(meta)
    spec = JobState.from_meta(meta).model_spec()
    assert len(sizes) == len(spec.tensors_for(2))
    # the vocabulary, 4000 rows, is padded to 4096 (a multiple of 128) at tp=1
    assert max(sizes) == 4096 * 512 * 2
    assert sorted(sizes)[0] == min(t.nbytes for t in spec.tensors_for(2))
    assert whole_sizes({"dataset": "tokens"}) == []
    assert whole_sizes({**meta, "spec": "", "model": "gpt:layers=oops"}) == []
    assert whole_sizes({**meta, "spec": "not a spec"}) == []
