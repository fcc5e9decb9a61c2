"""ptcctl import/export --format deepspeed of pipeline-parallel checkpoints,
proved with DeepSpeed's own code: its ``PipelineEngine`` on CPU (gloo,
torchrun) trains a ``PipelineModule`` of five layers two steps with ZeRO-1 at
pp=2 and saves it (``layer_XX-model_states.pt``, one model-states and one
optimizer-states file a stage); it goes into a job at pp=2, through another
pipeline and data-parallel degree, and out; the engine at that degree
``load_checkpoint``s the export and holds every weight, fp32 master, Adam
moment and step bit for bit as the saving engine did (bf16: the fp32
masters are the job's, not the bf16 weights widened), and DeepSpeed's
``ds_to_universal`` converts the export to the files it makes of its save."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_ckpt_deepspeed import engine, same  # noqa: E402
from tests.test_ckpt_deepspeed_universal import to_universal  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("dspipe"), 2) as cc:
        yield cc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """dtype → DeepSpeed's pipeline checkpoint at pp=2, dp=1 and what its
    engine held (each saved once)."""
    done: dict[str, tuple] = {}

    def get(dtype: str) -> tuple:
        if dtype not in done:
            d = tmp_path_factory.mktemp(f"pipe-{dtype}")
            done[dtype] = d / "ck", engine("save", 2, 1, dtype, d / "ck", d / "saved.pt", pp=2)
        return done[dtype]
    return get


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(
            _equal(v, b[k]) for k, v in a.items())
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _import(cf, job: str, ck) -> dict:
    out = json.loads(ptcctl(cf, "import", job, str(ck), "--format", "deepspeed",
                            "--json").stdout)
    assert "pp=2" in out["config"] and "zero=1" in out["config"], out
    assert out["step"] == 2 and out["optimizer"] == "adam"
    return out


@pytest.mark.parametrize("pp,dp,dtype", [(1, 2, "fp32"),
                                         pytest.param(2, 2, "bf16", marks=pytest.mark.extended)])
def test_pipeline_round_trip_through_another_mesh(cluster, saved, tmp_path, pp, dp, dtype):
    cf, co = cluster
    ck, want = saved(dtype)
    job = f"pipe{pp}{dp}"
    _import(cf, job, ck)
    co.reconfigure(job, parse_config(f"pp={pp},dp={dp},zero=1", parse_hosts("h0:2,h1:2")))
    ptcctl(cf, "export", job, str(tmp_path / "out"), "--format", "deepspeed")
    step = tmp_path / "out" / "global_step2"
    assert sorted(f.name for f in step.glob("layer_*")) == [
        f"layer_0{i}-model_states.pt" for i in range(5)]
    assert len(list(step.glob("*optim_states.pt"))) == pp * dp
    loaded = engine("load", pp * dp, 1, dtype, tmp_path / "out", tmp_path / "loaded.pt", pp=pp)
    same(want, loaded)
    if dtype == "fp32":
        # DeepSpeed's ds_to_universal makes of the export what it makes of its own save
        theirs, ours = (to_universal(d / "global_step2") / "zero" for d in (ck, tmp_path / "out"))
        files = sorted(f.relative_to(theirs) for f in theirs.glob("*/*.pt"))
        assert files and files == sorted(f.relative_to(ours) for f in ours.glob("*/*.pt"))
        for f in files:
            assert _equal(torch.load(theirs / f), torch.load(ours / f)), f


def test_bad_pipeline_creates_nothing(cluster, saved, tmp_path):
    """A stage's layer file truncated, then missing: one line, exit 2, no job."""
    cf, co = cluster
    ck = tmp_path / "ck"
    shutil.copytree(saved("fp32")[0], ck)
    layer = ck / "global_step2" / "layer_04-model_states.pt"
    data = layer.read_bytes()
    layer.write_bytes(data[:len(data) // 2])
    r = ptcctl(cf, "import", "cutpipe", str(ck), "--format", "deepspeed", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert layer.name in r.stderr
    layer.unlink()
    r = ptcctl(cf, "import", "cutpipe", str(ck), "--format", "deepspeed", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "missing" in r.stderr and layer.name in r.stderr
    existing, _ = co.cluster.call_all("versions", job="cutpipe")
    assert not any(existing.values())
