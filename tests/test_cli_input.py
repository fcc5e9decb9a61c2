"""ptcctl without sharp edges: every bad value is one line and exit 2, and
no input ends in a traceback."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptcfs.client.cli.app import build_parser, main

TINY = "gpt:layers=1,hidden=8,heads=2,vocab=8"


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: --help (0) and usage errors (2)
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["job", "create", "x", "--model", TINY, "--config", "tp=1", "--hosts", "h0:1", "--seed",
      "-1"], "argument --seed: -1 is below 0"),
    (["plan", "--model", TINY, "--from", "tp=1", "--from-hosts", "h0:99999999999", "--to",
      "tp=1"], "a host has 1 to 4096 GPUs"),
    (["plan", "--model", TINY, "--from", "tp=1", "--from-hosts", "h0:1", "--to", "tp=1",
      "--to-hosts", ""], "no hosts in ''"),
    (["plan", "--model", "gpt:layers=1,hidden=8,heads=2,vocab=8,swiglu=5", "--from", "tp=1",
      "--from-hosts", "h0:1", "--to", "tp=1"], "swiglu"),
    (["data", "ingest", "j", "x.npy", "--format", "npy", "--dp", "0"], "--dp: 0 is below 1"),
    (["data", "seek", "j", "--step", "-3"], "--step: -3 is below 0"),
    (["data", "ingest", "j", "x.npy", "--format", "npy", "--chunk-bytes", "lots"],
     "is not a size"),
])
def test_bad_values_are_one_line_and_exit_2(argv, message):
    code, out, err = run(argv)
    assert code == 2, (code, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert out == ""


def test_a_failed_write_is_not_success(tmp_path, monkeypatch):
    """``tensor get --out /dev/full`` exited 0: np.save's C writes hide ENOSPC."""
    import numpy as np

    from ptcfs.client.cli.cluster import _save_npy

    with pytest.raises(OSError):
        _save_npy(Path("/dev/full"), np.zeros(1000))
    _save_npy(tmp_path / "a.npy", np.arange(6).reshape(2, 3))
    assert np.load(tmp_path / "a.npy").tolist() == [[0, 1, 2], [3, 4, 5]]


COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def test_each_subcommand_is_in_the_module_the_table_names():
    """A command line imports only its subcommand's module (cli.MODULES):
    the table names every subcommand's own module, and a command line
    imports no other subcommand's module than those its own one imports."""
    import subprocess
    import sys

    import ptcfs.client.cli.app as cli

    assert COMMANDS == sorted(cli.MODULES)
    for name, add in cli._COMMANDS:
        assert add.__module__ == f"ptcfs.client.cli.{cli.MODULES[name]}", name
    commands = sorted(set(cli.MODULES.values()))
    probe = ("import sys\nfrom ptcfs.client.cli import build_parser\n"
             "build_parser(['plan', '--help'])\n"
             f"print(sorted(m for m in sys.modules if m.rpartition('.')[2] in {commands!r}\n"
             "             and m.startswith('ptcfs.client.cli.')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["['ptcfs.client.cli.plan']"]


WORDS = st.sampled_from([
    "--model", TINY, "llama:layers=1", "moe:experts=0", "--config", "--to", "--from", "tp=2",
    "fsdp=0", "ep=3", "zero=7", "pp_layers=1,2", "tp=2,tp=4", "--hosts", "--from-hosts",
    "--to-hosts", "h0:2", "h0:0", "h0:-1", ":", "", "--json", "--dry-run", "--seed", "-5",
    "--step", "99999999999999999999", "--dp", "0", "--version", "0", "--slice", "0:x",
    "--format", "npy", "hf", "--out", "o.npy", "--model-spec", "nope.toml", "--optimizer",
    "sgd", "--dtype", "bf16", "create", "get", "ingest", "seek", "status", "drop", "generate",
    "j", "a/b", "\x00", "--debug", "--cluster", "none.toml", "--help", "-h", "--shapes",
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cmd=st.sampled_from(COMMANDS), words=st.lists(WORDS, max_size=8),
       front=st.booleans())
def test_random_arguments_never_end_in_a_traceback(tmp_path_factory, cmd, words, front):
    cwd = tmp_path_factory.mktemp("fuzz")
    old = os.getcwd()
    os.chdir(cwd)
    argv = (["--cluster", "none.toml", cmd] if front else [cmd]) + words
    try:
        code, _, err = run(argv)
    except Exception:
        if "--debug" in words:
            return  # --debug asks for tracebacks
        raise
    finally:
        os.chdir(old)
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 1, 2), (argv, code, err)
    if code:
        assert err.strip(), argv
