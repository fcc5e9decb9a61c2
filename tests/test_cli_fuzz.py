"""Random arguments to every ``ptcctl`` subcommand never end in a traceback.

Hypothesis builds command lines from the real parser: every leaf subcommand
(``job create``, ``data ingest``, ...), its positionals and options, each with
a value that can work here (the job of a live two-host cluster, a small model,
a dataset file) or a random one (text, unicode, empty, numbers out of range).
``ptcctl`` runs in this process against that cluster (started once); the
exit status must be one of ``EXIT_CODES``, stderr holds no traceback, and an
error is one line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ptcfs.client.cli.app import build_parser, main
from ptcfs.errors import EXIT_CODES
from ptcfs.model.presets import parse_model
from tests.daemons import running

pytestmark = pytest.mark.multihost

TINY = "gpt:layers=1,hidden=8,heads=2,vocab=8"
JOB = "j"
#: A job the fuzz never names (it may delete ``j``), for the tests of exit codes.
STEADY = "steady"
#: A job nothing ever makes (the fuzz may create the jobs it names, ``nojob`` too).
ABSENT = "absent"

# --- the commands, from the parser itself ---------------------------------------


def _leaves(p: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, p
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


LEAVES = dict(_leaves(build_parser(), ()))
LEAF_NAMES = {p[0] for p in LEAVES}

# --- values ----------------------------------------------------------------------

#: Values that can work against the fixture's cluster, by argparse dest.
GOOD: dict[str, list[str]] = {
    "job": [JOB, "k", "nojob"],
    "name": [],  # the tiny model's tensor names, below
    "model": [TINY, "gpt:layers=2,hidden=8,heads=2,vocab=16", "llama:layers=1"],
    "model_spec": ["spec.toml", "nope.toml", "/dev/null", "t.npy"],
    "config": ["tp=1", "tp=2", "dp=2"], "to": ["tp=1", "tp=2", "dp=2"],
    "src": ["tp=1", "tp=2", "ck", "t.npy", "/dev/null", "."], "dst": ["tp=1", "tp=2"],
    "hosts": ["h0:1", "h0:1,h1:1", "h1:2"], "from_hosts": ["h0:1", "h0:2"],
    "to_hosts": ["h1:1", "h0:1,h1:1"],
    "source": ["t.npy", "t.jsonl", "nothing.npy", "/dev/null", "."], "dir": ["d", "out"],
    "slice": ["0:1", "0:2,:", ":"], "out": ["o.npy", "o.toml", "/dev/full"],
    "version": ["1", "2"],
    "lost": ["h1", ""], "rate": ["64M", "0"], "chunk_bytes": ["1M", "4k"],
    "gpu_mem": ["80GiB"], "gpu_tflops": ["400"], "intra_host": ["450GB/s"],
    "inter_host": ["25GB/s"], "length_key": ["length"], "host_id": ["h0"],
    "ready_file": ["ready.json"],
}
for _dest in ("step", "seed", "dp", "global_batch", "seq", "micro_batch", "horizon", "heads"):
    GOOD[_dest] = ["0", "1", "2", "4"]

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=12)
WEIRD = st.one_of(
    st.sampled_from(["", " ", "-1", "0", "-0", "1e309", "nan", "inf", "0x10", "1_000",
                     "99999999999999999999", str(2 ** 63), "h0:0", "h0:-1", "h0:99999999999",
                     ":", ",", "=", "tp=", "tp=0", "tp=2,tp=4", "swiglu=5", "a/b", "..",
                     "/", "/dev/null", "💥", "ｔｐ=1", "-", "--json", "0:x",
                     "gpt:layers=99999999,hidden=99999999,heads=1,vocab=99999999"]),
    TEXT,
    st.integers(min_value=-2 ** 70, max_value=2 ** 70).map(str),
)


#: Where commands write (keys generate DIR, export DIR, --out FILE): kept
#: inside the test's folder, whatever the draw (``keys generate /`` would
#: make / its owner's only).
WRITES = {"dir", "out", "ready_file"}


def _inside(value: str) -> str:
    p = Path(value)
    if value in ("/dev/full", "/dev/null") or (not p.is_absolute() and ".." not in p.parts):
        return value
    return "elsewhere"


def _value(dest: str, choices: object) -> st.SearchStrategy[str]:
    """Mostly a value that can work (so that commands get past the parser and
    do their work), else a random one."""
    good = list(choices) if choices else GOOD.get(dest, [])  # type: ignore[call-overload]
    drawn = WEIRD if not good else st.integers(0, 5).flatmap(
        lambda n: st.sampled_from([str(g) for g in good]) if n else WEIRD)
    return drawn.map(_inside) if dest in WRITES else drawn


@st.composite
def command_line(draw: st.DrawFn) -> list[str]:
    path = draw(st.sampled_from(sorted(LEAVES)))
    argv = list(path)
    parser = LEAVES[path]
    skip: set[int] = set()  # of a mutually exclusive group, mostly one
    for g in parser._mutually_exclusive_groups:
        keep = draw(st.sampled_from(g._group_actions))
        if draw(st.integers(0, 8)):
            skip |= {id(a) for a in g._group_actions if a is not keep}
    for a in parser._actions:
        if id(a) in skip:
            continue
        if isinstance(a, argparse._HelpAction):
            if draw(st.integers(0, 30)) == 0:
                argv.append("--help")
            continue
        if not a.option_strings:  # a positional: nearly always given
            if draw(st.integers(0, 12)):
                argv.append(draw(_value(a.dest, a.choices)))
            continue
        if not draw(st.booleans() if not a.required else st.integers(0, 12).map(bool)):
            continue
        argv.append(draw(st.sampled_from(a.option_strings)))
        if a.nargs != 0 and draw(st.integers(0, 15)):  # now and then the value is missing
            argv.append(draw(_value(a.dest, a.choices)))
    if draw(st.integers(0, 8)) == 0:
        # inside the folder too: with a positional left out, it takes that one's place
        argv.append(_inside(draw(st.one_of(WEIRD, st.sampled_from(["--nope", "-x", "extra"])))))
    front = draw(st.sampled_from([[]] * 6 + [["--json"], ["--cluster", "none.toml"]]))
    if path == ("mount",):  # never mount for real: it would run until unmounted
        argv += ["--cluster", "none.toml"]
    return front + argv


# --- the cluster, and running ptcctl in this process ----------------------------


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: --help (0) and usage errors (2)
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A live two-host cluster with job ``j`` and a dataset, ``PTC_CLUSTER``
    naming it, and the cwd a folder with input files the commands can read."""
    base = tmp_path_factory.mktemp("fuzz")
    work = base / "work"
    work.mkdir()
    old_cwd, old_env = os.getcwd(), os.environ.get("PTC_CLUSTER")
    with running(base / "cluster", 2) as lc:
        try:
            os.environ["PTC_CLUSTER"] = str(lc.cluster_file)
            os.chdir(work)
            np.save("t.npy", np.arange(64, dtype=np.int32).reshape(16, 4))
            Path("t.jsonl").write_text("".join(f'{{"length": {i + 1}}}\n' for i in range(8)))
            run(["spec", "--model", TINY, "--out", "spec.toml"])
            for job in (JOB, STEADY):
                for argv in (["job", "create", job, "--model", TINY, "--config", "tp=1",
                              "--hosts", "h0:1"],
                             ["data", "ingest", job, "t.npy", "--format", "npy",
                              "--global-batch", "4"]):
                    code, _, err = run(argv)
                    assert code == 0, (argv, err)
            GOOD["name"] = [t.name for t in parse_model(TINY).tensors][:3] + ["nope"]
            GOOD["cluster"] = [str(lc.cluster_file)]
            yield work
        finally:
            os.chdir(old_cwd)
            if old_env is None:
                os.environ.pop("PTC_CLUSTER", None)
            else:
                os.environ["PTC_CLUSTER"] = old_env


@settings(max_examples=200, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(argv=command_line())
def test_random_command_lines_end_in_one_line_and_a_documented_status(workdir, argv):
    code, out, err = run(argv)  # an exception out of main() is a traceback for the user
    cmd = [w for w in argv if w in LEAF_NAMES][:1]
    event(f"exit {code} {' '.join(cmd)}")  # pytest --hypothesis-show-statistics
    assert "Traceback" not in err, (argv, err)
    assert code in EXIT_CODES, (argv, code, err)
    if code != 0:
        assert len(err.strip().splitlines()) <= 1, (argv, code, err)
        assert err.strip() or out.strip(), (argv, code)  # verify/suggest say why on stdout


def test_every_subcommand_is_fuzzed():
    """The leaves the fuzz draws from are every command of the parser."""
    assert {p[0] for p in LEAVES} >= {"job", "status", "tensor", "reconfigure", "plan",
                                      "data", "import", "export", "suggest", "repair",
                                      "commit", "config", "keys", "mount", "spec"}
    assert ("job", "create") in LEAVES and ("data", "ingest") in LEAVES


@pytest.mark.parametrize("argv, code, says", [
    (["nocommand"], 2, "invalid choice"),
    (["checksum", "a/b"], 2, "bad job name"),
    (["reconfigure", STEADY, "--to", "tp=3"], 2, "3 ranks, but the hosts have only 1 GPUs"),
    (["tensor", "get", STEADY, "embedding.word_embeddings.weight", "--slice", "0:x",
      "--out", "o.npy"], 2, "bad slice item"),
    (["data", "ingest", "k", "empty.jsonl", "--format", "jsonl"], 2, "no JSON records"),
    (["checksum", ABSENT], 1, f"no host has a committed version of job {ABSENT!r}"),
    (["tensor", "get", STEADY, "nope", "--out", "o.npy"], 1, "has no tensor 'nope'"),
    (["data", "ingest", STEADY, "t.npy", "--format", "npy"], 1, "has a dataset already"),
])
def test_usage_errors_exit_2_and_failed_work_exits_1(workdir, argv, code, says):
    Path("empty.jsonl").write_text("")
    got, out, err = run(argv)
    assert (got, out) == (code, ""), (argv, got, err)
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_the_docs_list_the_exit_codes():
    page = (Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    table = page[page.index("**Exit codes.**"):].split("\n\n")[1]
    assert [int(row.split("|")[1]) for row in table.splitlines()[2:]] == sorted(EXIT_CODES)


@pytest.fixture(scope="module")
def dead(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cluster file whose two hosts do not run (nothing listens at their
    ports), pings and the job lock that give up soon, and the cwd a folder
    with a dataset."""
    from ptcfs.server.testing.localcluster import LocalCluster

    base = tmp_path_factory.mktemp("dead")
    lc = LocalCluster(base / "cluster")
    lc.write(2, keys=False)
    saved = {k: os.environ.get(k) for k in ("PTC_CLUSTER", "PTC_PING_TIMEOUT_S",
                                            "PTC_PEER_SILENCE_S", "PTC_LOCK_WAIT_S")}
    old_cwd = os.getcwd()
    try:
        os.environ.update(PTC_CLUSTER=str(lc.cluster_file), PTC_PING_TIMEOUT_S="0.2",
                          PTC_PEER_SILENCE_S="0.1", PTC_LOCK_WAIT_S="0.5")
        os.chdir(base)
        np.save("t.npy", np.arange(64, dtype=np.int32).reshape(16, 4))
        yield base
    finally:
        os.chdir(old_cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(argv=command_line())
def test_random_command_lines_against_hosts_that_are_down(dead, argv):
    if "--cluster" in argv:  # the fixture's cluster file, whose hosts are down
        argv = [w if w != str(GOOD.get("cluster", [""])[0]) else os.environ["PTC_CLUSTER"]
                for w in argv]
    code, out, err = run(argv)
    event(f"exit {code}")
    assert "Traceback" not in err, (argv, err)
    assert code in EXIT_CODES, (argv, code, err)
    if code != 0:
        assert len(err.strip().splitlines()) <= 1, (argv, code, err)
        assert err.strip() or out.strip(), (argv, code)


ZERO_SPEC = {"name": "z", "layers": 1, "tensors": [
    {"name": "scalar", "shape": [], "dtype": "fp32"},
    {"name": "w", "shape": [4, 3], "dtype": "fp32", "split_dim": 0},
    {"name": "none", "shape": [0, 3], "dtype": "fp32"}]}


def test_empty_slices_and_0d_tensors_work_in_every_command(workdir, monkeypatch):
    """A 0-d tensor's checksum and ``tensor get`` failed (``box [] is outside
    scalar [full] of shape [1]``: it was stored as shape [1]); ``--slice 0:0``
    ended in a traceback and left a 128-byte file."""
    import json

    # the live cluster's, whichever module fixture set the environment last
    # (``dead`` names hosts that do not run, and pings that give up at once)
    monkeypatch.setenv("PTC_CLUSTER", GOOD["cluster"][0])
    for name in ("PTC_PING_TIMEOUT_S", "PTC_PEER_SILENCE_S", "PTC_LOCK_WAIT_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(workdir)
    Path("zero.json").write_text(json.dumps(ZERO_SPEC))
    code, _, err = run(["job", "create", "zero", "--model-spec", "zero.json", "--config", "tp=2",
                        "--hosts", "h0:1,h1:1", "--seed", "2"])
    assert code == 0, err
    code, out, err = run(["checksum", "zero", "--json"])
    assert code == 0, err
    assert set(json.loads(out)) == {"scalar", "w", "none"}
    for name, args, shape in (("scalar", [], ()), ("w", ["--slice", "0:0"], (0, 3)),
                              ("w", ["--slice", "1:1,:"], (0, 3)), ("none", [], (0, 3)),
                              ("w", ["--slice", "2"], (3,))):
        Path("got.npy").unlink(missing_ok=True)
        code, _, err = run(["tensor", "get", "zero", name, "--out", "got.npy", *args])
        assert code == 0, (name, args, err)
        assert np.load("got.npy").shape == shape, (name, args)
    assert np.load("got.npy").dtype == np.float32
    code, _, err = run(["verify", "zero"])
    assert code == 0, err
    code, _, err = run(["reconfigure", "zero", "--to", "tp=1", "--hosts", "h1:1"])
    assert code == 0, err
    code, out, err = run(["tensor", "get", "zero", "scalar", "--out", "got.npy"])
    assert code == 0 and np.load("got.npy").shape == (), err
    run(["job", "delete", "zero"])
