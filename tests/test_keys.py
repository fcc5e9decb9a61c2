"""Client keys apart from the daemons' key, and per-job writers: a client key
not among a job's writers reads the job but cannot change it, through
ptcctl or a raw request; ``ptcctl job allow`` lets it; a rotated key stops
working at the next connection."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ptcfs.errors import NotAllowed
from ptcfs.server.net.keys import load_keys
from tests.daemons import client, running
from tests.test_cluster import SMALL, checksums, ptcctl

pytestmark = pytest.mark.multihost

#: a refused handshake gets no answer: give up on it quickly
QUICK = {"PTC_CALL_TIMEOUT_S": "3", "PTC_PING_TIMEOUT_S": "0.5", "PTC_PEER_SILENCE_S": "0.5"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with running(tmp_path_factory.mktemp("keys"), 2, gpus=1, replicas=1) as lc:
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "j", "--model", SMALL, "--config", "tp=2",
               "--hosts", "h0:1,h1:1")
        ptcctl(cf, "keys", "new", "bob")
        yield lc


def as_key(monkeypatch, key: str, **extra: str) -> None:
    monkeypatch.setenv("PTC_CLIENT_KEY", key)
    for k, v in extra.items():
        monkeypatch.setenv(k, v)


def test_keys_are_listed_and_the_creator_is_the_writer(pair):
    listed = json.loads(ptcctl(pair.cluster_file, "keys", "list", "--json").stdout)
    assert sorted(k["name"] for k in listed["keys"]) == ["bob", "client"]
    out = json.loads(ptcctl(pair.cluster_file, "job", "chmod", "j", "0640", "--json").stdout)
    assert out["writers"] == ["client"]
    r = ptcctl(pair.cluster_file, "keys", "new", "bob", check=False)
    assert r.returncode == 2 and "exists" in r.stderr


def test_a_key_not_allowed_reads_but_cannot_change(pair, monkeypatch):
    cf = pair.cluster_file
    before = checksums(cf, "j")
    as_key(monkeypatch, "bob")
    assert checksums(cf, "j") == before  # reads are open to every known key
    for args in (("reconfigure", "j", "--to", "tp=1,dp=2", "--hosts", "h0:1,h1:1"),
                 ("commit", "j", "--step", "3"), ("job", "delete", "j"),
                 ("job", "chown", "j", "65534")):
        r = ptcctl(cf, *args, check=False)
        assert r.returncode == 1, args  # refused: the work failed
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "client key 'bob' may not change job 'j'" in r.stderr
    # and a raw request, past ptcctl's lock
    keys = load_keys(pair.dir / "keys")
    assert keys.name == "bob"
    c = client(pair, keys=keys)
    try:
        with pytest.raises(NotAllowed):
            c.put("j", 1, "x", "full", np.zeros(4, np.float32))
        with pytest.raises(NotAllowed):
            c.put_many("j", 1, [("x", "full", np.zeros(4, np.float32), None)])
        with pytest.raises(NotAllowed):
            c.call("delete_job", job="j")
        with pytest.raises(NotAllowed):
            c.call("pins", owner=1, pins=[["j", 1, 1]])
        c.call("begin_at", job="bobs", version=1)  # a job of its own it may make
        c.call("abort", job="bobs", version=1)
    finally:
        c.close()
    monkeypatch.delenv("PTC_CLIENT_KEY")
    assert checksums(cf, "j") == before


def test_an_allowed_key_changes_the_job_then_a_rotated_key_stops_working(pair, monkeypatch,
                                                                         tmp_path):
    cf = pair.cluster_file
    out = json.loads(ptcctl(cf, "job", "allow", "j", "bob", "--json").stdout)
    assert out["writers"] == ["client", "bob"]
    old = tmp_path / "bob-old.key_secret"
    shutil.copy(pair.dir / "keys" / "clients" / "bob.key_secret", old)
    as_key(monkeypatch, "bob")
    ptcctl(cf, "reconfigure", "j", "--to", "tp=1,dp=2", "--hosts", "h0:1,h1:1")
    ptcctl(cf, "keys", "rotate", "bob")
    assert checksums(cf, "j")  # the new keypair works
    as_key(monkeypatch, str(old), **QUICK)
    r = ptcctl(cf, "checksum", "j", check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    c = client(pair, keys=load_keys(pair.dir / "keys"), timeout_s=2.0)
    try:
        with pytest.raises(NotAllowed, match="refused this client's key"):
            c.call("jobs")
    finally:
        c.close()
    monkeypatch.delenv("PTC_CLIENT_KEY")
    out = json.loads(ptcctl(cf, "job", "deny", "j", "bob", "--json").stdout)
    assert out["writers"] == ["client"]


def test_a_rotated_key_stops_working_on_a_connection_already_open(pair, monkeypatch):
    ptcctl(pair.cluster_file, "keys", "new", "carol")
    as_key(monkeypatch, "carol")
    c = client(pair, keys=load_keys(pair.dir / "keys"), timeout_s=5.0)
    try:
        assert "j" in c.call("jobs")  # admitted, connected
        ptcctl(pair.cluster_file, "keys", "rotate", "carol")
        with pytest.raises(NotAllowed, match="'carol' was rotated or removed"):
            c.call("jobs")  # the same connection, its key no longer the one in public/
    finally:
        c.close()
    c = client(pair, keys=load_keys(pair.dir / "keys"), timeout_s=5.0)  # the new keypair
    try:
        assert "j" in c.call("jobs")
    finally:
        c.close()


def test_a_dataset_only_job_is_changed_only_by_its_ingester(pair, monkeypatch, tmp_path):
    """A job with only a dataset takes its owner, mode and writers from the
    dataset's record: another key reads it but cannot drop it."""
    cf = pair.cluster_file
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(24 * 9, dtype=np.uint16).reshape(24, 9))
    ptcctl(cf, "data", "ingest", "d", str(tokens), "--format", "npy", "--global-batch", "4")
    as_key(monkeypatch, "bob")
    assert "d" in ptcctl(cf, "data", "status", "d").stdout
    r = ptcctl(cf, "data", "drop", "d", check=False)
    assert r.returncode == 1 and "may not change job 'd'" in r.stderr, r.stderr
    monkeypatch.delenv("PTC_CLIENT_KEY")
    ptcctl(cf, "data", "drop", "d")  # its ingester (key "client") may


def test_a_key_the_daemons_do_not_admit_is_named_as_refused(pair, monkeypatch, tmp_path):
    """With a key no daemon admits, ``status`` showed every host DOWN (after
    3 s) and ``job delete`` waited 21 s; both now say the key is refused."""
    import zmq.auth

    _, secret = zmq.auth.create_certificates(str(tmp_path), "eve")
    as_key(monkeypatch, secret)
    for args in (("status",), ("job", "delete", "j"), ("checksum", "j")):
        r = ptcctl(pair.cluster_file, *args, check=False)
        assert r.returncode == 1 and "refused this client's key" in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "DOWN" not in r.stdout, r.stdout
    monkeypatch.delenv("PTC_CLIENT_KEY")
    assert checksums(pair.cluster_file, "j")  # nothing changed
