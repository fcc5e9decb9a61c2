"""DeepSpeed universal checkpoints, proved with DeepSpeed's own code: its
engine on CPU saves one ZeRO-2 checkpoint at dp=2 for the module, which its
``ds_to_universal`` converts. A ``deepspeed`` export carries the
``param_slice_mappings`` that ``ds_to_universal`` needs; the engine with
``load_universal`` loads the conversion with every weight, fp32 master and
Adam moment bit for bit as the saving engine held them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

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
