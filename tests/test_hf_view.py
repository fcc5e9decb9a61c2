"""``/ptc/<job>/hf/`` read with transformers' own ``from_pretrained``, on real
mounts of two real daemons that hold one copy of everything between them:
models saved by ``save_pretrained`` (LLaMA, Mixtral, GPT-2, Qwen2), imported,
moved to tensor parallelism over both hosts (column splits are gathered, the
other host's pieces read from it), load from h0's mount to the same weights
and logits; a ``names=hf`` preset job loads from the config its sizes give;
a job without Hugging Face names has no such folder."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ptcfs.client.formats.io import import_checkpoint  # noqa: E402
from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import mounted_pair  # noqa: E402
from tests.test_ckpt_hf import ARCHS, INPUT, load, same, saved  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.multihost,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

PRESET = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,ffn=96,names=hf"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with mounted_pair(tmp_path_factory.mktemp("hfview")) as both:
        yield both


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt2", "qwen2"])
def test_from_pretrained_on_the_mount_gives_the_jobs_weights(cluster, tmp_path, arch):
    lc, co = cluster
    m = saved(arch, tmp_path / "in")
    import_checkpoint(co, arch, tmp_path / "in", "hf", progress=False)
    mesh = "fsdp=2,tp=2,ep=2" if arch == "mixtral" else "tp=2"
    co.reconfigure(arch, parse_config(mesh, parse_hosts("h0:2,h1:2" if arch == "mixtral"
                                                        else "h0:1,h1:1")))
    version = co.state(arch).version
    root = lc.mount_dir("h0") / arch
    assert "hf" in os.listdir(root)
    assert os.readlink(root / "hf") == f"versions/{version}/hf"
    hf = root / "hf"
    names = sorted(os.listdir(hf))
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert (hf / "config.json").read_text() == (tmp_path / "in" / "config.json").read_text()
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(m.state_dict()) - _tied(m)
    assert set(index["weight_map"].values()) == {n for n in names if n.endswith(".safetensors")}
    dtype = ARCHS[arch][1]
    m2 = load(hf, dtype)
    same(m.state_dict(), m2.state_dict())
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "in", dtype)(INPUT).logits, m2(INPUT).logits)


def _tied(m) -> set[str]:
    """The names ``save_pretrained`` leaves out: aliases of tied weights."""
    return {"lm_head.weight"} if m.config.tie_word_embeddings else set()


def test_a_preset_job_with_hf_names_loads_from_its_sizes(cluster):
    lc, co = cluster
    ptcctl(lc.cluster_file, "job", "create", "p", "--model", PRESET, "--dtype", "fp32",
           "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "5")
    hf = lc.mount_dir("h1") / "p" / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64
    m = load(hf, torch.float32)
    st = co.state("p")
    for name, value in m.state_dict().items():
        if "rotary" in name:
            continue
        want = torch.from_numpy(co.fetch_tensor(st, name))
        assert torch.equal(value, want), name


def test_a_job_without_hf_names_has_no_hf_folder(cluster):
    lc, _ = cluster
    ptcctl(lc.cluster_file, "job", "create", "g", "--model",
           "gpt:layers=2,hidden=64,heads=4,vocab=128", "--config", "tp=1",
           "--hosts", "h0:1", "--seed", "5")
    root = lc.mount_dir("h0") / "g"
    assert "hf" not in os.listdir(root) and "hf-save" not in os.listdir(root)
    with pytest.raises(FileNotFoundError):
        os.listdir(root / "hf")
    with pytest.raises(FileNotFoundError):  # nor a folder to save_pretrained into
        os.listdir(root / "hf-save")
    with pytest.raises(FileNotFoundError):
        (root / "hf-save" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        os.stat(root / "versions" / "1" / "hf" / "config.json")
