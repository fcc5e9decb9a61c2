"""``save_pretrained`` into ``/ptc/<job>/hf-save/`` with transformers' own
code, on real mounts of two real daemons: a changed model (LLaMA, GPT-2
and Mixtral sharded, Qwen2 unsharded) becomes the job's next version at its
step, which ``from_pretrained`` on ``hf/`` loads bit for bit, to the same
logits, and ``ptcctl tensor get`` agrees; a bf16 job with Adam keeps its
moments, and its fp32 masters follow only the elements that changed; bad
saves (other shapes, a writer that dies half-way, a second writer,
another user) get one error and change nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.formats.io import import_checkpoint  # noqa: E402
from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import mounted_for_all  # noqa: E402
from tests.test_ckpt_hf import ARCHS, INPUT, load, same, saved  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402
from tests.test_hf_view import PRESET, pytestmark  # noqa: E402, F401 - the view's marks
from tests.test_store_modes import NOBODY  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """Two hosts, mounted, in a folder every user may enter."""
    with mounted_for_all("ptc-hfsave-", 2) as lc:
        co = Coordinator(Cluster.load(lc.cluster_file))
        yield lc, co
        co.cluster.close()


def _changed(m):
    """``m`` with every parameter moved (tied ones once)."""
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.add_(0.25 * (i % 3 + 1))
    return m


@pytest.mark.parametrize("arch,shard,mesh", [
    ("llama", "40KB", "tp=2"), ("qwen2", None, "pp=2"), ("gpt2", "30KB", "tp=2"),
    ("mixtral", "60KB", "fsdp=2,tp=2,ep=2")])
def test_save_pretrained_into_the_mount_becomes_the_next_version(cluster, tmp_path, arch,
                                                                  shard, mesh):
    """Qwen2 ties its output layer to the embedding: under pp=2 the last
    stage's copy is filled from the saved embedding; Mixtral's experts are
    cut by expert."""
    lc, co = cluster
    saved(arch, tmp_path / "in")
    import_checkpoint(co, arch, tmp_path / "in", "hf", progress=False)
    hosts = "h0:2,h1:2" if arch == "mixtral" else "h0:1,h1:1"
    co.reconfigure(arch, parse_config(mesh, parse_hosts(hosts)))
    before = co.state(arch)
    root = lc.mount_dir("h0") / arch
    assert {"hf", "hf-save"} <= set(os.listdir(root)) and os.listdir(root / "hf-save") == []
    dtype = ARCHS[arch][1]
    m = _changed(load(root / "hf", dtype))
    kw = {"max_shard_size": shard} if shard else {}
    m.save_pretrained(tmp_path / "ref", **kw)
    m.save_pretrained(root / "hf-save", **kw)
    st = co.state(arch)
    assert st.version > before.version and st.step == before.step
    assert os.listdir(root / "hf-save") == []
    assert os.readlink(root / "hf") == f"versions/{st.version}/hf"
    assert (root / "hf" / "config.json").read_text() == \
        (tmp_path / "ref" / "config.json").read_text()
    m2 = load(root / "hf", dtype)
    same(m.state_dict(), m2.state_dict())
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "ref", dtype)(INPUT).logits, m2(INPUT).logits)
    specs = st.model_spec().tensors_for(st.config.pp)
    for t in specs:  # every tensor of the new version, the tied copy under pp=2 too
        want = m.state_dict()[t.name].contiguous().view(torch.uint8)
        got = torch.from_numpy(co.fetch_tensor(st, t.name))
        assert torch.equal(got.view(torch.uint8), want), t.name
    for t in (specs[0], specs[-1]):  # and as the command line gets them
        out = tmp_path / "t.npy"
        ptcctl(lc.cluster_file, "tensor", "get", arch, t.name, "--out", str(out))
        got = torch.from_numpy(np.load(out))
        assert torch.equal(got.view(torch.uint8), m.state_dict()[t.name].contiguous().view(
            torch.uint8)), t.name


def test_a_job_with_adam_keeps_its_moments(cluster, tmp_path):
    """bf16 with Adam: exp_avg/exp_avg_sq stay bit for bit; the fp32 master of
    an element the save changed is its new value, of the others the old one."""
    lc, co = cluster
    ptcctl(lc.cluster_file, "job", "create", "adam", "--model", PRESET, "--dtype", "bf16",
           "--optimizer", "adam", "--config", "tp=2,zero=1,dp=2", "--hosts", "h0:2,h1:2",
           "--seed", "5")
    before = co.state("adam")
    old = {t.name: co.fetch_tensor(before, t.name) for t in before.model_spec().tensors}
    root = lc.mount_dir("h1") / "adam"
    m = load(root / "hf", torch.bfloat16)
    target = "model.layers.0.mlp.up_proj.weight"
    with torch.no_grad():
        m.get_parameter(target)[:4] += 1.0
    m.save_pretrained(root / "hf-save", max_shard_size="50KB")
    st = co.state("adam")
    assert st.version > before.version and st.step == before.step
    for t in st.model_spec().tensors:
        got = co.fetch_tensor(st, t.name)
        if t.name.startswith("optim/master/"):
            p = t.name.removeprefix("optim/master/")
            want = m.get_parameter(p).detach().float().numpy() if p == target else old[t.name]
            if p == target:  # rows 4: unchanged, so their masters keep their low bits
                want[4:] = old[t.name][4:]
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), t.name)
        elif t.is_optim:
            np.testing.assert_array_equal(got, old[t.name], t.name)
        else:
            want = m.get_parameter(t.name).detach().view(torch.uint16).numpy()
            np.testing.assert_array_equal(got, want, t.name)
    assert not np.array_equal(co.fetch_tensor(st, f"optim/master/{target}")[:4],
                              old[f"optim/master/{target}"][:4])


#: a writer that writes config.json and half of a weights file, says so, and waits
HALF = r"""
import sys, pathlib
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(dst / "config.json").write_text((src / "config.json").read_text())
data = (src / "model.safetensors").read_bytes()
with open(dst / "model.safetensors", "wb") as f:
    f.write(data[: len(data) // 2])
    f.flush()
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_bad_saves_change_nothing(cluster, tmp_path):
    lc, co = cluster
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", "bad", "--model", PRESET, "--dtype", "fp32", "--config",
           "tp=2", "--hosts", "h0:1,h1:1", "--seed", "7")
    before = co.state("bad")
    root = lc.mount_dir("h0") / "bad"
    save = root / "hf-save"
    # a model of other shapes: refused at its weights' header, one line
    T = transformers
    other = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=256, hidden_size=32,
                                             intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error wraps the EINVAL
        other.save_pretrained(save)
    why = (save / ".refused").read_text()
    assert "weight is fp32 [256, 32]; the job holds it as fp32 [256, 64]" in why
    assert why.startswith("/bad/hf-save/model.safetensors: ") and why.count("\n") == 1
    assert os.listdir(save) == [".refused"] and co.state("bad").version == before.version
    # the job's tensors under a config.json of another model, copied in (no
    # rename): refused at the close of the file that completes the save
    good = load(root / "hf", torch.float32)
    good.save_pretrained(tmp_path / "ref")
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    (save / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(OSError) as e:
        shutil.copyfile(tmp_path / "ref" / "model.safetensors", save / "model.safetensors")
    assert e.value.errno == errno.EINVAL
    why = (save / ".refused").read_text()
    assert why.startswith("/bad/hf-save/config.json: describes another model than the job's")
    assert os.listdir(save) == [".refused"] and co.state("bad").version == before.version
    # a writer that dies half-way, and a second writer while it lives
    half = subprocess.Popen([sys.executable, "-c", HALF, str(tmp_path / "ref"), str(save)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert half.stdout is not None and half.stdout.readline() == "ready\n"
        assert sorted(os.listdir(save)) == ["config.json", "model.safetensors"]
        with pytest.raises(OSError) as e:
            good.save_pretrained(save)
        assert e.value.errno == errno.EBUSY
    finally:
        half.send_signal(signal.SIGKILL)
        half.wait()
    assert co.state("bad").version == before.version
    # another user: not the job's owner (uid 65534, where this runs as root)
    if os.geteuid() == 0 and shutil.which("setpriv") is not None:
        out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                              "--clear-groups", "sh", "-c", f": > {save}/config.json"],
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode != 0 and "Permission denied" in out.stderr
        assert co.state("bad").version == before.version
    # the next save drops the dead writer's and commits
    with torch.no_grad():
        good.lm_head.weight.mul_(2)
    good.save_pretrained(save)
    st = co.state("bad")
    assert st.version > before.version
    np.testing.assert_array_equal(co.fetch_tensor(st, "lm_head.weight"),
                                  good.lm_head.weight.detach().numpy())
    assert json.loads((root / "hf" / "config.json").read_text())["hidden_size"] == 64
