"""Checksums at rest in the LMDB store: damaged chunks found by a scrub and
their entries quarantined, and data files refused before LMDB maps them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ptcfs.errors import StoreDamaged, TensorNotFound
from ptcfs.store import LmdbStore
from ptcfs.store.integrity import check_data_file
from ptcfs.store.views import ViewRef
from tests.store_contract import values

CHUNK = 4096


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LmdbStore]:
    s = LmdbStore(tmp_path / "store", chunk_bytes=CHUNK)
    yield s
    s.close()


def _flip(store: LmdbStore, job: str, version: int, tensor: str, part: str, at: int) -> None:
    """Flip a byte of an entry where it lies in the data file, as damage at rest would."""
    with store.reader() as r:
        where = r.file_range(next(r.ranges(job, version, tensor, part, at, 1)))
    assert where is not None
    with open(store.path / "data.mdb", "r+b") as f:
        f.seek(where[1])
        old = f.read(1)
        f.seek(where[1])
        f.write(bytes([old[0] ^ 0x5A]))


def _scrub_all(store: LmdbStore) -> list:
    out, after = [], None
    while True:
        found, after, _ = store.scrub(after, budget=3 * CHUNK)
        out += found
        if after is None:
            return out


def test_a_flipped_byte_quarantines_its_entry_and_views_of_it(store: LmdbStore) -> None:
    v = store.begin("j")
    big, small = values((5000,), seed=1), values((10,), seed=2)
    store.put("j", v, "w", "0:5000", big, big.shape, "fp32")
    store.put("j", v, "b", "all", small, small.shape, "fp32")
    store.commit("j", v)
    v2 = store.begin("j")  # a later version shares w's bytes (a view)
    store.put_view("j", v2, "w", "0:2500", (2500,), "fp32",
                   [ViewRef(((0, 2500),), v, "w", "0:5000", ((0, 2500),))])
    store.commit("j", v2)
    assert _scrub_all(store) == []
    _flip(store, "j", v, "w", "0:5000", 4 * 1500)  # in w's second chunk, inside the view
    found = _scrub_all(store)
    assert sorted((d.job, d.version, d.tensor, d.part, d.chunk) for d in found) == [
        ("j", 1, "w", "0:5000", 1), ("j", 2, "w", "0:2500", 1)]
    assert set(store.damaged()) == set(found)
    # never served again; the rest is whole
    with pytest.raises(TensorNotFound):
        store.get("j", v, "w", "0:5000")
    with pytest.raises(TensorNotFound):
        store.get("j", v2, "w", "0:2500")
    np.testing.assert_array_equal(store.get("j", v, "b", "all"), small)
    assert store.stats()["damaged"] == 2 and store.stats()["stored_bytes"] == small.nbytes
    assert _scrub_all(store) == []  # the damaged bytes went with their last entry
    # a repaired copy is written again; dropping the version drops its record
    store.commit("j", store.begin("j"))
    store.delete_version("j", v)
    assert [d.version for d in store.damaged()] == [2]


def test_a_views_own_bytes_are_checked_too(store: LmdbStore) -> None:
    v = store.begin("j")
    a = values((1000,), seed=3)
    store.put("j", v, "w", "0:1000", a, a.shape, "fp32")
    store.commit("j", v)
    v2 = store.begin("j")
    whole = values((3000,), seed=4)  # its first 1000 from w, the rest its own bytes
    store.put_view("j", v2, "w", "0:3000", (3000,), "fp32",
                   [ViewRef(((0, 1000),), v, "w", "0:1000", ((0, 1000),))], whole)
    store.commit("j", v2)
    _flip(store, "j", v2, "w", "0:3000", 4 * 2500)
    assert [(d.version, d.tensor, d.part) for d in _scrub_all(store)] == [(2, "w", "0:3000")]
    np.testing.assert_array_equal(store.get("j", v, "w", "0:1000"), a)


def test_a_truncated_data_file_is_refused_before_lmdb_maps_it(tmp_path: Path) -> None:
    s = LmdbStore(tmp_path / "s", chunk_bytes=CHUNK)
    v = s.begin("j")
    a = values((20000,))
    s.put("j", v, "w", "all", a, a.shape, "fp32")
    s.commit("j", v)
    used = s.stats()["bytes_used"]
    s.close()
    os.truncate(tmp_path / "s" / "data.mdb", used // 2)
    with pytest.raises(StoreDamaged, match="was cut short: it holds"):
        LmdbStore(tmp_path / "s")
    with pytest.raises(StoreDamaged, match="cut short"):
        LmdbStore(tmp_path / "s", readonly=True)


def test_a_data_file_that_is_not_lmdbs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "data.mdb").write_bytes(b"not a store" * 1000)
    with pytest.raises(StoreDamaged, match="not an LMDB data file"):
        LmdbStore(tmp_path / "s")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "data.mdb").write_bytes(b"")
    check_data_file(tmp_path / "e" / "data.mdb")  # an empty file: a new store


def test_a_store_keeps_its_id_and_knows_when_it_was_made(tmp_path: Path) -> None:
    s = LmdbStore(tmp_path / "s")
    first, made = s.store_id, s.created
    s.close()
    s = LmdbStore(tmp_path / "s")
    try:
        assert made and not s.created and s.store_id == first and len(first or "") == 32
        assert LmdbStore(tmp_path / "t").store_id != first
    finally:
        s.close()


def test_a_data_file_deleted_under_the_store_is_named(store: LmdbStore) -> None:
    assert store.check_file() is None
    (store.path / "data.mdb").unlink()
    problem = store.check_file()
    assert problem is not None and "was deleted" in problem
    assert store.stats()["bytes_used"] > 0  # the file in use still answers
