"""One settings module: every PTC_* variable parsed one way, at call time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptcfs import settings
from ptcfs.errors import InvalidConfig

ROOT = Path(__file__).resolve().parent.parent


def ptcctl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("ptcctl")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.parametrize("text, value", [
    ("8M", 8 << 20), ("64MiB", 64 << 20), ("1G", 1 << 30), ("512k", 512 << 10),
    ("4096", 4096), (" 2 MB ", 2 << 20), ("1t", 1 << 40),
])
def test_sizes(text, value):
    assert settings.parse_size(text) == value


@pytest.mark.parametrize("name, raw, message", [
    ("PTC_WIRE_CHUNK", "lots", "PTC_WIRE_CHUNK='lots' is not a size"),
    ("PTC_WIRE_CHUNK", "64M", "must be at most 16 MiB"),
    ("PTC_PLAN_SPLIT_BYTES", "0", "must be at least 1"),
    ("PTC_MOUNT_SPLICE", "maybe", "is not a switch"),
    ("PTC_DAEMON_WORKERS", "2.5", "is not a whole number"),
    ("PTC_MOUNT_PEER_TIMEOUT_S", "soon", "is not a number"),
])
def test_bad_values_are_one_line_naming_the_variable(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(InvalidConfig, match=message):
        settings.get(name)


def test_read_at_call_time_with_one_boolean_rule(monkeypatch):
    for raw, want in (("false", False), ("off", False), ("0", False), ("yes", True),
                      ("On", True)):
        monkeypatch.setenv("PTC_MOUNT_SPLICE", raw)
        assert settings.get("PTC_MOUNT_SPLICE") is want  # PTC_MOUNT_SPLICE=false left it on
    monkeypatch.setenv("PTC_KEEP_VERSIONS", "5")
    assert settings.get("PTC_KEEP_VERSIONS") == 5 and settings.source("PTC_KEEP_VERSIONS") \
        == "environment"
    assert settings.get("PTC_KEEP_VERSIONS", 3) == 3  # an explicit argument wins
    monkeypatch.delenv("PTC_KEEP_VERSIONS")
    assert settings.get("PTC_KEEP_VERSIONS") == 2 and settings.source("PTC_KEEP_VERSIONS") \
        == "default"


def test_sizes_with_suffixes_work_where_they_ended_in_tracebacks():
    """PTC_WIRE_CHUNK=8M ptcctl ... and PTC_PLAN_SPLIT_BYTES=64M ptcctl plan ended in
    tracebacks; now they are sizes, and bad ones are one line with exit 2."""
    args = ["plan", "--model", "gpt:layers=2,hidden=64,heads=4,vocab=128", "--from", "tp=2",
            "--from-hosts", "a:2", "--to", "tp=1", "--to-hosts", "b:1", "--json"]
    r = ptcctl(*args, PTC_PLAN_SPLIT_BYTES="64M", PTC_WIRE_CHUNK="8M")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_cross_host"] > 0
    r = ptcctl(*args, PTC_PLAN_SPLIT_BYTES="64X")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "ptcctl plan: error: PTC_PLAN_SPLIT_BYTES='64X' is not a size " \
        "(bytes, or 8M, 64MiB, 1G)"


def test_ptcctl_config_shows_values_and_sources():
    r = ptcctl("config", "--json", PTC_WIRE_PIPELINE="7")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["settings"]
    assert set(got) == set(settings.SETTINGS)
    assert got["PTC_WIRE_PIPELINE"]["value"] == 7
    assert got["PTC_WIRE_PIPELINE"]["source"] == "environment"
    assert got["PTC_WIRE_CHUNK"] == {"value": 8 << 20, "source": "default", "default": "8 MiB",
                                     "unit": "bytes", "doc": settings.SETTINGS[
                                         "PTC_WIRE_CHUNK"].doc}


def test_the_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "settings.md").read_text()
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == settings.table()


def test_every_variable_the_code_reads_is_a_setting_and_every_setting_is_read():
    import re

    code = {p: p.read_text() for d in ("ptcfs", "client", "server")
            for p in (ROOT / d).rglob("*.py") if p.name != "settings.py"}
    read = {m for t in code.values() for m in re.findall(r"\"(PTC_[A-Z0-9_]+)\"", t)}
    assert read <= set(settings.SETTINGS), read - set(settings.SETTINGS)
    assert set(settings.SETTINGS) <= read, set(settings.SETTINGS) - read
    assert not [p for p, t in code.items() if "os.environ.get(\"PTC_" in t]
