"""The row mapping of torchtitan's composite keys (``ptcfs.dcp.titan``), as
pure functions: a fused ``wqkv`` moment's runs are torchtitan's order of
rows (``qkv_rows_per_group``, which the export's and torchtitan's own
split are checked against in ``tests/test_titan_ckpt.py``), every row has
one source, and split-then-gather gives back the same tensors, for fused
moments and for experts stacked on a leading dimension, whatever chunks a
save cut them into; ``composite_of`` names the stacked experts' keys (the
parameter and its moments) over the job's tensor of each expert."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ptcfs.dcp.titan import Composite, Run, composite_keys, composite_of, fused_runs, split_chunks
from ptcfs.model.modelkit import qkv_rows_per_group
from ptcfs.types import ModelSpec, TensorSpec


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


_S = "layers.1.moe.routed_experts.inner_experts.w1_EFD"


def _moe_spec(experts: int = 3) -> ModelSpec:
    one = [TensorSpec(f"{_S}.{j}", (4, 2), "fp32") for j in range(experts)]
    moments = [TensorSpec(f"optim/{k}/{t.name}", t.shape, "fp32")
               for k in ("exp_avg", "exp_avg_sq") for t in one]
    return ModelSpec("moe", 2, (TensorSpec("norm.weight", (2,), "fp32"), *one, *moments),
                     experts=experts)


def test_composite_of_names_the_stacked_experts_and_their_moments():
    model = _moe_spec()
    for key, base in [(_S, _S), (f"optimizer.state.{_S}.exp_avg", f"optim/exp_avg/{_S}"),
                      (f"state.{_S}.exp_avg_sq", f"optim/exp_avg_sq/{_S}")]:
        comp = composite_of(key, model, "j")
        assert comp is not None and (comp.key, comp.shape, comp.dtype) == (key, (3, 4, 2), "fp32")
        assert comp.runs == tuple(Run(0, f"{base}.{j}", 0, 4, j) for j in range(3))
    for other in ("norm.weight", f"{_S}.0", f"optimizer.state.{_S}.step",
                  "layers.1.moe.routed_experts.inner_experts.w2_EDF"):
        assert composite_of(other, model, "j") is None, other
    # the keys the view serves: each stacked parameter, and the moments of the stepped ones
    names = [t.name for t in model.tensors]
    assert composite_keys([f"optimizer.state.{_S}.step", "train_state.step"], names) == [
        f"optimizer.state.{_S}.exp_avg", f"optimizer.state.{_S}.exp_avg_sq", _S]
