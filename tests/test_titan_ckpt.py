"""torchtitan's own checkpoints through ptcfs.

Two gloo ranks started by torchrun run torchtitan's llama3 (its fused
query/key/value projection) under FSDP2 with its optimizer, LR scheduler and
dataloader, and its ``CheckpointManager`` saves step 2 (``tests/titan_job.py``).
``ptcctl import --format torchtitan`` takes the folder with no spec file, the
job moves to tp=2 on the other host, ``ptcctl export --format torchtitan``
writes it back, and torchtitan's ``CheckpointManager`` on a job built from
another seed loads it: every weight, Adam moment and step, the optimizer's
groups, the LR scheduler and the train state are what the saving job had,
bit for bit, its dataloader yields the batch the saving job's yields next,
and the trainer's entries in the export are the bytes the original stored.
The same for torchtitan's qwen3 (dense), with no ``--heads`` (``extended``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install "
                    "'ptcfs[titan]' as deploy/setup.sh does")

from torch.distributed import checkpoint as dcp  # noqa: E402

from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.dcp.titan import ENTRIES  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402
from tests.titan_job import DIM, HEADS, KV_HEADS, QWEN3_HEAD_DIM, STEP  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("titan"), 2, gpus=2) as cc:
        yield cc


def _torchrun(mode: str, base: Path, out: Path, model: str = "llama3", *more: str) -> None:
    """``tests/titan_job.py MODE BASE OUT MODEL [MORE...]`` on two ranks."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(ROOT / "tests" / "titan_job.py"), mode,
                        str(base), str(out), model, *more], capture_output=True, text=True,
                       timeout=300,
                       env=env)
    assert r.returncode == 0, f"titan_job {mode} failed ({r.returncode}):\n{r.stderr[-3000:]}"


def _same(a: Any, b: Any, where: str) -> None:
    """Equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, (where, a, b)


def _split(fused: torch.Tensor, head_dim: int = DIM // HEADS) -> dict[str, torch.Tensor]:
    """torchtitan's own split of a fused wqkv tensor (its state-dict hook)."""
    from torchtitan.models.common.attention import FusedQKVLinear

    per = HEADS // KV_HEADS
    sd = {"wqkv.weight": fused}
    FusedQKVLinear._split_qkv_on_save(SimpleNamespace(head_dim=head_dim, heads_per_kv=per,
                                                      r_dim=per + 2), sd, "", None)
    return sd


def _entries(path: Path, keys: list[str]) -> dict[str, Any]:
    sd: dict[str, Any] = {k: None for k in keys}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def _absent(co: Coordinator, job: str) -> None:
    versions, _ = co.cluster.call_all("versions", job=job)
    assert not any(versions.values()), versions


def _refused(cf: Path, co: Coordinator, job: str, *args: str) -> str:
    r = ptcctl(cf, "import", job, *args, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    _absent(co, job)
    return r.stderr


def test_a_torchtitan_checkpoint_round_trips_into_torchtitan(cluster, tmp_path):
    cf, co = cluster
    out = tmp_path / "out"
    out.mkdir()
    _torchrun("save", tmp_path / "orig", out)
    step = tmp_path / "orig" / "checkpoint" / f"step-{STEP}"

    assert "--format torchtitan" in _refused(cf, co, "tt-dcp", str(step), "--format", "torch-dcp")
    assert "--heads" in _refused(cf, co, "tt-nh", str(step), "--format", "torchtitan")
    imported = json.loads(ptcctl(cf, "import", "tt", str(step), "--format", "torchtitan",
                                 "--heads", str(HEADS), "--json").stdout)
    assert imported["step"] == STEP and imported["optimizer"] == "adam", imported
    assert imported["model"].startswith("llama:layers=2,hidden=64,heads=4,kv_heads=2"), imported
    assert imported["config"] == "tp=1,pp=1,dp=1,fsdp=2 on h0:2", imported
    assert any("from its chunks" in n for n in imported["notes"]), imported["notes"]

    _holds_what_was_saved(co, "tt", out)
    _round_trip(cf, "tt", step, tmp_path, out)


def _holds_what_was_saved(co: Coordinator, job: str, out: Path,
                          head_dim: int = DIM // HEADS, dump: str = "save-0.pt") -> None:
    """The job's tensors are the saved ones (``out/dump``); the fused moments
    split as torchtitan splits them, the stacked experts one tensor per expert."""
    saved = torch.load(out / dump)
    st = co.state(job)
    want: dict[str, torch.Tensor] = {}
    for name, t in saved["model"].items():
        want.update(_experts(name, t))
    for key, value in saved["optimizer"].items():
        _, _, rest = key.partition(".")
        param, _, kind = rest.rpartition(".")
        if key.startswith("state.") and kind in ("exp_avg", "exp_avg_sq"):
            if param.endswith(".wqkv.weight"):
                base = param[: -len("wqkv.weight")]
                for part, t in _split(value, head_dim).items():
                    want[f"optim/{kind}/{base}{part}"] = t
            else:
                want.update(_experts(f"optim/{kind}/{param}", value))
    names = {s.name for s in st.model_spec().tensors}
    buffers = {n for n in names - set(want) if n.startswith("optim/")
               and n.split("/", 2)[2] in saved["model"] and n.endswith("expert_bias_E")}
    for name in buffers:  # a buffer has no optimizer state: the job's moments are zeros
        assert not co.fetch_tensor(st, name).any(), name
    assert sorted(want) == sorted(names - buffers)
    for name, t in want.items():
        np.testing.assert_array_equal(co.fetch_tensor(st, name), t.numpy(), name)


def _experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tensor as the job keeps it: torchtitan's stacked experts one per expert."""
    if ".moe.routed_experts.inner_experts." not in name:
        return {name: t}
    return {f"{name}.{j}": t[j] for j in range(t.shape[0])}


def _round_trip(cf: Path, job: str, step: Path, tmp_path: Path, out: Path,
                model: str = "llama3", to: str = "tp=2", hosts: str = "h1:2") -> None:
    """The job moves to ``to`` on ``hosts`` (tp=2 on the other host), is
    exported, and torchtitan loads it: the trainer's entries as they were
    stored, every rank's state as the saving job had it."""
    ptcctl(cf, "reconfigure", job, "--to", to, "--hosts", hosts)
    export = tmp_path / "export"
    ptcctl(cf, "export", job, str(export / "checkpoint" / f"step-{STEP}"), "--format",
           "torchtitan")
    entries = [k for k, m in dcp.FileSystemReader(str(step)).read_metadata()
               .state_dict_metadata.items() if k.split(".")[0] in ENTRIES]
    assert len(entries) == 6, entries  # step, ntokens_seen, last_epoch, 2 dataloader ranks, size
    _same(_entries(step, entries), _entries(export / "checkpoint" / f"step-{STEP}", entries),
          "entries")
    _torchrun("load", export, out, model)
    for r in (0, 1):
        _same(torch.load(out / f"save-{r}.pt"), torch.load(out / f"load-{r}.pt"), f"rank {r}")


@pytest.mark.extended  # the same path as llama3's; tests/test_titan_models.py checks its spec
def test_a_torchtitan_qwen3_checkpoint_round_trips_into_torchtitan(cluster, tmp_path):
    """qwen3 (dense): its per-head norms and a head size other than
    hidden / heads; the heads come from the shapes, a --heads that
    disagrees is refused."""
    cf, co = cluster
    out = tmp_path / "out"
    out.mkdir()
    _torchrun("save", tmp_path / "orig", out, "qwen3")
    step = tmp_path / "orig" / "checkpoint" / f"step-{STEP}"

    assert "4 heads" in _refused(cf, co, "q3-bad", str(step), "--format", "torchtitan",
                                 "--heads", "8")
    imported = json.loads(ptcctl(cf, "import", "q3", str(step), "--format", "torchtitan",
                                 "--json").stdout)
    assert imported["step"] == STEP and imported["optimizer"] == "adam", imported
    assert imported["model"] == (f"qwen3:layers=2,hidden=64,heads=4,kv_heads=2,"
                                 f"head_dim={QWEN3_HEAD_DIM},vocab=256,ffn=128,"
                                 "names=torchtitan"), imported
    assert imported["config"] == "tp=1,pp=1,dp=1,fsdp=2 on h0:2", imported
    _holds_what_was_saved(co, "q3", out, QWEN3_HEAD_DIM)
    _round_trip(cf, "q3", step, tmp_path, out, "qwen3")


def test_bad_torchtitan_input_is_refused_and_creates_nothing(cluster, tmp_path):
    cf, co = cluster
    other = tmp_path / "other"
    dcp.save({"train_state": {"step": 3}, "encoder.weight": torch.ones(4, 4)},
             checkpoint_id=str(other), no_dist=True)
    err = _refused(cf, co, "tt-other", str(other), "--format", "torchtitan")
    assert "--model-spec" in err and "ptcctl spec" in err, err
    plain = tmp_path / "plain"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(plain), no_dist=True)
    assert "--format torch-dcp" in _refused(cf, co, "tt-plain", str(plain), "--format",
                                            "torchtitan")
    assert "no .metadata" in _refused(cf, co, "tt-none", str(tmp_path), "--format", "torchtitan")
    # a truncated data file: its entries cannot be kept, nothing is created
    cut = tmp_path / "cut"
    shutil.copytree(other, cut)
    data = next(cut.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    assert "truncated" in _refused(cf, co, "tt-cut", str(cut), "--format", "torchtitan")
