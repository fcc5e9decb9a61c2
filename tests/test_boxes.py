"""Linear byte ranges of C-order arrays as boxes (used by files under /ptc)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ptcfs.boxes import contiguous_range, linear_boxes


@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_linear_boxes_cover_the_range_in_order_with_contiguous_runs(shape, data):
    shape = tuple(shape)
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    a = np.arange(n).reshape(shape)
    got: list[int] = []
    for box in linear_boxes(shape, lo, hi):
        assert contiguous_range(box, shape, 1) is not None  # each box is one run
        got.extend(a[tuple(slice(x, y) for x, y in box)].reshape(-1).tolist())
    assert got == list(range(lo, hi))


def test_linear_boxes_use_few_boxes():
    assert linear_boxes((4, 6), 0, 24) == [((0, 4), (0, 6))]
    assert linear_boxes((4, 6), 3, 21) == [((0, 1), (3, 6)), ((1, 3), (0, 6)), ((3, 4), (0, 3))]
