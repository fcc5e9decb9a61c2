"""DeepSpeed universal checkpoints, proved with DeepSpeed's own code: its
engine on CPU saves one ZeRO-2 checkpoint at dp=2 for the module, which its
``ds_to_universal`` converts. A ``deepspeed`` export carries the
``param_slice_mappings`` that ``ds_to_universal`` needs; ``--format
deepspeed-universal`` imports the universal folder and exports one; the
engine with ``load_universal`` loads each conversion and each export with
every weight, fp32 master and Adam moment bit for bit as the saving engine
held them."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from ptcfs.client.formats.common import from_numpy  # noqa: E402
from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_ckpt_deepspeed import engine, same  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

STAGE, DTYPE = 2, "bf16"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("dsu"), 2) as cc:
        yield cc


def to_universal(step_dir: Path) -> Path:
    """DeepSpeed's ``ds_to_universal`` of ``step_dir`` into ``<step_dir>_universal``
    (it writes ``latest_universal`` beside them); ``--inject_missing_state``,
    as for any checkpoint of a module that declares no universal patterns."""
    from deepspeed.checkpoint.ds_to_universal import main

    out = step_dir.with_name(step_dir.name + "_universal")
    main(argparse.Namespace(input_folder=str(step_dir), output_folder=str(out),
                            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                            strict=True, inject_missing_state=True))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The engine's checkpoint (with its universal conversion) and what it held."""
    d = tmp_path_factory.mktemp("engine")
    held = engine("save", 2, STAGE, DTYPE, d / "ck", d / "saved.pt")
    to_universal(d / "ck" / (d / "ck" / "latest").read_text().strip())
    return d / "ck", held


def test_export_converts_with_ds_to_universal(cluster, saved, tmp_path):
    """ZeRO-2 at dp=2 → a job → dp=3 → ``deepspeed`` export → ``ds_to_universal``
    → the engine at dp=1 with ``load_universal``."""
    cf, co = cluster
    ck, held = saved
    ptcctl(cf, "import", "zu", str(ck), "--format", "deepspeed")
    co.reconfigure("zu", parse_config("dp=3", parse_hosts("h0:2,h1:2")))
    ptcctl(cf, "export", "zu", str(tmp_path / "out"), "--format", "deepspeed")
    to_universal(tmp_path / "out" / "global_step2")
    same(held, engine("load_universal", 1, STAGE, DTYPE, tmp_path / "out",
                      tmp_path / "loaded.pt"))


def test_universal_import_and_export(cluster, saved, tmp_path):
    """``ds_to_universal``'s folder → a job at dp=2 → dp=3, every tensor the
    engine's → ``deepspeed-universal`` export → the engine at dp=2."""
    cf, co = cluster
    ck, held = saved
    out = json.loads(ptcctl(cf, "import", "uni", str(ck), "--format", "deepspeed-universal",
                            "--json").stdout)
    assert "dp=2,zero=1" in out["config"] and out["step"] == 2, out
    assert out["optimizer"] == "adam"
    co.reconfigure("uni", parse_config("dp=3", parse_hosts("h0:2,h1:2")))
    st = co.state("uni")
    for key, want in held.items():
        kind, _, name = key.partition("/")
        if kind == "global_steps":
            continue
        job_name = name if kind == "weight" else f"optim/{kind}/{name}"
        got = from_numpy(co.fetch_tensor(st, job_name), DTYPE if kind == "weight" else "fp32")
        assert got.dtype == want.dtype and torch.equal(got, want), key
    ptcctl(cf, "export", "uni", str(tmp_path / "out"), "--format", "deepspeed-universal")
    assert (tmp_path / "out" / "latest_universal").read_text() == "global_step2_universal"
    same(held, engine("load_universal", 2, STAGE, DTYPE, tmp_path / "out",
                      tmp_path / "loaded.pt"))


def test_universal_bad_input_creates_nothing(cluster, saved, tmp_path):
    """A truncated state file and a missing one: one line, exit 2, no job."""
    cf, co = cluster
    ck, _ = saved
    shutil.copytree(ck / "global_step2_universal", tmp_path / "global_step2_universal")
    f = tmp_path / "global_step2_universal" / "zero" / "2.weight" / "exp_avg.pt"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    src = str(tmp_path / "global_step2_universal")
    r = ptcctl(cf, "import", "cutu", src, "--format", "deepspeed-universal", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(f) in r.stderr
    f.unlink()
    r = ptcctl(cf, "import", "cutu", src, "--format", "deepspeed-universal", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "missing" in r.stderr and str(f) in r.stderr
    existing, _ = co.cluster.call_all("versions", job="cutu")
    assert not any(existing.values())


@pytest.mark.extended
def test_zero3_universal_round_trip(cluster, tmp_path):
    """ZeRO-3 at dp=2 → ``ds_to_universal`` (flat tensors, no ``step.pt``) → a
    job at fsdp=2 → fsdp=3 → ``deepspeed-universal`` export → the engine at 2."""
    cf, co = cluster
    held = engine("save", 2, 3, DTYPE, tmp_path / "ck", tmp_path / "saved.pt")
    to_universal(tmp_path / "ck" / "global_step2")
    out = json.loads(ptcctl(cf, "import", "uni3", str(tmp_path / "ck"), "--format",
                            "deepspeed-universal", "--json").stdout)
    assert "fsdp=2" in out["config"], out
    co.reconfigure("uni3", parse_config("fsdp=3", parse_hosts("h0:2,h1:2")))
    ptcctl(cf, "export", "uni3", str(tmp_path / "out"), "--format", "deepspeed-universal")
    same(held, engine("load_universal", 2, 3, DTYPE, tmp_path / "out", tmp_path / "loaded.pt"))
