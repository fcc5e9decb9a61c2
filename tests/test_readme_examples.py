"""Every code example in the README, in ``docs/*.md`` and in ``bench/README.md``
runs as written.

- A ```` ```python ```` block runs (each in a namespace of its own) against a
  live local cluster of two hosts with their filesystems mounted, holding the
  jobs the examples name: ``gpt`` (bf16 with Adam state, ``dp=4``, and a
  dataset) and ``vit``. ``/ptc/`` in a block is h0's mount, and the working
  directory holds ``cluster.toml``.
- A block preceded by ``<!-- example: skip (why) -->`` is not run; one
  preceded by ``<!-- example: given a, b (why) -->`` gets those names from
  this test (what the training script around it has: its rank, model and
  optimizer).
- A ```` ```sh ```` block runs when preceded by ``<!-- example: run -->``
  (most name real hosts, checkpoints or a root shell), from the repository's
  root, with ``ptcctl`` on ``PATH``, ``PTC_CLUSTER`` the cluster's file and
  ``TMPDIR`` a folder of its own (a local cluster it leaves up there is
  stopped after it); a transcript block
  (```` ``` ```` starting ``$ ptcctl``) runs its command, which must print
  the lines shown (but the time the plan took).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_cluster import ptcctl

pytestmark = [pytest.mark.fuse, pytest.mark.multihost]

ROOT = Path(__file__).resolve().parent.parent
GPT = "gpt:layers=2,hidden=64,heads=4,vocab=1024,seq=64"
VIT = "vit:layers=2,hidden=64,heads=4,image=32,patch=8,classes=10"
MARK = re.compile(r"<!--\s*example:\s*(skip|given|run)\b(.*?)-->")


@dataclass(frozen=True)
class Block:
    page: str  # the file, relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    mark: str  # skip, given, run or ""
    note: str  # what follows the mark: the names given, why
    names: tuple[str, ...]  # of "given"

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.lang or 'text'}"


def blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced code blocks of ``text`` (of ``page``), each with the example mark
    before it."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = MARK.search(before)
        mark, rest = (m.group(1), m.group(2)) if m else ("", "")
        names = tuple(n.strip() for n in re.sub(r"\(.*\)", "", rest).split(",") if n.strip()) \
            if mark == "given" else ()
        out.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n", mark,
                         rest.strip(), names))
        i = end + 1
    return out


def _runnable(b: Block) -> bool:
    if b.mark == "skip":
        return False
    if b.lang == "python":
        return True
    if b.lang in ("sh", "bash"):
        return b.mark == "run"
    return b.lang == "" and b.code.startswith("$ ptcctl")


#: the pages whose examples run: the guide, the reference, the benchmarks' page
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "bench/README.md"]


def every_block() -> list[Block]:
    """Every fenced block of every page of :data:`PAGES`."""
    return [b for page in PAGES for b in blocks((ROOT / page).read_text(), page)]


BLOCKS = [b for b in every_block() if _runnable(b)]


def test_skips_are_few_and_say_why():
    every = every_block()
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/models.md", "docs/filesystem.md"}
    python = [b for b in every if b.lang == "python"]
    assert len([b for b in python if b.mark != "skip"]) >= 3
    for b in every:
        assert b.mark != "skip" or re.search(r"\(.+\)", b.note), f"{b.id}: say why it is skipped"


# --- the cluster the examples run against ---------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from ptcfs.server.testing.localcluster import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("readme"))
    old = os.getcwd()
    try:
        lc.up(2, gpus=2, mount=True)
        cf = lc.cluster_file
        ptcctl(cf, "job", "create", "gpt", "--model", GPT, "--dtype", "bf16", "--optimizer",
               "adam", "--config", "dp=4", "--hosts", "h0:2,h1:2", "--seed", "1")
        ptcctl(cf, "job", "create", "vit", "--model", VIT, "--dtype", "fp32",
               "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "2")
        np.save(lc.dir / "tokens.npy", np.arange(64 * 8, dtype=np.int32).reshape(64, 8))
        ptcctl(cf, "data", "ingest", "gpt", str(lc.dir / "tokens.npy"), "--format", "npy",
               "--global-batch", "8")
        os.chdir(lc.dir)  # Cluster.load("cluster.toml")
        yield {"lc": lc, "mount": lc.mount_dir("h0")}
    finally:
        os.chdir(old)
        lc.down()


def _given(lc: Any) -> dict[str, Callable[[], Any]]:
    """What a block marked ``given`` may take from the training script around it."""

    def model() -> Any:
        from ptcfs.client.control.conn import Cluster
        from ptcfs.client.control.coordinator import Coordinator
        from ptcfs.client.torch.module import module_for

        cluster = Cluster.load(lc.cluster_file)
        try:
            return module_for(Coordinator(cluster).state("gpt"), 0)
        finally:
            cluster.close()

    made: dict[str, Any] = {}

    def adam() -> Any:
        import torch

        return torch.optim.Adam(made["model"].parameters())

    return {"rank": lambda: 0, "new_rank": lambda: 0, "dp_rank": lambda: 0,
            "step": lambda: 1, "model": lambda: made.setdefault("model", model()),
            "adam": adam}


def _down_local_clusters(scratch: Path) -> None:
    """Stop every local cluster a shell example started under ``scratch`` and
    left up (it failed before its own ``down``)."""
    for cf in scratch.rglob("cluster.toml"):
        subprocess.run(["bash", str(ROOT / "deploy" / "local-cluster.sh"), "down",
                        str(cf.parent)], capture_output=True, timeout=120, check=False)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs_as_written(env, block: Block, tmp_path: Path):
    mount = env["mount"]
    if block.lang == "python":
        given = _given(env["lc"])
        missing = [n for n in block.names if n not in given]
        assert not missing, f"{block.id}: the test has no {missing} to give"
        scope: dict[str, Any] = {"__name__": "__readme__"}
        for n in block.names:
            scope[n] = given[n]()
        code = block.code.replace("/ptc/", f"{mount}/")
        exec(compile(code, block.id, "exec"), scope)  # noqa: S102 - the docs' own code
        return
    exe = Path(sys.executable).parent
    environment = dict(os.environ, PATH=f"{exe}:{os.environ['PATH']}",
                       PTC_CLUSTER=str(env["lc"].cluster_file))
    if block.lang in ("sh", "bash"):
        scratch = tmp_path / "tmp"  # the block's $TMPDIR (mktemp -d)
        scratch.mkdir()
        try:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code],
                               capture_output=True, text=True, timeout=300,
                               env=dict(environment, TMPDIR=str(scratch)), cwd=ROOT)
        finally:
            _down_local_clusters(scratch)
        assert r.returncode == 0, f"{block.id}: exit {r.returncode}\n{r.stderr}"
        return
    lines = block.code.splitlines()
    command = lines[0][2:]
    k = 1
    while command.endswith("\\"):
        command = command[:-1] + " " + lines[k].strip()
        k += 1
    r = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300,
                       env=environment, cwd=ROOT)
    assert r.returncode == 0, f"{block.id}: exit {r.returncode}\n{r.stderr}"
    got = [ln.rstrip() for ln in r.stdout.splitlines()]
    for want in lines[k:]:
        if "planned in" in want:
            assert any(g.startswith(want.split("planned in")[0]) for g in got), (want, got)
        else:
            assert want.rstrip() in got, f"{block.id}: {want!r} not in\n" + "\n".join(got)
