"""The seeded order, the deal to data-parallel ranks, and run files: pure
functions, with property tests for exactly-once under any dp changes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptcfs.data.deal import balanced_ranks, deal_steps, even_bounds, view_steps
from ptcfs.data.order import epoch_order, stream_samples
from ptcfs.data.runs import RunFile, merge_runs
from ptcfs.errors import InvalidRequest
from ptcfs.vfile import Literal, StoreRange


def test_order_is_pinned_forever():
    # the order is part of the on-disk contract: a change here re-deals every
    # running job's remaining samples
    assert epoch_order(10, 0, 0).tolist() == PINNED_0_0
    assert epoch_order(10, 0, 1).tolist() != PINNED_0_0
    assert epoch_order(10, 1, 0).tolist() != PINNED_0_0


PINNED_0_0 = [4, 8, 0, 1, 7, 6, 2, 5, 3, 9]


@given(st.integers(1, 300), st.integers(0, 2**64 - 1), st.integers(0, 50))
@settings(max_examples=60, deadline=None)
def test_every_epoch_is_a_permutation(n, seed, epoch):
    order = epoch_order(n, seed, epoch)
    assert sorted(order.tolist()) == list(range(n))
    assert not order.flags.writeable


def test_the_stream_is_the_epochs_back_to_back():
    n, seed = 7, 3
    want = np.concatenate([epoch_order(n, seed, e) for e in range(4)])
    for a, b in [(0, 28), (5, 9), (6, 8), (13, 27), (3, 3)]:
        assert stream_samples(n, seed, a, b).tolist() == want[a:b].tolist()


@pytest.mark.parametrize("batch,dp,sizes", [(12, 4, [3, 3, 3, 3]), (12, 5, [3, 3, 2, 2, 2]),
                                            (12, 3, [4, 4, 4]), (3, 5, [1, 1, 1, 0, 0]),
                                            (13, 2, [7, 6])])
def test_even_deal_first_ranks_take_one_more(batch, dp, sizes):
    assert np.diff(even_bounds(batch, dp)).tolist() == sizes


def test_balanced_deal_spreads_long_samples():
    tokens = np.array([100, 1, 1, 1, 100, 1, 1, 1])
    ranks = balanced_ranks(tokens, 2)
    loads = [int(tokens[ranks == d].sum()) for d in range(2)]
    assert loads == [103, 103]
    assert ranks[0] != ranks[4]
    # ties between equal ranks go to the lower rank, longest sample first
    assert balanced_ranks(np.array([5, 5, 5]), 3).tolist() == [0, 1, 2]


def test_view_ends_with_the_last_batch_that_starts_in_the_epoch():
    assert view_steps(30, 12, 0) == (0, 3)   # step 2 is samples 24..35, into epoch 1
    assert view_steps(30, 12, 3) == (3, 5)   # epoch 1 starts at sample 36 = offset 6
    assert view_steps(5, 12, 0) == (0, 1)    # one batch spans several epochs
    assert view_steps(12, 12, 1) == (1, 2)


def test_deal_refuses_nonsense():
    with pytest.raises(InvalidRequest):
        deal_steps(10, 0, 4, 0, 2, 0)
    with pytest.raises(InvalidRequest):
        deal_steps(10, 0, 4, 3, 2, 1)


def simulate(n: int, seed: int, batch: int, changes: list[tuple[int, int]], total: int,
             tokens: np.ndarray | None) -> list[list[np.ndarray]]:
    """A job that reads its ranks' views and commits a position at every
    change of dp and whenever a view runs out: per step, each rank's part."""
    dp_at = dict(changes)
    step, dp = 0, dp_at.get(0, 1)
    seen: list[list[np.ndarray]] = []
    while step < total:
        first, stop = view_steps(n, batch, step)
        views = deal_steps(n, seed, batch, first, stop, dp, tokens)
        assert [v.rank for v in views] == list(range(dp))
        nxt = min([stop, total] + [s for s in dp_at if s > step])
        for s in range(step, nxt):
            seen.append([v.step_samples(s) for v in views])
        step = nxt
        dp = dp_at.get(step, dp)
    return seen


def is_subsequence(part: list[int], whole: list[int]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


@st.composite
def runs_of_a_job(draw):
    n = draw(st.integers(1, 60))
    batch = draw(st.integers(1, 24))
    total = draw(st.integers(1, 3 * -(-n // batch) + 2))  # across a few epoch boundaries
    steps = sorted(draw(st.sets(st.integers(0, total - 1), max_size=6)))
    changes = [(s, draw(st.integers(1, 9))) for s in steps]
    return n, draw(st.integers(0, 2**32)), batch, changes, total


@given(runs_of_a_job(), st.booleans(), st.integers(0, 1000))
@settings(max_examples=150, deadline=None)
def test_any_dp_changes_see_the_same_batches_each_sample_once(job, balanced, tok_seed):
    n, seed, batch, changes, total = job
    tokens = np.random.default_rng(tok_seed).integers(0, 50, n) if balanced else None
    seen = simulate(n, seed, batch, changes, total, tokens)
    stream = stream_samples(n, seed, 0, total * batch).reshape(total, batch)
    for s, parts in enumerate(seen):
        got = np.concatenate(parts)
        if tokens is None:  # contiguous parts in rank order: the batch itself
            assert got.tolist() == stream[s].tolist()
            sizes = [len(p) for p in parts]
            assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
        else:  # the same samples; each rank's part keeps the batch's order
            assert sorted(got.tolist()) == sorted(stream[s].tolist())
            for p in parts:
                assert is_subsequence(p.tolist(), stream[s].tolist())
    # exactly once: what the job saw is the stream's samples, no more, no less,
    # and every whole epoch of the stream is each sample once
    flat = np.concatenate([np.concatenate(p) for p in seen])
    assert sorted(flat.tolist()) == sorted(stream.reshape(-1).tolist())
    for e in range(total * batch // n):
        assert sorted(stream.reshape(-1)[e * n:(e + 1) * n].tolist()) == list(range(n))
    # and the batches do not depend on the configuration at all
    assert [sorted(np.concatenate(p).tolist()) for p in seen] == \
        [sorted(np.concatenate(p).tolist()) for p in simulate(n, seed, batch, [], total, tokens)]


def test_balancing_evens_out_a_skewed_batch():
    rng = np.random.default_rng(0)
    n, batch, dp = 4096, 64, 8
    tokens = np.where(rng.random(n) < 0.05, 4000, rng.integers(50, 500, n))

    def imbalance(tok: np.ndarray | None) -> tuple[float, float]:
        """Mean over steps of max/mean tokens per rank, and of its lower bound
        (no rank can hold less than the batch's longest sample)."""
        views = deal_steps(n, 1, batch, 0, n // batch, dp, tok)
        per = np.array([[tokens[v.step_samples(s)].sum() for v in views]
                        for s in range(n // batch)])
        longest = np.array([max(tokens[v.step_samples(s)].max() for v in views)
                            for s in range(n // batch)])
        mean = per.mean(axis=1)
        return float((per.max(axis=1) / mean).mean()), \
            float((np.maximum(longest, mean) / mean).mean())

    (even, bound), (balanced, _) = imbalance(None), imbalance(tokens)
    assert balanced < 1.02 * bound and even > 1.5


def test_merge_runs_joins_only_adjacent_runs_of_one_chunk():
    c, o, n = merge_runs(np.array([0, 0, 0, 1, 1, 0]), np.array([0, 4, 11, 4, 8, 14]),
                         np.array([4, 6, 2, 4, 0, 1]))
    assert (c.tolist(), o.tolist(), n.tolist()) == ([0, 0, 1, 0], [0, 11, 4, 14], [10, 2, 4, 1])


def test_run_file_spans_match_its_segments():
    hosts = (("h0",), ("h1", "h0"))
    f = RunFile(b"HEAD", "j@data", 1, "chunk", ("a", "b"), hosts, np.array([1, 0, 1]),
                np.array([10, 0, 0]), np.array([5, 3, 2]))
    assert f.size == 14 and f.runs == 3
    assert f.segments == (Literal(b"HEAD"), StoreRange("j@data", 1, "chunk", "b", 10, 5, hosts[1]),
                          StoreRange("j@data", 1, "chunk", "a", 0, 3, hosts[0]),
                          StoreRange("j@data", 1, "chunk", "b", 0, 2, hosts[1]))
    got = [(s.data if isinstance(s, Literal) else (s.part, s.offset), at, n)
           for s, at, n in f.spans(2, 9)]
    assert got == [(b"HEAD", 2, 2), (("b", 10), 0, 5), (("a", 0), 0, 2)]
    assert list(f.spans(14, 5)) == [] and list(f.spans(13, 100))[0][1:] == (1, 1)
