"""ptcctl import/export --format deepspeed, proved with DeepSpeed's own code:
its engine on CPU (gloo, torchrun) saves ZeRO-1, -2 and -3 checkpoints at
dp=2; they go into a job, through another data-parallel degree, and out;
the engine at that world size ``load_checkpoint``s the export and holds every
weight, fp32 master and Adam moment bit for bit as the saving engine did;
DeepSpeed's ``zero_to_fp32`` reads the export too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

ENGINE = Path(__file__).with_name("deepspeed_engine.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
#: stage → (dtype, the data-parallel degree the export is loaded at)
CASES = {1: ("bf16", 1), 2: ("fp32", 3), 3: ("bf16", 3)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("ds"), 2) as cc:
        yield cc


def engine(mode: str, ranks: int, stage: int, dtype: str, ckpt: Path, dump: Path,
           pp: int = 0) -> dict:
    """DeepSpeed's engine under torchrun (``tests/deepspeed_engine.py``); what
    it holds after ``mode``, by its own accessors (``pp``: a pipeline's)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).parents[1]))
    p = subprocess.Popen([TORCHRUN, "--nproc_per_node", str(ranks), "--standalone",
                          str(ENGINE), mode, str(stage), dtype, str(ckpt), str(dump)]
                         + ([str(pp)] if pp else []),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, f"deepspeed {mode} at {ranks} ranks failed:\n{out[-4000:]}"
    return torch.load(dump)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """``saves(stage, dtype)``: the checkpoint DeepSpeed's engine saved at dp=2
    and what it held, saved once per file (the tests read it, or copy it to
    damage it)."""
    done: dict[tuple[int, str], tuple[Path, dict]] = {}

    def saved(stage: int, dtype: str) -> tuple[Path, dict]:
        if (stage, dtype) not in done:
            d = tmp_path_factory.mktemp(f"zero{stage}-{dtype}")
            done[stage, dtype] = (d / "ck", engine("save", 2, stage, dtype, d / "ck",
                                                   d / "saved.pt"))
        return done[stage, dtype]

    return saved


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.extended), 2, 3])
def test_zero_round_trip_through_another_dp(cluster, saves, tmp_path, stage):
    cf, co = cluster
    dtype, dp = CASES[stage]
    ck, saved = saves(stage, dtype)
    job = f"zero{stage}"
    out = json.loads(ptcctl(cf, "import", job, str(ck), "--format", "deepspeed",
                            "--json").stdout)
    assert ("dp=2,zero=1" if stage < 3 else "fsdp=2") in out["config"], out
    assert out["step"] == 2 and out["optimizer"] == "adam"
    mesh = f"dp={dp}" if stage < 3 else f"fsdp={dp}"
    co.reconfigure(job, parse_config(mesh, parse_hosts("h0:2,h1:2")))
    ptcctl(cf, "export", job, str(tmp_path / "out"), "--format", "deepspeed")
    loaded = engine("load", dp, stage, dtype, tmp_path / "out", tmp_path / "loaded.pt")
    same(saved, loaded)

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "out"))
    same({n: t.reshape(saved[f"weight/{n}"].shape) for n, t in fp32.items()},
         {k[len("master/"):]: v for k, v in saved.items() if k.startswith("master/")})


def test_bad_input_creates_nothing(cluster, saves, tmp_path):
    """A truncated rank file and a missing one, in a copy of the bf16 ZeRO-3
    checkpoint: one line, exit 2, no job."""
    cf, co = cluster
    shutil.copytree(saves(3, "bf16")[0], tmp_path / "ck")
    step = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().strip()
    rank1 = step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = rank1.read_bytes()
    rank1.write_bytes(data[:len(data) // 2])
    r = ptcctl(cf, "import", "cut", str(tmp_path / "ck"), "--format", "deepspeed", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert rank1.name in r.stderr
    rank1.unlink()
    r = ptcctl(cf, "import", "cut", str(tmp_path / "ck"), "--format", "deepspeed", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "missing" in r.stderr and rank1.name in r.stderr
    existing, _ = co.cluster.call_all("versions", job="cut")
    assert not any(existing.values())
