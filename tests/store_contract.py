"""The tensor store contract, written once; every backend's test class inherits it.

A backend's test class provides the ``store`` fixture, built with
``chunk_bytes=StoreContract.CHUNK`` where the backend has chunks (so that
ranges cross several chunk boundaries), and ``reopen(store)``, which closes
the store and opens it again from what it persisted; backends that persist
nothing leave the default, which skips those tests and says why.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import (
    InvalidRequest,
    JobNotFound,
    StoreError,
    TensorNotFound,
    VersionImmutable,
    VersionNotCommitted,
    VersionNotFound,
)
from ptcfs.store.base import Buffer, PutEntry, TensorStore
from ptcfs.types import DTYPE_SIZES, Slice
from tests.store_views import ViewContract

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (37,), (3, 5), (2, 0, 4), (2, 3, 4), (1, 1, 1, 33)]


def values(shape: tuple[int, ...], dtype: str = "fp32", seed: int = 0) -> np.ndarray:
    """Random values of ``shape`` and ``dtype``: random bit patterns, except bool."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(dt)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(dt).reshape(shape)


def put(store: TensorStore, job: str, version: int, tensor: str, a: np.ndarray,
        part: Slice | str = "full", dtype: str = "fp32") -> None:
    store.put(job, version, tensor, part, a, a.shape, dtype)


class StoreContract(ViewContract):
    """What every TensorStore backend must do. Subclasses provide ``store``."""

    CHUNK = 64  # bytes per chunk for backends that chunk: small, so ranges span chunks

    @pytest.fixture
    def store(self) -> TensorStore:
        raise NotImplementedError("a backend's test class provides the store fixture")

    def reopen(self, store: TensorStore) -> TensorStore:
        """Close ``store`` and open what it persisted (skip if it persists nothing)."""
        pytest.skip(f"{type(store).__name__} keeps nothing once closed, by design")

    # --- versions ------------------------------------------------------------
    def test_begin_put_commit(self, store: TensorStore) -> None:
        v = store.begin("job", {"step": 1})
        assert v == 1 and store.current("job") is None
        a = values((10, 30))
        put(store, "job", v, "w", a, Slice.split(0, 0, 2))
        assert [(i.version, i.state) for i in store.versions("job")] == [(1, "staging")]
        store.commit("job", v, {"config": "tp=2"})
        assert store.current("job") == 1
        (info,) = store.versions("job")
        assert (info.job, info.state, info.meta) == ("job", "committed",
                                                     {"step": 1, "config": "tp=2"})
        np.testing.assert_array_equal(store.get("job", 1, "w", "d0.0of2"), a)
        assert store.jobs() == ["job"]
        store.commit("job", v, {"step": 99})  # committing again is a no-op
        assert store.versions("job")[0].meta["step"] == 1

    def test_version_numbers_are_never_reused(self, store: TensorStore) -> None:
        assert [store.begin("j"), store.begin("j")] == [1, 2]
        store.abort("j", 2)
        assert store.begin("j") == 3
        store.begin_at("j", 7)
        assert store.begin("j") == 8
        for v in (1, 3, 7, 8):
            store.abort("j", v)
        assert store.versions("j") == [] and store.jobs() == [] and store.current("j") is None
        assert store.begin("j") == 9

    def test_committed_versions_are_immutable(self, store: TensorStore) -> None:
        v = store.begin("j")
        put(store, "j", v, "w", values((4,)))
        store.commit("j", v)
        for attempt in (lambda: put(store, "j", v, "w", values((4,), seed=1)),
                        lambda: put(store, "j", v, "new", values((4,))),
                        lambda: store.begin_at("j", v),
                        lambda: store.abort("j", v)):
            with pytest.raises(VersionImmutable):
                attempt()
        assert isinstance(VersionImmutable(), PermissionError)
        np.testing.assert_array_equal(store.get("j", v, "w", "full"), values((4,)))
        assert [e.tensor for e in store.entries("j", v)] == ["w"]

    def test_update_meta_changes_every_version_and_nothing_else(self,
                                                               store: TensorStore) -> None:
        v1 = store.begin("j", {"owner": [1, 1], "step": 3})
        put(store, "j", v1, "w", values((4,)))
        store.commit("j", v1)
        v2 = store.begin("j", {"owner": [1, 1]})
        assert store.update_meta("j", {"owner": [2, 3], "mode": 0o600}) == 2
        assert [(v.state, v.meta) for v in store.versions("j")] == [
            ("committed", {"owner": [2, 3], "step": 3, "mode": 0o600}),
            ("staging", {"owner": [2, 3], "mode": 0o600})]
        assert store.current("j") == v1 and v2 == v1 + 1
        np.testing.assert_array_equal(store.get("j", v1, "w", "full"), values((4,)))
        assert store.update_meta("other", {"mode": 0}) == 0

    def test_abort_drops_the_version_and_its_entries(self, store: TensorStore) -> None:
        v1 = store.begin("j")
        put(store, "j", v1, "w", values((300,)))
        store.commit("j", v1)
        v2 = store.begin("j")
        put(store, "j", v2, "w", values((300,), seed=1))
        put(store, "j", v2, "x", values((5,)))
        entries_before = store.stats()["entries"]
        store.abort("j", v2)
        assert [i.version for i in store.versions("j")] == [1]
        assert store.stats()["entries"] == entries_before - 2
        with pytest.raises(VersionNotFound):
            store.get("j", v2, "w", "full")
        np.testing.assert_array_equal(store.get("j", 1, "w", "full"), values((300,)))
        store.abort("j", 99)  # absent: no-op
        store.abort("nobody", 1)

    def test_begin_at_is_idempotent(self, store: TensorStore) -> None:
        store.begin_at("j", 5, {"a": 1})
        put(store, "j", 5, "w", values((3,)))
        store.begin_at("j", 5)
        assert [e.tensor for e in store.entries("j", 5)] == ["w"]
        assert store.versions("j")[0].meta == {"a": 1}
        store.begin_at("j", 5, {"b": 2})  # new metadata replaces the old
        assert [(i.version, i.state, i.meta) for i in store.versions("j")] == [
            (5, "staging", {"b": 2})]
        store.commit("j", 5)
        assert store.current("j") == 5

    def test_current_is_the_latest_committed(self, store: TensorStore) -> None:
        v1, v2 = store.begin("j"), store.begin("j")
        store.commit("j", v2)
        store.commit("j", v1)
        assert store.current("j") == v2
        assert [(i.version, i.state) for i in store.versions("j")] == [
            (1, "committed"), (2, "committed")]

    def test_metadata_must_be_storable(self, store: TensorStore) -> None:
        with pytest.raises(InvalidRequest, match="metadata"):
            store.begin("j", {"bad": object()})
        with pytest.raises(InvalidRequest, match="metadata"):
            store.begin("j", ["not", "a", "dict"])  # type: ignore[arg-type]
        v = store.begin("j", {"config": {"tp": 2, "hosts": [["a", 4]]}, "ring": ("a", "b")})
        assert store.versions("j")[0].meta == {"config": {"tp": 2, "hosts": [["a", 4]]},
                                               "ring": ["a", "b"]}
        assert store.versions("j")[0].version == v

    # --- entries -------------------------------------------------------------
    def test_ranges_across_chunk_boundaries(self, store: TensorStore) -> None:
        n = 5 * self.CHUNK + 17
        a = np.arange(n, dtype=np.uint32).astype(np.uint8)
        v = store.begin("j")
        store.put("j", v, "t", "full", a, a.shape, "uint8")
        c = self.CHUNK
        cuts = sorted({0, 1, c - 1, c, c + 1, 2 * c, 3 * c - 5, n - c, n - 1, n})
        with store.reader() as r:
            for off in cuts:
                for end in (e for e in cuts if e >= off):
                    views = list(r.ranges("j", v, "t", "full", off, end - off))
                    assert all(isinstance(m, memoryview) for m in views)
                    assert b"".join(views) == a[off:end].tobytes(), (off, end)
                    assert r.read("j", v, "t", "full", off, end - off) == a[off:end].tobytes()
            assert r.read("j", v, "t", "full", 2 * c + 3) == a[2 * c + 3:].tobytes()
            assert r.read("j", v, "t", "full") == a.tobytes()

    @pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
    def test_read_array_round_trips(self, store: TensorStore, dtype: str) -> None:
        v = store.begin("j")
        for i, shape in enumerate(SHAPES):
            a = values(shape, dtype, seed=i)
            store.put("j", v, f"t{i}", "full", a, shape, dtype)
        with store.reader() as r:
            for i, shape in enumerate(SHAPES):
                a = values(shape, dtype, seed=i)
                got = r.read_array("j", v, f"t{i}", "full")
                assert (got.shape, got.dtype) == (shape, numpy_dtype(dtype))
                assert got.tobytes() == a.tobytes() and got.flags.writeable
                info = r.info("j", v, f"t{i}", "full")
                assert (info.shape, info.dtype, info.nbytes) == (shape, dtype, a.nbytes)

    def test_put_takes_any_buffer_and_copies_it(self, store: TensorStore) -> None:
        a = values((6, 40), "int16")
        v = store.begin("j")
        strided = a[:, ::2]
        store.put("j", v, "strided", "full", strided, strided.shape, "int16")
        raw = bytearray(a.tobytes())
        buffers: list[tuple[str, Buffer]] = [("bytes", bytes(raw)), ("bytearray", raw),
                                             ("memoryview", memoryview(raw))]
        for name, buf in buffers:
            store.put("j", v, name, "full", buf, a.shape, "int16")
        raw[:] = bytes(len(raw))  # the caller reuses its buffer: the store kept a copy
        for name in ("bytes", "bytearray", "memoryview"):
            np.testing.assert_array_equal(store.get("j", v, name, "full"), a)
        np.testing.assert_array_equal(store.get("j", v, "strided", "full"), strided)

    def test_readers_tell_a_committed_version_from_a_staging_one(self,
                                                                 store: TensorStore) -> None:
        v = store.begin("j")
        put(store, "j", v, "w", values((3,)))
        with store.reader() as r:
            with pytest.raises(VersionNotCommitted, match="staging here, not committed"):
                r.check_committed("j", v)
            with pytest.raises(VersionNotFound):
                r.check_committed("j", v + 1)
            with pytest.raises(JobNotFound):
                r.check_committed("nope", v)
        store.commit("j", v)
        with store.reader() as r:
            r.check_committed("j", v)

    def test_missing_things_raise_not_found(self, store: TensorStore) -> None:
        v = store.begin("j")
        put(store, "j", v, "w", values((3,)))
        cases: list[tuple[type[Exception], tuple[str, int, str]]] = [
            (JobNotFound, ("nope", 1, "w")),
            (VersionNotFound, ("j", v + 1, "w")),
            (TensorNotFound, ("j", v, "nothing")),
        ]
        for kind, (job, version, tensor) in cases:
            assert issubclass(kind, FileNotFoundError)
            with pytest.raises(kind):
                store.get(job, version, tensor, "full")
            with pytest.raises(kind):
                store.info(job, version, tensor, "full")
            with store.reader() as r, pytest.raises(kind):
                r.ranges(job, version, tensor, "full")
        with pytest.raises(TensorNotFound):
            store.info("j", v, "w", "other-part")
        for kind, job, version in [(JobNotFound, "nope", 1), (VersionNotFound, "j", v + 1)]:
            for call in (partial(store.entries, job, version),
                         partial(store.commit, job, version),
                         partial(store.delete_version, job, version),
                         partial(put, store, job, version, "w", values((3,)))):
                with pytest.raises(kind):
                    call()
        assert store.current("nope") is None and store.versions("nope") == []

    def test_bad_puts_are_refused(self, store: TensorStore) -> None:
        v = store.begin("j")
        bad: list[tuple[str, Any, Any, str]] = [
            ("needs 16", values((3,)), (4,), "fp32"),
            ("needs 12", values((4,)), (3,), "fp32"),
            ("unknown dtype", values((4,)), (4,), "fp128"),
            ("negative", b"", (-1, 0), "fp32"),
            ("integers", values((4,)), (4.0,), "fp32"),
            ("contiguous", memoryview(bytes(32))[::2], (4,), "fp32"),
        ]
        for match, data, shape, dtype in bad:
            with pytest.raises(InvalidRequest, match=match):
                store.put("j", v, "w", "full", data, shape, dtype)
        assert store.entries("j", v) == []

    def test_put_many_stores_all_or_none(self, store: TensorStore) -> None:
        v = store.begin("j")
        a, b = values((3, 5)), values((37,), "bf16", seed=1)
        store.put_many("j", v, [PutEntry("w", Slice.split(0, 0, 2), a, a.shape, "fp32"),
                                PutEntry("b", "full", b, b.shape, "bf16")])
        np.testing.assert_array_equal(store.get("j", v, "w", "d0.0of2"), a)
        np.testing.assert_array_equal(store.get("j", v, "b", "full"), b)
        before = store.entries("j", v)
        with pytest.raises(InvalidRequest, match="needs 12"):  # the second is refused
            store.put_many("j", v, [PutEntry("c", "full", a, a.shape, "fp32"),
                                    PutEntry("d", "full", values((4,)), (3,), "fp32")])
        assert store.entries("j", v) == before
        store.commit("j", v)
        with pytest.raises(VersionImmutable):
            store.put_many("j", v, [PutEntry("c", "full", a, a.shape, "fp32")])
        assert store.entries("j", v) == before

    def test_bad_names_are_refused(self, store: TensorStore) -> None:
        v = store.begin("j")
        for name in ("", "a\0b", None, 3):
            with pytest.raises(InvalidRequest):
                store.begin(name)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest):
                store.put("j", v, name, "full", b"", (0,), "uint8")  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest):
                store.put("j", v, "t", name, b"", (0,), "uint8")  # type: ignore[arg-type]
        for version in (-1, True, "1", 1.0):
            with pytest.raises(InvalidRequest):
                store.begin_at("j", version)  # type: ignore[arg-type]
        assert store.entries("j", v) == [] and store.jobs() == ["j"]

    def test_out_of_range_reads_are_refused(self, store: TensorStore) -> None:
        v = store.begin("j")
        store.put("j", v, "t", "full", bytes(100), (100,), "uint8")
        with store.reader() as r:
            for off, n in [(-1, 2), (0, -1), (90, 11), (101, 0), (101, None), (0, 101)]:
                with pytest.raises(InvalidRequest, match="outside"):
                    r.ranges("j", v, "t", "full", off, n)
            assert r.read("j", v, "t", "full", 100, 0) == b""
            assert r.read("j", v, "t", "full", 100) == b""

    def test_empty_entries(self, store: TensorStore) -> None:
        v = store.begin("j")
        store.put("j", v, "e", "full", b"", (0, 8), "fp64")
        with store.reader() as r:
            assert list(r.ranges("j", v, "e", "full")) == []
            assert r.read_array("j", v, "e", "full").shape == (0, 8)

    def test_entries_lists_a_version(self, store: TensorStore) -> None:
        v = store.begin("j")
        names = ["optim/exp_avg/w", "b", "a/b", "a", "\u00e9t\u00e9"]
        for i, name in enumerate(names):
            put(store, "j", v, name, values((i + 1, 2)), Slice.split(1, 1, 2))
            put(store, "j", v, name, values((3,)), "full")
        put(store, "j", v, "a", values((9,), "int8"), "full", "int8")  # replaces an entry
        got = store.entries("j", v)
        assert [(e.tensor, e.part) for e in got] == sorted(
            (n, p) for n in names for p in ("d1.1of2", "full"))
        by_key = {(e.tensor, e.part): e for e in got}
        assert (by_key[("a", "full")].shape, by_key[("a", "full")].dtype,
                by_key[("a", "full")].nbytes) == ((9,), "int8", 9)
        assert by_key[("b", "d1.1of2")].shape == (2, 2)
        assert store.entries("j", store.begin("j")) == []

    def test_delete_version(self, store: TensorStore) -> None:
        for version in (1, 2):
            store.begin_at("j", version)
            put(store, "j", version, "w", values((200,), seed=version))
            store.commit("j", version)
        staging = store.begin("j")
        with pytest.raises(VersionImmutable, match="current"):
            store.delete_version("j", 2)
        with pytest.raises(InvalidRequest, match="abort"):
            store.delete_version("j", staging)
        store.delete_version("j", 1)
        assert [i.version for i in store.versions("j")] == [2, staging]
        with pytest.raises(VersionNotFound):
            store.entries("j", 1)
        with pytest.raises(VersionNotFound):
            store.delete_version("j", 1)
        np.testing.assert_array_equal(store.get("j", 2, "w", "full"), values((200,), seed=2))

    def test_delete_job(self, store: TensorStore) -> None:
        for version in (1, 2):
            store.begin_at("j", version)
            put(store, "j", version, "w", values((300,), seed=version))
            store.commit("j", version)
        store.begin("j")
        put(store, "j", 3, "w", values((300,), seed=3))
        store.begin_at("k", 1)
        put(store, "k", 1, "w", values((10,)))
        store.commit("k", 1)
        assert store.delete_job("j") == 3
        assert store.jobs() == ["k"] and store.versions("j") == [] and store.current("j") is None
        with pytest.raises(JobNotFound):
            store.get("j", 2, "w", "full")
        assert store.delete_job("j") == 0  # unknown: nothing to do
        np.testing.assert_array_equal(store.get("k", 1, "w", "full"), values((10,)))
        store.begin_at("j", 1)  # the name can be used again
        store.commit("j", 1)
        assert store.current("j") == 1

    def test_stats(self, store: TensorStore) -> None:
        empty = store.stats()
        assert (empty["entries"], empty["jobs"], empty["versions"]) == (0, 0, 0)
        for job in ("a", "b"):
            v = store.begin(job)
            put(store, job, v, "w", values((1000,)))
            put(store, job, v, "x", values((10,)))
        s = store.stats()
        assert (s["entries"], s["jobs"], s["versions"]) == (4, 2, 2)
        assert s["bytes_used"] >= 2 * 4040 and s["bytes_used"] > empty["bytes_used"]

    def test_a_reader_is_a_snapshot(self, store: TensorStore) -> None:
        v = store.begin("j")
        put(store, "j", v, "w", values((100,)))
        with store.reader() as r:
            put(store, "j", v, "late", values((100,)))
            store.abort("j", v)
            with pytest.raises(TensorNotFound):
                r.info("j", v, "late", "full")
            assert r.read_array("j", v, "w", "full").tobytes() == values((100,)).tobytes()
        with pytest.raises(VersionNotFound):
            store.info("j", v, "w", "full")

    def test_closed_readers_and_stores_refuse_work(self, store: TensorStore) -> None:
        v = store.begin("j")
        put(store, "j", v, "w", values((3,)))
        with store.reader() as r:
            pass
        with pytest.raises(StoreError, match="closed"):
            r.read("j", v, "w", "full")
        still_open = store.reader()
        store.close()
        with pytest.raises(StoreError, match="closed"):
            still_open.info("j", v, "w", "full")  # type: ignore[attr-defined]
        store.close()  # twice is fine
        for call in (lambda: store.begin("j"), lambda: store.current("j"), store.reader):
            with pytest.raises(StoreError, match="closed"):
                call()

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.differing_executors])
    @given(data=st.data())
    def test_random_puts_read_back(self, store: TensorStore, data: st.DataObject) -> None:
        # one store serves every example; each example writes its own version
        v = store.begin("prop")
        written: dict[tuple[str, str], bytes] = {}
        for _ in range(data.draw(st.integers(1, 6), label="puts")):
            key = (data.draw(st.sampled_from(["a", "b", "optim/m/a"])),
                   data.draw(st.sampled_from(["full", "d0.0of2", "d0.1of2"])))
            payload = data.draw(st.binary(max_size=12 * self.CHUNK), label="payload")
            store.put("prop", v, key[0], key[1], payload, (len(payload),), "uint8")
            written[key] = payload  # a put of an existing key replaces it
        assert [(e.tensor, e.part) for e in store.entries("prop", v)] == sorted(written)
        with store.reader() as r:
            for (tensor, part), payload in written.items():
                assert r.read("prop", v, tensor, part) == payload
                off = data.draw(st.integers(0, len(payload)), label="offset")
                n = data.draw(st.integers(0, len(payload) - off), label="length")
                assert r.read("prop", v, tensor, part, off, n) == payload[off:off + n]
        store.abort("prop", v)

    def test_threads_read_while_a_thread_stages(self, store: TensorStore) -> None:
        old = {f"t{i}": values((50 + 37 * i,), seed=i) for i in range(6)}
        v1 = store.begin("j")
        for name, a in old.items():
            put(store, "j", v1, name, a)
        store.commit("j", v1)
        n_readers, n_new = 3, 12
        errors: list[BaseException] = []
        staging, overlapped, done = threading.Event(), threading.Event(), threading.Event()
        passes = [0] * n_readers

        def write() -> None:
            try:
                v2 = store.begin("j")
                put(store, "j", v2, "n0", values((500,), seed=100))
                staging.set()
                if not overlapped.wait(timeout=30):
                    raise TimeoutError("no reader finished a pass while version 2 was staging")
                for i in range(1, n_new):
                    put(store, "j", v2, f"n{i}", values((500,), seed=100 + i))
                store.commit("j", v2)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
            finally:
                done.set()

        def read(k: int) -> None:
            try:
                while not done.is_set() or passes[k] == 0:
                    was_staging = staging.is_set() and not done.is_set()
                    with store.reader() as r:
                        for name, a in old.items():
                            assert r.read("j", v1, name, "full") == a.tobytes()
                    if store.current("j") == 2:  # a commit is all or nothing
                        assert len(store.entries("j", 2)) == n_new
                    passes[k] += 1
                    if was_staging:
                        overlapped.set()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                overlapped.set()

        threads = [threading.Thread(target=write)]
        threads += [threading.Thread(target=read, args=(k,)) for k in range(n_readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert all(p > 0 for p in passes) and overlapped.is_set()
        assert store.current("j") == 2 and len(store.entries("j", 2)) == n_new
        np.testing.assert_array_equal(store.get("j", 2, "n5", "full"), values((500,), seed=105))

    # --- integrity at rest ---------------------------------------------------
    def test_a_healthy_store_scrubs_clean_step_by_step(self, store: TensorStore) -> None:
        v = store.begin("j")
        for i, shape in enumerate(SHAPES):
            put(store, "j", v, f"t{i}", values(shape, seed=i))
        store.commit("j", v)
        total, after, steps = 0, None, 0
        while True:  # a small budget: many steps, each going on from the last
            found, after, read = store.scrub(after, budget=self.CHUNK)
            assert found == []
            total += read
            steps += 1
            if after is None or steps > 10_000:
                break
        assert after is None and store.damaged() == [] and store.check_file() is None
        assert total in (0, sum(values(s).nbytes for s in SHAPES))  # 0: nothing at rest
        for i, shape in enumerate(SHAPES):
            np.testing.assert_array_equal(store.get("j", v, f"t{i}", "full"),
                                          values(shape, seed=i))

    # --- persistence (backends that keep state once closed) --------------------
    def test_reopen_keeps_versions_and_numbers(self, store: TensorStore) -> None:
        v = store.begin("j", {"step": 3})
        a = values((100, 7))
        put(store, "j", v, "w", a)
        store.commit("j", v)
        staged = store.begin("j")
        put(store, "j", staged, "w", values((5,)))
        store.begin("j")
        store.abort("j", 3)
        again = self.reopen(store)
        assert again.current("j") == 1 and again.jobs() == ["j"]
        assert [(i.version, i.state, i.meta) for i in again.versions("j")] == [
            (1, "committed", {"step": 3}), (2, "staging", {})]
        np.testing.assert_array_equal(again.get("j", 1, "w", "full"), a)
        np.testing.assert_array_equal(again.get("j", 2, "w", "full"), values((5,)))
        assert again.begin("j") == 4
