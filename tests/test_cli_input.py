"""ptcctl without sharp edges: every bad value is one line and exit 2, and
no input ends in a traceback."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
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


# --- bounds: absurd sizes and odd names are one line, exit 2, in bounded memory ---


def ptcctl_bounded(*argv: str, env: dict[str, str] | None = None,
                   memory: int = 1 << 30) -> subprocess.CompletedProcess[str]:
    """``ptcctl ARGV`` in a process that may map at most ``memory`` bytes, so
    that a command that would grow without bound fails fast instead."""
    import resource
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    code = "import sys\nfrom ptcfs.client.cli.app import main\nsys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *argv], text=True,
                          capture_output=True, timeout=120, preexec_fn=limit,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})


HUGE = "gpt:layers=1000000000,hidden=64,heads=4,vocab=100"
PLAN = ["--from", "tp=1", "--from-hosts", "h0:1", "--to", "tp=1"]


@pytest.mark.parametrize("model, says", [
    (HUGE, "PTC_SPEC_MAX_TENSORS"),
    ("moe:layers=2,hidden=64,heads=4,kv_heads=2,vocab=100,ffn=64,experts=100000000",
     "PTC_SPEC_MAX_TENSORS"),
    ("gpt:layers=1,hidden=1000000000,heads=4,vocab=1000000000", "PTC_SPEC_MAX_TENSOR_BYTES"),
])
def test_a_preset_beyond_the_limits_is_refused_before_it_is_built(model, says):
    """``plan --model gpt:layers=1000000000,...`` grew to 1.4 GB with no output."""
    r = ptcctl_bounded("plan", "--model", model, *PLAN)
    assert r.returncode == 2, r.stderr[-300:]
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-300:]


@pytest.mark.parametrize("tensors, says", [
    ([{"name": "w", "shape": [10**12, 10**12], "dtype": "fp16"}], "PTC_SPEC_MAX_TENSOR_BYTES"),
    ([{"name": f"w{i}", "shape": [1 << 28, 1 << 10], "dtype": "fp32"} for i in range(1025)],
     "PTC_SPEC_MAX_BYTES"),
    ([{"name": "w", "shape": [1] * 40, "dtype": "fp16"}], "dimensions"),
    ([{"name": "../../../etc/x", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
    ([{"name": "/abs", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
    ([{"name": "a//b", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
    ([{"name": "a/./b", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
    ([{"name": "a\x00b", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
    ([{"name": "a\nb", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
    ([{"name": "a/", "shape": [4], "dtype": "fp16"}], "bad tensor name"),
])
def test_a_spec_beyond_the_limits_or_with_odd_names_is_one_line(tmp_path, tensors, says):
    """A shape of [10^12, 10^12] ended in a traceback; ``../../../etc/x``
    and ``/abs`` were accepted (the mount then gave EIO)."""
    import json

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "x", "layers": 1, "tensors": tensors}))
    r = ptcctl_bounded("plan", "--model-spec", str(spec), *PLAN)
    assert r.returncode == 2, r.stderr[-300:]
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-300:]


def test_a_spec_with_too_many_tensors_is_refused_before_they_are_built(tmp_path):
    import json

    spec = tmp_path / "spec.json"
    names = {f"t{i}": [4] for i in range(2000)}
    spec.write_text(json.dumps({"name": "x", "layers": 1, "names": names,
                                "rules": [{"match": "*"}], "optimizer": {"states": ["m"]}}))
    r = ptcctl_bounded("plan", "--model-spec", str(spec), *PLAN,
                       env={"PTC_SPEC_MAX_TENSORS": "3000"})
    assert r.returncode == 2 and "PTC_SPEC_MAX_TENSORS=3_000" in r.stderr, r.stderr[-300:]
    r = ptcctl_bounded("plan", "--model-spec", str(spec), *PLAN, "--json",
                       env={"PTC_SPEC_MAX_TENSORS": "4000"})
    assert r.returncode == 0, r.stderr[-300:]


def test_not_enough_memory_is_a_usage_error():
    """The exit-code table says a command that cannot work here is 2; it was 1."""
    r = ptcctl_bounded("plan", "--model", HUGE, *PLAN, memory=512 << 20,
                       env={"PTC_SPEC_MAX_TENSORS": str(1 << 40)})
    assert r.returncode == 2, r.stderr[-300:]
    assert "not enough memory" in r.stderr and len(r.stderr.strip().splitlines()) == 1
