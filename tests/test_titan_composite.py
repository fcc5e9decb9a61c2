"""The row mapping of torchtitan's composite keys (``ptcfs.dcp.titan``), as
pure functions: a fused ``wqkv`` moment's runs are torchtitan's order of
rows (``qkv_rows_per_group``, which the export's and torchtitan's own
split are checked against in ``tests/test_titan_ckpt.py``), every row has
one source, and split-then-gather gives back the same tensors, for fused
moments and for experts stacked on a leading dimension, whatever chunks a
save cut them into."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ptcfs.dcp.titan import Composite, Run, fused_runs, split_chunks
from ptcfs.model.modelkit import qkv_rows_per_group


@st.composite
def _heads(draw: st.DrawFn) -> tuple[int, int, int]:
    kv = draw(st.integers(1, 4))
    return kv * draw(st.integers(1, 4)), kv, draw(st.integers(1, 5))


def _cuts(draw: st.DrawFn, n: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True))
    return sorted({0, n, *(c for c in inner if c < n)})


@settings(max_examples=60, deadline=None)
@given(_heads(), st.data())
def test_fused_runs_are_torchtitans_rows_and_split_gives_the_parts_back(hkd, data):
    heads, kv, hd = hkd
    q, k = heads * hd, kv * hd
    grouped = np.arange((q + 2 * k) * 3).reshape(-1, 3)
    parts = {"q": grouped[:q], "k": grouped[q:q + k], "v": grouped[q + k:]}
    fused = grouped[qkv_rows_per_group(heads, kv, hd)]
    runs = fused_runs([("q", q), ("k", k), ("v", k)], heads, kv)
    assert [r.at for r in runs] == list(np.cumsum([0] + [r.n for r in runs]))[:-1]
    for r in runs:
        np.testing.assert_array_equal(fused[r.at:r.at + r.n], parts[r.name][r.lo:r.lo + r.n])
    cuts = _cuts(data.draw, q + 2 * k)
    comp = Composite("x", fused.shape, "fp32", runs)
    split = split_chunks(comp, [(((a, b), (0, 3)), fused[a:b]) for a, b in zip(cuts, cuts[1:])])
    for name, pieces in split.items():
        back = np.full_like(parts[name], -1)
        for ((a, b), _), arr in pieces:
            assert (back[a:b] == -1).all(), name  # one source for every row
            back[a:b] = arr
        np.testing.assert_array_equal(back, parts[name])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.data())
def test_stacked_experts_split_into_their_experts(experts, rows, data):
    stacked = np.arange(experts * rows * 2).reshape(experts, rows, 2)
    comp = Composite("w1", stacked.shape, "fp32",
                     tuple(Run(0, f"w1.{j}", 0, rows, j) for j in range(experts)))
    ecuts, rcuts = _cuts(data.draw, experts), _cuts(data.draw, rows)
    saved = [(((e0, e1), (r0, r1), (0, 2)), stacked[e0:e1, r0:r1])
             for e0, e1 in zip(ecuts, ecuts[1:]) for r0, r1 in zip(rcuts, rcuts[1:])]
    split = split_chunks(comp, saved)
    for j in range(experts):
        back = np.full((rows, 2), -1)
        for ((a, b), _), arr in split[f"w1.{j}"]:
            back[a:b] = arr
        np.testing.assert_array_equal(back, stacked[j])
