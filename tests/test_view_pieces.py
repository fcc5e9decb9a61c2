"""The short ways of making views give what the general ones give:
``one_ref_pieces`` and ``merge_pieces`` the pieces of ``view_runs`` + ``pack`` (whose pieces
give back every byte of their runs), and the LMDB
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
from ptcfs.store import LmdbStore, boxes
from ptcfs.store.views import (
    ZEROS,
    ViewEntry,
    ViewRef,
    merge_pieces,
    one_ref_pieces,
    pack,
    spans,
    starts,
    view_runs,
)


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


Source = tuple[tuple[int, ...], int, list[tuple[int, int, int, int, int]]]


def _general_all(shape: tuple[int, ...], itemsize: int, refs: list[ViewRef],
                 sources: list[Source]) -> list[tuple[int, int, int, int, int]]:
    by_part = {r.part: src for r, src in zip(refs, sources)}
    runs = view_runs(shape, itemsize, refs, lambda r: by_part[r.part], "t")
    return pack(itemsize * math.prod(shape), runs, None)[0]


@st.composite
def _merge(draw: st.DrawFn) -> tuple[tuple[int, ...], int, list[ViewRef], list[Source]]:
    """Shards merged side by side along dimension k: each block the whole
    of its source in the other dimensions, from any stretch of it along k."""
    shape = list(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    k = draw(st.integers(0, len(shape) - 1))
    widths = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
    shape[k] = sum(widths)
    itemsize = draw(st.sampled_from([1, 2, 4]))
    refs, sources, at = [], [], 0
    order = draw(st.permutations(range(len(widths))))  # refs in any order
    for j, w in enumerate(widths):
        a = draw(st.integers(0, 3))
        sshape = tuple(shape[:k]) + (a + w + draw(st.integers(0, 3)),) + tuple(shape[k + 1:])
        nbytes = itemsize * math.prod(sshape)
        sources.append((sshape, itemsize, [(nbytes, 1, nbytes, 10 + order[j],
                                            draw(st.integers(0, 99)))]))
        dst = tuple((at, at + w) if d == k else (0, n) for d, n in enumerate(shape))
        box = tuple((a, a + w) if d == k else (0, n) for d, n in enumerate(sshape))
        refs.append(ViewRef(dst, 1, "w", f"p{j}", box))
        at += w
    perm = [order.index(i) for i in range(len(order))]
    return tuple(shape), itemsize, [refs[i] for i in perm], [sources[i] for i in perm]


@settings(max_examples=200, deadline=None)
@given(_merge())
def test_merge_pieces_are_the_general_pieces(case: tuple) -> None:
    shape, itemsize, refs, sources = case
    fast = merge_pieces(shape, itemsize, refs, sources)
    assert fast is not None
    assert fast == _general_all(shape, itemsize, refs, sources)
    assert all(type(x) is int for p in fast for x in p)


def test_merge_pieces_leave_the_rest_to_the_general_way() -> None:
    """Anything but distinct one-stretch sources tiling one dimension whole,
    each taken whole in the others: None (the general way decides)."""
    src = ((4, 3), 4, [(48, 1, 48, 3, 0)])
    other = ((4, 3), 4, [(48, 1, 48, 5, 0)])
    left = ViewRef(((0, 4), (0, 3)), 1, "w", "a", ((0, 4), (0, 3)))
    right = ViewRef(((0, 4), (3, 6)), 1, "w", "b", ((0, 4), (0, 3)))
    assert merge_pieces((4, 6), 4, [left, right], [src, other]) is not None
    cases = [
        ([left, right], [src, src]),  # one blob twice: its runs may join
        ([left, ViewRef(((0, 4), (4, 6)), 1, "w", "b", ((0, 4), (0, 2)))], [src, other]),  # gap
        ([left, ViewRef(((0, 2), (3, 6)), 1, "w", "b", ((0, 2), (0, 3)))], [src, other]),  # rows
        ([left, ViewRef(((0, 4), (3, 6)), 1, "w", "b", ((0, 4), (1, 4)))], [src, other]),  # out
        ([left, right], [src, ((4, 3), 4, [(24, 1, 24, 5, 0), (24, 1, 24, 6, 0)])]),  # 2 pieces
        ([left, right], [src, ((4, 3), 4, [(48, 1, 48, ZEROS, 0)])]),  # zeros
        ([left, right], [src, ((4, 3), 2, [(24, 1, 24, 5, 0)])]),  # another element size
        ([left], [src]),  # one ref: one_ref_pieces' case
    ]
    for refs, sources in cases:
        assert merge_pieces((4, 6), 4, refs, sources) is None, (refs, sources)


@st.composite
def _runs(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int, int]]]:
    """An entry's size and runs of blobs in it, with gaps: rows of one to
    three sources each (a merge), runs of one size and stride or not."""
    rows, period = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    size = draw(st.integers(1, 9))
    gap = draw(st.sampled_from([0, 0, 3]))
    blobs = draw(st.lists(st.integers(0, 2), min_size=period, max_size=period))
    step = draw(st.sampled_from([size, size + 5, 2 * size]))
    runs, pos = [], 0
    for r in range(rows):
        for j, blob in enumerate(blobs):
            runs.append((pos, blob, 100 * j + r * step, size))
            pos += size
        pos += gap
    return pos + draw(st.integers(0, 4)), runs


@settings(max_examples=300, deadline=None)
@given(_runs())
def test_pack_gives_back_every_byte_in_few_pieces(case: tuple[int, list[tuple[int, ...]]]
                                                  ) -> None:
    nbytes, runs = case
    arrays = tuple(np.array([r[i] for r in runs], dtype=np.int64).reshape(-1) for i in range(4))
    pieces = pack(nbytes, arrays, None)[0]  # type: ignore[arg-type]
    assert all(type(x) is int for p in pieces for x in p)
    want = [(ZEROS, 0)] * nbytes  # (blob, offset) of each byte; the gaps are zeros
    for pos, blob, off, size in runs:
        for k in range(size):
            want[pos + k] = (blob, off + k)
    got = [(blob, 0 if blob == ZEROS else at + k)
           for blob, at, size in spans(pieces, starts(pieces), 0, nbytes) for k in range(size)]
    assert got == want
    # runs continuing one another join, runs at one stride make one piece
    assert len(pieces) <= len(runs) + len([1 for a, b in zip(runs, runs[1:])
                                           if b[0] > a[0] + a[3]]) + 1


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


def _committed(store: LmdbStore, a: np.ndarray) -> int:
    """A committed version of job ``j`` holding ``a`` as ``w [full]``."""
    v = store.begin("j")
    store.put("j", v, "w", "full", a, a.shape, "fp32")
    store.commit("j", v)
    return v


def test_put_views_stores_all_or_none(tmp_path: Path) -> None:
    a = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    with LmdbStore(tmp_path / "s") as store:
        v1 = _committed(store, a)
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


def _read_merged(path: Path, rows: int, widths: list[int], pad: int, chunk: int,
                 offset: int, length: int, jump: bool = False) -> None:
    """Sources of ``widths`` columns merged side by side, then ``pad`` columns
    no source fills, read with ``read_into`` at ``offset`` for ``length``
    bytes. ``jump``: the first source is itself a view of two stretches of
    rows of one stored entry, apart (its rows' offsets step, then jump)."""
    cols = sum(widths) + pad
    want = np.zeros((rows, cols), np.float32)
    with LmdbStore(path, chunk_bytes=chunk) as store:
        v1 = store.begin("j")
        srcs = []
        for k, w in enumerate(widths):
            src = np.arange(rows * w, dtype=np.float32).reshape(rows, w) + 1000 * (k + 1)
            store.put("j", v1, "w", f"s{k}", src, src.shape, "fp32")
            srcs.append(src)
        if jump:
            tall = np.arange(3 * rows * widths[0], dtype=np.float32).reshape(3 * rows, -1) - 500
            store.put("j", v1, "w", "tall", tall, tall.shape, "fp32")
        store.commit("j", v1)
        v_src = v1
        if jump:  # s0 again, as rows [0, h) and [2*rows, 2*rows + rows - h) of "tall"
            h = rows // 2
            v_src = store.begin("j")
            w = widths[0]
            store.put_view("j", v_src, "w", "s0", (rows, w), "fp32", [
                ViewRef(((0, h), (0, w)), v1, "w", "tall", ((0, h), (0, w))),
                ViewRef(((h, rows), (0, w)), v1, "w", "tall", ((2 * rows, 3 * rows - h), (0, w)))])
            for k in range(1, len(widths)):
                store.put_view("j", v_src, "w", f"s{k}", srcs[k].shape, "fp32", [ViewRef(
                    ((0, rows), (0, widths[k])), v1, "w", f"s{k}", ((0, rows), (0, widths[k])))])
            store.commit("j", v_src)
            srcs[0] = np.concatenate([tall[:h], tall[2 * rows:3 * rows - h]])
        refs, at = [], 0
        for k, w in enumerate(widths):
            want[:, at:at + w] = srcs[k]
            refs.append(ViewRef(((0, rows), (at, at + w)), v_src, "w", f"s{k}",
                                ((0, rows), (0, w))))
            at += w
        v2 = store.begin("j")
        store.put_view("j", v2, "w", "m", (rows, cols), "fp32", refs)
        whole = want.tobytes()
        out = np.full(length, 7, np.uint8)
        with store.reader() as r:
            r.read_into("j", v2, "w", "m", offset, out)
        assert out.tobytes() == whole[offset:offset + length]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_read_into_of_merged_views_reads_their_sources(tmp_path_factory: pytest.TempPathFactory,
                                                       data: st.DataObject) -> None:
    """A merge along the last dimension (one piece per source per row, read
    as interleaved blocks: one strided copy per source) reads the sources'
    bytes side by side, the columns no source fills as zeros, at any offset
    and length, across chunks."""
    rows = data.draw(st.integers(1, 40))
    widths = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=4))
    pad = data.draw(st.sampled_from([0, 0, 3]))
    chunk = data.draw(st.sampled_from([64, 4096]))
    nbytes = 4 * rows * (sum(widths) + pad)
    offset = data.draw(st.integers(0, nbytes - 1))
    length = data.draw(st.integers(0, nbytes - offset))
    _read_merged(tmp_path_factory.mktemp("s") / "s", rows, widths, pad, chunk, offset, length,
                 data.draw(st.booleans()))


@pytest.mark.parametrize("widths, chunk, jump", [
    ([1, 1], 64, False),  # each source's runs cross its chunks: blocks end at them
    ([1, 2, 1], 4096, True),  # a source's rows jump in its blob: a block ends there
    ([3, 2], 4096, False),  # one block of every row
])
def test_read_into_of_merged_views_at_block_edges(tmp_path: Path, widths: list[int], chunk: int,
                                                  jump: bool) -> None:
    rows = 40
    nbytes = 4 * rows * sum(widths)
    _read_merged(tmp_path / "s", rows, widths, 0, chunk, 0, nbytes, jump)


def test_gathered_hands_many_runs_on_as_one_copy(tmp_path: Path) -> None:
    """A range of few runs comes as the store's own buffers; one of many
    runs (a column-split view: a run per row) as one copy of them, the
    same bytes at any offset and length."""
    a = np.random.default_rng(1).standard_normal((64, 12)).astype(np.float32)
    with LmdbStore(tmp_path / "s") as store:
        v1 = _committed(store, a)
        v2 = store.begin("j")
        store.put_views("j", v2, [ViewEntry("w", "c", (64, 4), "fp32", (
            ViewRef(((0, 64), (0, 4)), v1, "w", "full", ((0, 64), (8, 12))),))])
        store.commit("j", v2)
        want = np.ascontiguousarray(a[:, 8:12]).tobytes()
        with store.reader() as r:
            plain = r.gathered("j", v1, "w", "full", 0, a.nbytes)
            assert len(plain) == 1 and plain[0].readonly and bytes(plain[0]) == a.tobytes()
            for offset, length in [(0, len(want)), (6, 300), (17, 1), (100, 0)]:
                runs = list(r.ranges("j", v2, "w", "c", offset, length))
                got = r.gathered("j", v2, "w", "c", offset, length)
                assert b"".join(bytes(g) for g in got) == want[offset:offset + length]
                if len(runs) > 16:
                    assert len(got) == 1 and not got[0].readonly  # the copy
                else:
                    assert [bytes(g) for g in got] == [bytes(v) for v in runs]
            assert len(r.gathered("j", v2, "w", "c", 0, len(want), most=64)) == 64


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_boxes_of_merged_views_read_as_numpy(tmp_path_factory: pytest.TempPathFactory,
                                            data: st.DataObject) -> None:
    """A box of a view merged side by side (a run per source per row), as
    migrations and the mount cut them: gathered in one copy of its range, or
    (past GATHER_BYTES) halved until it is, the bytes numpy cuts."""
    rows, cols = data.draw(st.integers(1, 40)), data.draw(st.integers(2, 12))
    split = data.draw(st.integers(1, cols - 1))
    a = np.random.default_rng(rows * cols).integers(0, 1 << 31, (rows, cols),
                                                    dtype=np.int32).view(np.float32)
    with LmdbStore(tmp_path_factory.mktemp("s") / "s",
                   chunk_bytes=data.draw(st.sampled_from([64, 4096]))) as store:
        v1 = store.begin("j")
        for name, part in (("l", a[:, :split]), ("r", a[:, split:])):
            store.put("j", v1, "w", name, np.ascontiguousarray(part), part.shape, "fp32")
        store.commit("j", v1)
        v2 = store.begin("j")
        store.put_view("j", v2, "w", "m", a.shape, "fp32", [
            ViewRef(((0, rows), (0, split)), v1, "w", "l", ((0, rows), (0, split))),
            ViewRef(((0, rows), (split, cols)), v1, "w", "r", ((0, rows), (0, cols - split)))])
        store.commit("j", v2)
        box = tuple(sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
                    for n in a.shape)
        want = a[box[0][0]:box[0][1], box[1][0]:box[1][1]]
        with store.reader() as r:
            for limit in (boxes.GATHER_BYTES, 64):
                out = np.full(want.nbytes, 7, np.uint8)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(boxes, "GATHER_BYTES", limit)
                    boxes.gather_box(r, ("j", v2, "w", "m"), a.shape, 4, box, out)
                assert out.tobytes() == want.tobytes(), (box, limit)
