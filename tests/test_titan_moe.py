"""torchtitan's mixture-of-experts checkpoints through ptcfs.

Two gloo ranks started by torchrun run torchtitan's deepseek_v3 (low-rank
attention, a dense first layer, then routed experts stacked in one tensor
per projection, a shared expert, the load-balancing bias) under FSDP2 with
its optimizer, LR scheduler and dataloader, and its ``CheckpointManager``
saves step 2 (``tests/titan_job.py``). ``ptcctl import --format
torchtitan`` takes the folder with no spec file and keeps one tensor per
expert; the job moves to ``fsdp=2,ep=2`` on the other host (each rank
holding half of the experts, whole); ``ptcctl export --format torchtitan``
stacks them again, and torchtitan's ``CheckpointManager`` on a job built
from another seed loads it: every weight, buffer, Adam moment and step, the
optimizer's groups, the LR scheduler, the dataloader and the train state
are what the saving job had, bit for bit. The same for torchtitan's qwen3
with experts, moved to ``tp=2,fsdp=2,ep=2`` over both hosts (``extended``).
A layout ptcfs does not derive (deepseek_v3 with multi-token prediction)
is refused in one line that points to a spec file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install "
                    "'ptcfs[titan]' as deploy/setup.sh does")
pytest.importorskip("transformers", reason="the spec comes from transformers' own models")

from ptcfs.client.formats.common import read_sub  # noqa: E402
from ptcfs.sharding import rank_coords, rank_tensors  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402
from tests.test_titan_ckpt import _holds_what_was_saved, _round_trip, _torchrun  # noqa: E402
from tests.titan_job import EXPERTS, QWEN3_HEAD_DIM, STEP  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

_W1 = "layers.1.moe.routed_experts.inner_experts.w1_EFD"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("titanmoe"), 2, gpus=2) as cc:
        yield cc


def _saved(tmp_path, model: str) -> tuple:
    """torchtitan's job saves ``model``: the folder of what each rank held,
    and the checkpoint's step folder."""
    out = tmp_path / "out"
    out.mkdir()
    _torchrun("save", tmp_path / "orig", out, model)
    return out, tmp_path / "orig" / "checkpoint" / f"step-{STEP}"


def _imported(cf, job: str, step) -> dict:
    imported = json.loads(ptcctl(cf, "import", job, str(step), "--format", "torchtitan",
                                 "--json").stdout)
    assert imported["step"] == STEP and imported["optimizer"] == "adam", imported
    assert imported["config"] == "tp=1,pp=1,dp=1,fsdp=2 on h0:2", imported
    return imported


def test_a_torchtitan_deepseek_v3_checkpoint_round_trips_into_torchtitan(cluster, tmp_path):
    cf, co = cluster
    out, step = _saved(tmp_path, "deepseek_v3")
    imported = _imported(cf, "ds", step)
    assert imported["model"] == (
        "deepseek_v3:layers=2,hidden=64,heads=4,q_lora=16,kv_lora=32,qk_nope=16,qk_rope=8,"
        f"v_head=16,vocab=256,ffn=128,dense_layers=1,experts={EXPERTS},moe_ffn=32,"
        "shared_experts=1,names=torchtitan"), imported
    model = co.state("ds").model_spec()
    assert model.experts == EXPERTS
    rules = {t.name: t.rule for t in model.tensors}
    assert [rules[f"{_W1}.{j}"].expert for j in range(EXPERTS)] == list(range(EXPERTS))
    assert rules["layers.1.moe.router.gate.weight"].expert is None
    assert rules["layers.1.attention.wkv_b.weight"].parts[0].units == 4  # MLA: by heads
    _holds_what_was_saved(co, "ds", out)
    _round_trip(cf, "ds", step, tmp_path, out, "deepseek_v3", to="fsdp=2,ep=2")
    assert co.state("ds").config.degrees_text().startswith("tp=1,pp=1,dp=1,fsdp=2,ep=2")
    _each_ep_rank_holds_its_experts(co, "ds", out)


def _each_ep_rank_holds_its_experts(co, job: str, out) -> None:
    """Under fsdp=2,ep=2 each rank holds its expert-parallel rank's experts
    of layer 1's ``w1``, ``[ep_rank * E/2, (ep_rank + 1) * E/2)``, each whole
    (the expert data-parallel group is one rank), as torchtitan saved them."""
    saved = torch.load(out / "save-0.pt")["model"][_W1]
    st = co.state(job)
    model = st.model_spec()
    per = EXPERTS // st.config.ep
    for rank, c in enumerate(rank_coords(st.config)):
        mine = {spec.rule.expert: (spec, sl) for spec, sl in rank_tensors(model, st.config, rank)
                if spec.name.startswith(f"{_W1}.")}
        assert sorted(mine) == list(range(c.ep_rank * per, (c.ep_rank + 1) * per)), rank
        for j, (spec, sl) in mine.items():
            np.testing.assert_array_equal(read_sub(co, st, spec, sl), saved[j].numpy())


@pytest.mark.extended  # the same path as deepseek_v3's; tests/test_titan_models.py checks its spec
def test_a_torchtitan_qwen3_moe_checkpoint_round_trips_into_torchtitan(cluster, tmp_path):
    cf, co = cluster
    out, step = _saved(tmp_path, "qwen3_moe")
    imported = _imported(cf, "q3m", step)
    assert imported["model"] == (
        f"qwen3_moe:layers=2,hidden=64,heads=4,kv_heads=2,head_dim={QWEN3_HEAD_DIM},vocab=256,"
        f"experts={EXPERTS},moe_ffn=32,names=torchtitan"), imported
    _holds_what_was_saved(co, "q3m", out, QWEN3_HEAD_DIM)
    _round_trip(cf, "q3m", step, tmp_path, out, "qwen3_moe", to="tp=2,fsdp=2,ep=2",
                hosts="h1:2,h0:2")


def test_an_unknown_torchtitan_moe_layout_points_to_a_spec_file(cluster, tmp_path):
    """deepseek_v3 with a multi-token-prediction layer is not one ptcfs
    derives: one line naming --model-spec and `ptcctl spec`, no job."""
    from torch.distributed import checkpoint as dcp
    from torchtitan.models.deepseek_v3 import _build_mtp_layers

    from tests.test_titan_ckpt import _refused
    from tests.titan_job import DIM, model_config

    cf, co = cluster
    config = model_config("deepseek_v3")
    config.mtp_layers = _build_mtp_layers(config.layers[-1], dim=DIM, num_mtp_layers=1)
    sd = config.build().state_dict()
    assert any(k.startswith("mtp_layers.") for k in sd)
    dcp.save({**sd, "train_state": {"step": 1}}, checkpoint_id=str(tmp_path / "mtp"),
             no_dist=True)
    err = _refused(cf, co, "ds-mtp", str(tmp_path / "mtp"), "--format", "torchtitan")
    assert "--model-spec" in err and "ptcctl spec" in err and "deepseek_v3" in err, err
    assert "one per expert as <name>.<j>" in err, err
