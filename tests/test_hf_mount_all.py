"""Every architecture of tests/test_hf_spec.py through ``/ptc/<job>/hf/`` and
``hf-save/``, with transformers' own ``from_pretrained`` and
``save_pretrained``, on real mounts of two real daemons: a tiny random model
of each kind (fp32; bf16 too, extended), imported with no spec and moved to tp=2 over both
hosts (a MoE to fsdp=2,tp=2,ep=2 on four ranks), loads from h0's mount to
the same weights, bit for bit, and the same logits; a changed copy saved
into h1's ``hf-save/`` becomes the next version, which ``hf/`` serves (its
config files too) and the store holds (every tensor, as ``ptcctl tensor
get`` reads it).

A few kinds run by default (fused query/key/value, MLA, a MoE, Gemma's
files); every other kind is ``extended``. Kinds that cannot work are in
:data:`REFUSED` with their reason."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from ptcfs.client.formats.io import import_checkpoint  # noqa: E402
from ptcfs.client.torch.state import TORCH_DTYPES  # noqa: E402
from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import mounted_pair  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402
from tests.test_hf_spec import KINDS, NO_FORWARD, SKIP, _logits, files, saved  # noqa: E402
from tests.test_hf_view import PRESET  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.multihost,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

#: the default run's kinds: fused qkv (phi3), MLA with routed and shared
#: experts (deepseek_v3), a MoE with its experts as modules (qwen3_moe), and
#: gemma's scaled, tied embedding and generation_config.json
DEFAULT = ("phi3", "deepseek_v3", "qwen3_moe", "gemma2")
#: a MoE's mesh: experts cut by expert too, on four ranks of both hosts
MOE = ("fsdp=2,tp=2,ep=2", "h0:2,h1:2")
#: kinds that cannot go through the mount, with the reason
REFUSED: dict[str, str] = dict(SKIP)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with mounted_pair(tmp_path_factory.mktemp("hfall")) as both:
        yield both


def _changed(m, dtype):
    """``m`` with every parameter moved (tied ones once), to values of the
    job's ``dtype`` (a router transformers keeps in fp32 included)."""
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_((p + 0.125 * (i % 3 + 1)).to(dtype))
    return m


def _load(root, kind: str, dtype):
    """from_pretrained's model of ``root`` and its logits (None where the
    kind's forward fails in transformers itself: test_hf_spec.NO_FORWARD)."""
    if kind not in NO_FORWARD:
        return _logits(root, dtype)
    return T.AutoModelForCausalLM.from_pretrained(root, dtype=dtype).eval(), None


def _bytes(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
        assert torch.equal(v.reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def _through_the_mount(cluster, tmp_path, kind: str, dtype=torch.float32) -> None:
    if kind in REFUSED:
        pytest.skip(REFUSED[kind])
    lc, co = cluster
    job = f"{kind.replace('_', '-')}-{str(dtype)[6:]}"
    saved(kind, tmp_path / "in", dtype)
    st = import_checkpoint(co, job, tmp_path / "in", "hf", progress=False).state
    mesh, hosts = MOE if st.model_spec().experts else ("tp=2", "h0:1,h1:1")
    co.reconfigure(job, parse_config(mesh, parse_hosts(hosts)))
    # (a) from_pretrained on h0's hf/ (h1's pieces read from h1)
    hf = lc.mount_dir("h0") / job / "hf"
    assert json.loads((hf / "config.json").read_text()) == \
        json.loads((tmp_path / "in" / "config.json").read_text())
    if (tmp_path / "in" / "generation_config.json").exists():
        assert (hf / "generation_config.json").read_text() == \
            (tmp_path / "in" / "generation_config.json").read_text()
    _same(files(tmp_path / "in"), files(hf))
    m0, want = _load(tmp_path / "in", kind, dtype)
    m1, got = _load(hf, kind, dtype)
    _same(m0.state_dict(), m1.state_dict())
    assert (want is None and got is None) or torch.equal(want, got)
    # (b) save_pretrained of changed weights into h1's hf-save/
    before = co.state(job)
    _changed(m1, dtype)
    m1.save_pretrained(tmp_path / "ref", max_shard_size="100KB")
    m1.save_pretrained(lc.mount_dir("h1") / job / "hf-save", max_shard_size="100KB")
    st = co.state(job)
    assert st.version > before.version and st.step == before.step
    assert os.readlink(hf.parent / "hf") == f"versions/{st.version}/hf"
    for name in ("config.json", "generation_config.json"):  # the saved ones, served
        if (tmp_path / "ref" / name).exists():
            assert (hf / name).read_text() == (tmp_path / "ref" / name).read_text()
    m2 = T.AutoModelForCausalLM.from_pretrained(hf, dtype=dtype)
    _same(m1.state_dict(), m2.state_dict())
    ref = files(tmp_path / "ref")
    specs = st.model_spec().tensors_for(st.config.pp)
    assert {t.name for t in specs if not t.is_optim} == set(ref)
    # a tensor transformers keeps in a dtype of its own (Apertus's xIELU alpha in bf16,
    # ERNIE-4.5-MoE's router in fp32) is held in the job's, exactly
    held = {t.name: ref[t.name].to(TORCH_DTYPES[t.dtype]) for t in specs}
    for t in specs:
        assert co.fetch_tensor(st, t.name).tobytes() == _bytes(held[t.name]), t.name
    last = specs[-1].name  # and as the command line reads it
    out = tmp_path / "t.npy"
    ptcctl(lc.cluster_file, "tensor", "get", job, last, "--out", str(out))
    assert np.load(out).tobytes() == _bytes(held[last])


@pytest.mark.parametrize("kind", DEFAULT)
def test_hf_view_and_save_of_an_architecture(cluster, tmp_path, kind):
    _through_the_mount(cluster, tmp_path, kind)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("kind,dtype", [
    pytest.param(k, d, id=f"{k}-{str(d)[6:]}") for d in (torch.float32, torch.bfloat16)
    for k in sorted(KINDS) if not (k in DEFAULT and d == torch.float32)])
def test_hf_view_and_save_of_every_other_architecture(cluster, tmp_path, kind, dtype):
    _through_the_mount(cluster, tmp_path, kind, dtype)


def test_a_model_loaded_narrower_than_the_job_is_refused(cluster, tmp_path):
    """An fp32 job loaded with ``dtype=bfloat16`` and saved back would lose
    its low bits: refused in one line, the job as it was."""
    lc, co = cluster
    ptcctl(lc.cluster_file, "job", "create", "narrow", "--model", PRESET, "--dtype", "fp32",
           "--config", "tp=2", "--hosts", "h0:1,h1:1", "--seed", "3")
    before = co.state("narrow")
    root = lc.mount_dir("h0") / "narrow"
    m = T.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.bfloat16)
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error wraps the EINVAL
        m.save_pretrained(root / "hf-save")
    why = (root / "hf-save" / ".refused").read_text()
    assert why.count("\n") == 1 and "is bf16; the job holds it as fp32 with values bf16 " \
        "cannot hold (load the model with the job's dtype, fp32, before saving it)" in why
    assert co.state("narrow").version == before.version
