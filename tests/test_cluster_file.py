"""The cluster file: parsing, layered lookup, validation, writing."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ptcfs.errors import InvalidConfig
from ptcfs.server.net.cluster import (
    ClusterSpec,
    FileHostSource,
    HostSpec,
    cluster_from_source,
    load_cluster,
    write_cluster,
)

EXAMPLE = """\
[cluster]
replicas = 2
curve_secret_dir = "keys"

[hosts.h0]
address = "tcp://127.0.0.1:7100"
store = "/var/lib/ptc/h0"
gpus = 4

[hosts.h1]
address = "tcp://10.0.0.2:7100"
store = "stores/h1"
gpus = 2

[hosts."node-a.example"]
address = "ipc:///tmp/ptc-a.sock"
store = "a"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return p


def test_the_example_parses_with_paths_relative_to_the_file(tmp_path):
    spec = load_cluster(write(tmp_path, EXAMPLE))
    assert spec.replicas == 2
    assert spec.names == ("h0", "h1", "node-a.example")  # file order is cluster order
    assert spec.host("h0") == HostSpec("h0", "tcp://127.0.0.1:7100", Path("/var/lib/ptc/h0"), 4)
    assert spec.host("h1").store == tmp_path.resolve() / "stores" / "h1"
    assert spec.host("node-a.example").gpus == 1  # default
    assert spec.curve_dir == tmp_path.resolve() / "keys"
    assert spec.path == tmp_path / "cluster.toml"


def test_defaults_one_replica_and_no_curve(tmp_path):
    spec = load_cluster(write(tmp_path, '[hosts.a]\naddress = "tcp://h:1"\nstore = "s"\n'))
    assert (spec.replicas, spec.curve_dir, spec.host("a").gpus) == (1, None, 1)


def test_the_argument_beats_the_environment(tmp_path, monkeypatch):
    a = write(tmp_path, '[hosts.from_arg]\naddress = "tcp://h:1"\nstore = "s"\n')
    b = tmp_path / "env.toml"
    b.write_text('[hosts.from_env]\naddress = "tcp://h:1"\nstore = "s"\n')
    monkeypatch.setenv("PTC_CLUSTER", str(b))
    assert load_cluster(a).names == ("from_arg",)
    assert load_cluster().names == ("from_env",)
    monkeypatch.delenv("PTC_CLUSTER")
    with pytest.raises(InvalidConfig, match="--cluster FILE or set PTC_CLUSTER"):
        load_cluster()


HOST = '[hosts.h0]\naddress = "tcp://127.0.0.1:7100"\nstore = "s"\n'


@pytest.mark.parametrize("text, message", [
    ("[cluster]\nreplicas = 2\n" + HOST, "replicas=2 but only 1 hosts"),
    ("[cluster]\nreplicas = 0\n" + HOST, "cluster.replicas must be a whole number"),
    ("[cluster]\nreplicas = true\n" + HOST, "cluster.replicas must be a whole number"),
    ("[cluster]\nreplicas = '2'\n" + HOST, "cluster.replicas"),
    ("[cluster]\nreplica = 1\n" + HOST, "unknown key cluster.replica "),
    ("[cluster]\ncurve_secret_dir = 5\n" + HOST, "cluster.curve_secret_dir"),
    ("cluster = 3\n" + HOST, "'cluster' must be a table"),
    ("[cluster]\nreplicas = 1\n", "no hosts"),
    ("[clusters]\n" + HOST, "unknown key clusters"),
    ("hosts = 1\n", "no hosts"),
    ("[hosts]\nh0 = 'x'\n", "hosts.h0 must be a table"),
    ('[hosts.h0]\nstore = "s"\n', "hosts.h0.address is missing"),
    ('[hosts.h0]\naddress = "tcp://a:1"\n', "hosts.h0.store is missing"),
    ('[hosts.h0]\naddress = "tcp://a:1"\nstore = ""\n', "hosts.h0.store is missing"),
    (HOST + "gpus = 0\n", "hosts.h0.gpus must be a whole number"),
    (HOST + "gpus = 1.5\n", "hosts.h0.gpus"),
    (HOST + "gpu = 2\n", "unknown key hosts.h0.gpu "),
    ('[hosts.h0]\naddress = "127.0.0.1:7100"\nstore = "s"\n', "hosts.h0.address"),
    ('[hosts.h0]\naddress = "tcp://127.0.0.1"\nstore = "s"\n', "tcp://HOST:PORT"),
    ('[hosts.h0]\naddress = "tcp://127.0.0.1:70000"\nstore = "s"\n', "port 1-65535"),
    ('[hosts.h0]\naddress = "tcp://*:7100"\nstore = "s"\n', "hosts.h0.address"),
    ('[hosts."h 0"]\naddress = "tcp://a:1"\nstore = "s"\n', "host name 'h 0'"),
    (HOST + '[hosts.h1]\naddress = "tcp://127.0.0.1:7100"\nstore = "t"\n',
     "hosts.h1 has the same address as hosts.h0"),
    ("[hosts.h0\n", "cannot read cluster file"),
])
def test_mistakes_name_the_key(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(InvalidConfig, match=message) as e:
        load_cluster(p)
    assert str(p) in str(e.value)  # and the file


def test_a_missing_file_and_an_unknown_host(tmp_path):
    with pytest.raises(InvalidConfig, match="does not exist"):
        load_cluster(tmp_path / "nope.toml")
    spec = load_cluster(write(tmp_path, EXAMPLE))
    with pytest.raises(InvalidConfig, match=r"host 'h9' is not in the cluster \(hosts: h0, h1"):
        spec.host("h9")


def test_two_hosts_may_name_the_same_store_path(tmp_path):
    text = HOST + '[hosts.h1]\naddress = "tcp://127.0.0.2:7100"\nstore = "s"\n'
    assert len(load_cluster(write(tmp_path, text)).hosts) == 2


names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,20}\Z")
paths = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)


@given(hosts=st.lists(st.tuples(names, paths, st.integers(1, 64)), min_size=1, max_size=5,
                      unique_by=lambda h: h[0]),
       replicas=st.integers(1, 5), curve=st.none() | paths)
def test_write_then_load_gives_the_same_cluster(tmp_path_factory, hosts, replicas, curve):
    d = tmp_path_factory.mktemp("w")
    replicas = min(replicas, len(hosts))
    spec = ClusterSpec(replicas, tuple(HostSpec(n, f"tcp://127.0.0.1:{7000 + i}", Path(s), g)
                                       for i, (n, s, g) in enumerate(hosts)),
                       Path(curve) if curve else None)
    write_cluster(d / "c.toml", spec)
    back = load_cluster(d / "c.toml")
    base = d.resolve()
    assert back.replicas == spec.replicas
    assert back.hosts == tuple(HostSpec(h.name, h.address, base / h.store, h.gpus)
                               for h in spec.hosts)
    assert back.curve_dir == (base / curve if curve else None)


def test_a_host_source_is_checked_like_the_file(tmp_path):
    class Rendezvous:  # what torchrun's rendezvous will supply
        def hosts(self) -> tuple[HostSpec, ...]:
            return (HostSpec("n0", "tcp://10.0.0.1:7100", Path("/s"), 8),
                    HostSpec("n1", "tcp://10.0.0.2:7100", Path("/s"), 8))

    spec = cluster_from_source(Rendezvous(), replicas=2)
    assert spec.names == ("n0", "n1") and spec.path is None
    with pytest.raises(InvalidConfig, match="replicas=3 but only 2 hosts"):
        cluster_from_source(Rendezvous(), replicas=3)
    p = write(tmp_path, EXAMPLE)
    assert FileHostSource(p).hosts() == load_cluster(p).hosts
