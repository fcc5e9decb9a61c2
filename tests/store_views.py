"""The store contract for views (``put_view``): every backend's test class
inherits it through :class:`tests.store_contract.StoreContract`."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptcfs.boxes import Box
from ptcfs.errors import InvalidRequest, TensorNotFound
from ptcfs.store.base import ZERO_FD, TensorStore
from ptcfs.store.views import ViewRef


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 30, size=shape, dtype=np.int32).view(np.float32)


def _ix(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _committed(store: TensorStore, arrays: dict[str, np.ndarray], job: str = "j") -> int:
    v = store.begin(job)
    for name, a in arrays.items():
        store.put(job, v, name, "full", a, a.shape, "fp32")
    store.commit(job, v)
    return v


def _same_file_bytes(store: TensorStore, job: str, v: int, name: str, want: np.ndarray) -> None:
    """file_ranges, where a backend gives them, point at the entry's bytes."""
    with store.reader() as r:
        where = r.file_ranges(job, v, name, "full")
        if where is None:
            return
        got = b"".join(bytes(n) if fd == ZERO_FD else os.pread(fd, n, off)
                       for fd, off, n in where)
    assert got == want.tobytes()


class ViewContract:
    """Views read the same bytes as copies, and share chunks safely."""

    CASES = [  # source shape, source box, destination shape, destination box
        ((40, 6), ((10, 30), (0, 6)), (20, 6), ((0, 20), (0, 6))),  # a row split
        ((40, 6), ((0, 40), (2, 5)), (40, 3), ((0, 40), (0, 3))),  # a column split
        ((4, 10, 3), ((1, 3), (2, 9), (0, 3)), (5, 7, 3), ((2, 4), (0, 7), (0, 3))),
        ((33,), ((5, 30),), (30,), ((1, 26),)),
        ((), (), (), ()),
    ]

    @pytest.mark.parametrize("case", range(len(CASES)))
    @pytest.mark.parametrize("with_data", [True, False])
    def test_a_view_reads_as_a_copy(self, store: TensorStore, case: int,
                                    with_data: bool) -> None:
        sshape, sbox, dshape, dbox = self.CASES[case]
        src = _values(sshape, 1)
        v1 = _committed(store, {"w": src})
        want = _values(dshape, 2) if with_data else np.zeros(dshape, np.float32)
        want[_ix(dbox)] = src[_ix(sbox)]
        v2 = store.begin("j")
        store.put_view("j", v2, "w", "full", dshape, "fp32", [ViewRef(dbox, v1, "w", "full", sbox)],
                       want.copy() if with_data else None)
        store.commit("j", v2)
        np.testing.assert_array_equal(store.get("j", v2, "w", "full"), want)
        with store.reader() as r:  # any range, across chunks and pieces
            raw = want.tobytes()
            for off in range(0, len(raw), 7):
                assert r.read("j", v2, "w", "full", off, min(13, len(raw) - off)) == \
                    raw[off:off + 13]
        _same_file_bytes(store, "j", v2, "w", want)
        assert store.info("j", v2, "w", "full").shape == dshape

    def test_a_view_of_views_and_merges(self, store: TensorStore) -> None:
        full = _values((12, 8), 3)
        v1 = store.begin("j")
        for i in range(2):  # tp=2 by columns
            store.put("j", v1, "w", f"c{i}", full[:, 4 * i:4 * i + 4].copy(), (12, 4), "fp32")
        store.commit("j", v1)
        v2 = store.begin("j")  # tp=4
        for i in range(4):
            store.put_view("j", v2, "w", f"c{i}", (12, 2), "fp32",
                           [ViewRef(((0, 12), (0, 2)), v1, "w", f"c{i // 2}",
                                    ((0, 12), (2 * (i % 2), 2 * (i % 2) + 2)))])
        store.commit("j", v2)
        v3 = store.begin("j")  # back to one, merged out of the views
        store.put_view("j", v3, "w", "full", (12, 8), "fp32",
                       [ViewRef(((0, 12), (2 * i, 2 * i + 2)), v2, "w", f"c{i}",
                                ((0, 12), (0, 2))) for i in range(4)])
        store.commit("j", v3)
        for i in range(4):
            np.testing.assert_array_equal(store.get("j", v2, "w", f"c{i}"),
                                          full[:, 2 * i:2 * i + 2])
        store.delete_version("j", v1)
        store.delete_version("j", v2)
        np.testing.assert_array_equal(store.get("j", v3, "w", "full"), full)
        _same_file_bytes(store, "j", v3, "w", full)

    @pytest.mark.parametrize("with_data", [True, False])
    def test_a_merge_of_rows_reads_whole_and_in_any_range(self, store: TensorStore,
                                                          with_data: bool) -> None:
        """A tp=2 shard merged out of a tp=4 shard held here (a view: one
        piece per row) and one fetched (the bytes given), or out of two
        views with zeros between them: ``read_into`` reads it as a copy,
        whole (one strided copy per source) and from any offset."""
        full = _values((40, 9), 4)
        v1 = _committed(store, {"w": full})
        want = np.zeros_like(full)
        refs = [ViewRef(((0, 40), (0, 4)), v1, "w", "full", ((0, 40), (0, 4)))]
        if with_data:
            want[:, :8] = full[:, :8]
        else:
            refs.append(ViewRef(((0, 40), (5, 9)), v1, "w", "full", ((0, 40), (5, 9))))
            want[:, :4], want[:, 5:] = full[:, :4], full[:, 5:]
        v2 = store.begin("j")
        store.put_view("j", v2, "w", "m", (40, 9), "fp32", refs,
                       want.copy() if with_data else None)
        store.commit("j", v2)
        raw = want.tobytes()
        with store.reader() as r:
            for off, n in ((0, len(raw)), (36, len(raw) - 36), (5, 700), (len(raw) - 50, 50)):
                out = np.empty(n, np.uint8)
                r.read_into("j", v2, "w", "m", off, out)
                assert out.tobytes() == raw[off:off + n], (off, n)
        store.delete_version("j", v1)
        np.testing.assert_array_equal(store.get("j", v2, "w", "m"), want)

    def test_a_pruned_version_leaves_its_referrers_whole(self, store: TensorStore) -> None:
        src = _values((64, 5), 4)
        v1 = _committed(store, {"w": src})
        v2 = store.begin("j")
        store.put_view("j", v2, "w", "full", (32, 5), "fp32",
                       [ViewRef(((0, 32), (0, 5)), v1, "w", "full", ((32, 64), (0, 5)))])
        store.commit("j", v2)
        shared = store.stats()
        assert shared["stored_bytes"] == src.nbytes
        assert shared["referenced_bytes"] == src.nbytes // 2
        store.delete_version("j", v1)
        np.testing.assert_array_equal(store.get("j", v2, "w", "full"), src[32:])
        assert store.stats()["stored_bytes"] == src.nbytes  # still referred to
        np.testing.assert_array_equal(store.get("j", v2, "w", "full"), src[32:])
        v3 = _committed(store, {"w": _values((3,), 5)})
        store.delete_version("j", v2)  # the last referrer goes: so do the chunks
        assert store.stats()["stored_bytes"] == 12 and store.current("j") == v3

    def test_an_aborted_view_leaves_nothing(self, store: TensorStore) -> None:
        src = _values((50, 4), 6)
        v1 = _committed(store, {"w": src})
        before = store.stats()
        v2 = store.begin("j")
        data = _values((50, 4), 7)
        store.put_view("j", v2, "w", "full", (50, 4), "fp32",
                       [ViewRef(((0, 25), (0, 4)), v1, "w", "full", ((25, 50), (0, 4)))], data)
        assert store.stats()["stored_bytes"] == before["stored_bytes"] + data.nbytes // 2
        store.abort("j", v2)  # as the coordinator does after a crash before the commit
        after = store.stats()
        assert (after["stored_bytes"], after["referenced_bytes"], after["entries"]) == \
            (before["stored_bytes"], before["referenced_bytes"], before["entries"])
        v3 = _committed(store, {"x": _values((1,), 8)})
        store.delete_version("j", v1)
        assert store.stats()["stored_bytes"] == 4 and store.current("j") == v3

    def test_entries_say_which_were_put_whole(self, store: TensorStore) -> None:
        """A put's entry has the time it was written; a view (a copy a stage
        made) has none, and each replaces the other."""
        src = _values((8, 2), 3)
        v1 = _committed(store, {"w": src})
        v2 = store.begin("j")
        before = time.time()
        store.put("j", v2, "w", "full", src, src.shape, "fp32")
        store.put_view("j", v2, "c", "full", (8, 2), "fp32",
                       [ViewRef(((0, 8), (0, 2)), v1, "w", "full", ((0, 8), (0, 2)))])
        written = {e.tensor: e.written for e in store.entries("j", v2)}
        assert written["c"] is None and written["w"] is not None
        assert before - 1 <= written["w"] <= time.time() + 1
        store.put("j", v2, "c", "full", src, src.shape, "fp32")
        store.put_view("j", v2, "w", "full", (8, 2), "fp32",
                       [ViewRef(((0, 8), (0, 2)), v1, "w", "full", ((0, 8), (0, 2)))])
        written = {e.tensor: e.written for e in store.entries("j", v2)}
        assert written["c"] is not None and written["w"] is None

    def test_delete_job_and_replacing_a_view_free_shared_chunks(self, store: TensorStore) -> None:
        src = _values((16, 4), 9)
        v1 = _committed(store, {"w": src})
        v2 = store.begin("j")
        ref = ViewRef(((0, 16), (0, 4)), v1, "w", "full", ((0, 16), (0, 4)))
        store.put_view("j", v2, "w", "full", (16, 4), "fp32", [ref])
        store.put_view("j", v2, "w", "full", (16, 4), "fp32", [ref])  # replaces it
        store.put("j", v2, "w2", "full", src, src.shape, "fp32")
        assert store.stats()["stored_bytes"] == 2 * src.nbytes
        assert store.stats()["referenced_bytes"] == src.nbytes
        store.commit("j", v2)
        assert store.delete_job("j") == 2
        assert (store.stats()["stored_bytes"], store.stats()["referenced_bytes"]) == (0, 0)

    def test_bad_views_are_refused(self, store: TensorStore) -> None:
        v1 = _committed(store, {"w": _values((8, 2), 10)})
        v2 = store.begin("j")
        whole = ((0, 8), (0, 2))
        with pytest.raises(InvalidRequest, match="overlap"):
            store.put_view("j", v2, "w", "full", (8, 2), "fp32",
                           [ViewRef(((0, 5), (0, 2)), v1, "w", "full", ((0, 5), (0, 2))),
                            ViewRef(((4, 8), (0, 2)), v1, "w", "full", ((4, 8), (0, 2)))])
        with pytest.raises(InvalidRequest, match="extents"):
            store.put_view("j", v2, "w", "full", (8, 2), "fp32",
                           [ViewRef(whole, v1, "w", "full", ((0, 4), (0, 2)))])
        with pytest.raises(InvalidRequest, match="outside"):
            store.put_view("j", v2, "w", "full", (4, 2), "fp32",
                           [ViewRef(whole, v1, "w", "full", whole)])
        with pytest.raises(InvalidRequest, match="element size"):
            store.put_view("j", v2, "w", "full", (8, 2), "fp16",
                           [ViewRef(whole, v1, "w", "full", whole)])
        with pytest.raises(InvalidRequest, match="earlier"):
            store.put_view("j", v2, "w", "full", (8, 2), "fp32",
                           [ViewRef(whole, v2, "w", "full", whole)])
        with pytest.raises(TensorNotFound):
            store.put_view("j", v2, "w", "full", (8, 2), "fp32",
                           [ViewRef(whole, v1, "nope", "full", whole)])
        assert store.entries("j", v2) == []

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.differing_executors, HealthCheck.too_slow])
    @given(data=st.data())
    def test_random_boxes(self, store: TensorStore, data: st.DataObject) -> None:
        shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        src = _values(shape, data.draw(st.integers(0, 99)))
        v1 = _committed(store, {"w": src}, job="r")
        box = tuple((a, data.draw(st.integers(a + 1, n)))
                    for n in shape for a in [data.draw(st.integers(0, n - 1))])
        v2 = store.begin("r")
        sub = tuple(b - a for a, b in box)
        store.put_view("r", v2, "w", "full", sub, "fp32",
                       [ViewRef(tuple((0, n) for n in sub), v1, "w", "full", box)])
        store.commit("r", v2)
        v3 = store.begin("r")  # back into a tensor of the source's shape
        store.put_view("r", v3, "w", "full", shape, "fp32",
                       [ViewRef(box, v2, "w", "full", tuple((0, n) for n in sub))])
        store.commit("r", v3)
        want = np.zeros(shape, np.float32)
        want[_ix(box)] = src[_ix(box)]
        np.testing.assert_array_equal(store.get("r", v3, "w", "full"), want)
        store.delete_job("r")
