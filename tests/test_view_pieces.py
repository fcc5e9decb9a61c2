"""The short ways of making views give what the general ones give:
``one_ref_pieces`` the pieces of ``view_runs`` + ``pack``, and the LMDB
store's ``put_views`` (many views in one transaction) all of them or none."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptcfs.boxes import Box
from ptcfs.errors import InvalidRequest
from ptcfs.store import LmdbStore
from ptcfs.store.views import ViewEntry, ViewRef, one_ref_pieces, pack, view_runs


def _general(shape: tuple[int, ...], itemsize: int, ref: ViewRef,
             source: tuple[tuple[int, ...], int, list[tuple[int, int, int, int, int]]]
             ) -> list[tuple[int, int, int, int, int]]:
    runs = view_runs(shape, itemsize, [ref], lambda _: source, "t")
    return pack(itemsize * math.prod(shape), runs, None)[0]


@st.composite
def _case(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, int, int]:
    sshape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    box = tuple((a, draw(st.integers(a + 1, n)))
                for n in sshape for a in [draw(st.integers(0, n - 1))])
    return sshape, box, draw(st.sampled_from([1, 2, 4])), draw(st.integers(0, 64))


@settings(max_examples=300, deadline=None)
@given(_case())
def test_one_ref_pieces_are_the_general_pieces(case: tuple[tuple[int, ...], Box, int, int]
                                               ) -> None:
    sshape, box, itemsize, off = case
    shape = tuple(b - a for a, b in box)
    nbytes = itemsize * math.prod(sshape)
    source = (sshape, itemsize, [(nbytes, 1, nbytes, 7, off)])
    ref = ViewRef(tuple((0, n) for n in shape), 1, "w", "p", box)
    fast = one_ref_pieces(shape, itemsize, ref, source)
    # one run, or one run per index of the first dimension (the others
    # past the first partial one whole): the short way knows it
    k = len(box)
    while k > 0 and box[k - 1] == (0, sshape[k - 1]):
        k -= 1
    assert (fast is not None) == (k <= 2)
    if fast is not None:
        assert fast == _general(shape, itemsize, ref, source)


@pytest.mark.parametrize("source", [
    ((8, 6), 4, [(192, 1, 192, 3, 0), (0, 1, 0, 4, 0)]),  # two pieces
    ((8, 6), 4, [(96, 2, 100, 3, 0)]),  # strided
    ((8, 6), 4, [(192, 1, 192, -1, 0)]),  # zeros
    ((8, 6), 2, [(96, 1, 96, 3, 0)]),  # another element size
])
def test_one_ref_pieces_leave_the_rest_to_the_general_way(source: tuple) -> None:
    ref = ViewRef(((0, 4), (0, 6)), 1, "w", "p", ((4, 8), (0, 6)))
    assert one_ref_pieces((4, 6), 4, ref, source) is None
    part = ViewRef(((0, 2), (0, 6)), 1, "w", "p", ((4, 6), (0, 6)))  # fills part of it
    assert one_ref_pieces((4, 6), 4, part, ((8, 6), 4, [(192, 1, 192, 3, 0)])) is None


def test_put_views_stores_all_or_none(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    with LmdbStore(tmp_path / "s") as store:
        v1 = store.begin("j")
        store.put("j", v1, "w", "full", a, a.shape, "fp32")
        store.commit("j", v1)
        v2 = store.begin("j")
        rows = [ViewEntry("w", f"r{i}", (4, 8), "fp32", (ViewRef(
            ((0, 4), (0, 8)), v1, "w", "full", ((4 * i, 4 * i + 4), (0, 8))),)) for i in range(4)]
        cols = ViewEntry("w", "c", (16, 4), "fp32",
                         (ViewRef(((0, 16), (0, 4)), v1, "w", "full", ((0, 16), (4, 8))),))
        bad = ViewEntry("w", "bad", (4, 8), "fp32",
                        (ViewRef(((0, 4), (0, 8)), v1, "w", "full", ((14, 18), (0, 8))),))
        with pytest.raises(InvalidRequest):
            store.put_views("j", v2, [*rows, bad])
        assert store.entries("j", v2) == []
        store.put_views("j", v2, [*rows, cols])
        store.commit("j", v2)
        for i in range(4):
            np.testing.assert_array_equal(store.get("j", v2, "w", f"r{i}"), a[4 * i:4 * i + 4])
        np.testing.assert_array_equal(store.get("j", v2, "w", "c"), a[:, 4:])
        assert store.stats()["stored_bytes"] == a.nbytes


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_read_into_of_strided_views_reads_as_ranges(tmp_path_factory: pytest.TempPathFactory,
                                                   data: st.DataObject) -> None:
    """The LMDB reader copies whole runs of a strided piece at once: the bytes
    are those of ``ranges``, at any offset and length, across chunks."""
    rows, cols = data.draw(st.integers(1, 40)), data.draw(st.integers(2, 12))
    a0 = data.draw(st.integers(0, cols - 1))
    a1 = data.draw(st.integers(a0 + 1, cols))
    a = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    chunk = data.draw(st.sampled_from([64, 4096]))
    with LmdbStore(tmp_path_factory.mktemp("s") / "s", chunk_bytes=chunk) as store:
        v1 = store.begin("j")
        store.put("j", v1, "w", "full", a, a.shape, "fp32")
        store.commit("j", v1)
        v2 = store.begin("j")
        store.put_view("j", v2, "w", "c", (rows, a1 - a0), "fp32",
                       [ViewRef(((0, rows), (0, a1 - a0)), v1, "w", "full", ((0, rows), (a0, a1)))])
        want = a[:, a0:a1].tobytes()
        offset = data.draw(st.integers(0, len(want) - 1))
        length = data.draw(st.integers(0, len(want) - offset))
        out = np.zeros(length, np.uint8)
        with store.reader() as r:
            r.read_into("j", v2, "w", "c", offset, out)
        assert out.tobytes() == want[offset:offset + length]
