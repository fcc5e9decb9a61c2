"""Megatron-Core: the presets' names against megatron-core's own GPTModel, and
torch_dist checkpoints written by megatron-core's ``dist_checkpointing.save``
imported, reconfigured, exported and loaded back with
``dist_checkpointing.load``, tensor by tensor with the optimizer state.

megatron-core runs on CPU with a one-process gloo group; its checkpoint
writer calls ``torch.cuda.synchronize`` and ``torch.cuda.current_device``,
which the ``cpu_writer`` fixture stubs (the files it writes are the same).
Its optimizers need CUDA, so the optimizer state is made as Megatron-Core's
optimizers save it: Adam's tensors, mapped onto the parameters' sharded keys
by ``make_sharded_optimizer_tensor`` (``optimizer.state.<kind>.<key>``).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install 'ptcfs[mcore]')")

from ptcfs.client.formats.mcore_keys import Place, candidates, place_of  # noqa: E402
from ptcfs.client.torch.state import to_numpy  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 300
LLAMA = "layers=2,hidden=64,heads=4,kv_heads=2,vocab=300,ffn=96"


@pytest.fixture(scope="module")
def mcore(tmp_path_factory):
    """megatron-core on a one-process gloo group, tp = pp = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture
def cpu_writer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("mcore"), 2) as cc:
        yield cc


def gpt_model(padded: int, experts: int | None = None, gpt: bool = False):
    """A bf16 Megatron-Core GPTModel of the local layer spec: LLaMA-like (RMSNorm,
    SwiGLU, GQA, untied) or, with ``gpt``, GPT-2-like (LayerNorm, biases,
    learned positions, tied); ``padded``: the padded vocabulary."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    norm = "LayerNorm" if gpt else "RMSNorm"
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4 if gpt else 2,
        ffn_hidden_size=96, normalization=norm, gated_linear_unit=not gpt,
        add_bias_linear=gpt, use_cpu_initialization=True, params_dtype=torch.bfloat16,
        bf16=True, num_moe_experts=experts, moe_router_topk=2,
        activation_func=torch.nn.functional.gelu if gpt else torch.nn.functional.silu)
    spec = get_gpt_layer_local_spec(num_experts=experts, normalization=norm)
    m = GPTModel(cfg, spec, vocab_size=padded, max_sequence_length=32,
                 position_embedding_type="learned_absolute" if gpt else "rope",
                 share_embeddings_and_output_weights=gpt)
    return m.bfloat16()


def trained(m):
    """Random weights, and two Adam steps on fp32 masters: name → (param,
    master, exp_avg, exp_avg_sq)."""
    torch.manual_seed(0)
    out = {}
    for n, p in m.named_parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.02)
        out[n] = p.detach().float().clone().requires_grad_()
    opt = torch.optim.Adam(out.values(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        sum(((p - 0.1) ** 2).sum() for p in out.values()).backward()
        opt.step()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(out[n])
    return {n: (p.detach(), out[n].detach(), opt.state[out[n]]["exp_avg"],
                opt.state[out[n]]["exp_avg_sq"]) for n, p in m.named_parameters()}


def optimizer_sd(msd, state, fill=None):
    """Optimizer state as Megatron-Core's optimizers shard it (module docstring);
    ``fill``: fresh tensors to load into instead of ``state``'s."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    out = {}
    for name, (_, master, avg, sq) in state.items():
        for kind, t in (("fp32_param", master), ("exp_avg", avg), ("exp_avg_sq", sq)):
            data = torch.empty(msd[name].data.shape) if fill else t
            out[f"{name}.{kind}"] = make_sharded_optimizer_tensor(
                msd[name], data, prefix=f"optimizer.state.{kind}")
    return out


def save_megatron(m, state, root, args):
    """``root`` as Megatron-LM's torch_dist save leaves it, iteration 5."""
    from megatron.core import dist_checkpointing

    it = root / "iter_0000005"
    it.mkdir(parents=True)
    msd = m.sharded_state_dict()
    dist_checkpointing.save({"model": msd, "optimizer": optimizer_sd(msd, state), "args": args,
                             "iteration": 5, "checkpoint_version": 3.0}, str(it))
    (root / "latest_checkpointed_iteration.txt").write_text("5")


def check_job(co, job, state, names, step=5):
    """The job holds every parameter (vocabulary rows unpadded) and its Adam state."""
    st = co.state(job)
    assert st.step == step and st.optimizer == "adam"
    for mname, (param, master, avg, sq) in state.items():
        name = names.get(mname, mname)
        rows = VOCAB if "word_embeddings" in name or "output_layer" in name else None
        for kind, want in (("", param), ("optim/master/", master), ("optim/exp_avg/", avg),
                           ("optim/exp_avg_sq/", sq)):
            got = co.fetch_tensor(st, kind + name)
            np.testing.assert_array_equal(got, to_numpy(want[:rows].contiguous()),
                                          err_msg=kind + name)


def load_back(m, state, path):
    """Our export loaded by ``dist_checkpointing.load`` into ``m`` and fresh
    optimizer tensors; compared with ``state`` (padding rows are zero)."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    # importing megatron.core registers the classes common.pt holds (args) with
    # torch.load; a torch.serialization.safe_globals block that another test
    # entered before that first import takes them away again when it exits
    register_safe_globals()
    it = path / "iter_0000005"
    assert json.loads((it / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (path / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    msd = m.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": msd, "optimizer": optimizer_sd(msd, state, True)},
                                     str(it))
    m.load_state_dict(loaded["model"])
    common = dist_checkpointing.load_common_state_dict(str(it))
    assert common["iteration"] == 5 and common["args"].padded_vocab_size == \
        m.embedding.word_embeddings.weight.shape[0]
    got = dict(m.named_parameters())
    for name, (param, master, avg, sq) in state.items():
        opt = {k: loaded["optimizer"][f"{name}.{k}"] for k in ("fp32_param", "exp_avg",
                                                                "exp_avg_sq")}
        for what, want, have in (("param", param, got[name].detach()),
                                 ("fp32_param", master, opt["fp32_param"]),
                                 ("exp_avg", avg, opt["exp_avg"]),
                                 ("exp_avg_sq", sq, opt["exp_avg_sq"])):
            n = VOCAB if "word_embeddings" in name or "output_layer" in name else len(want)
            assert torch.equal(have[:n], want[:n]), (what, name)
            assert not have[n:].any(), (what, name, "padding")


def test_preset_names_are_megatron_core_names(mcore):
    """norms=local: the state dict's parameters, in order; norms=te: the
    sharded keys Megatron-Core saves (the fused norm names)."""
    for text, kw in ((f"llama:{LLAMA},norms=local", {}),
                     (f"moe:{LLAMA},experts=4,norms=local", {"experts": 4}),
                     ("gpt:layers=2,hidden=64,heads=4,vocab=384,ffn=96,seq=32,names=mcore,"
                      "norms=local", {"gpt": True})):
        m = gpt_model(384, **kw)
        spec = parse_model(text.replace("vocab=300", "vocab=384"))
        assert [s.name for s in spec.tensors] == [n for n, _ in m.named_parameters()], text
        shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
        assert {s.name: s.shape for s in spec.tensors} == shapes
        moe = "experts" in kw
        keys = {sh.key for sh in m.sharded_state_dict().values() if hasattr(sh, "key")}
        assert {place_of(s.name, moe, "local").key for s in spec.tensors} <= keys
    # the TE spec's fused norms are the keys both specs save
    assert place_of("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == Place(
        "decoder.layers.mlp.linear_fc1.layer_norm_weight", (3,))
    assert place_of("decoder.layers.1.pre_mlp_layernorm.weight", True, "te") == Place(
        "decoder.layers.pre_mlp_layernorm.weight", (1,))
    assert [p.key for p in candidates("optim/master/decoder.layers.0.mlp.experts."
                                      "local_experts.2.linear_fc2.weight", True)] == [
        "optimizer.state.fp32_param.decoder.layers.mlp.experts.experts.linear_fc2.weight",
        "optimizer.state.param.decoder.layers.mlp.experts.experts.linear_fc2.weight"]


@pytest.mark.parametrize("kind", ["llama", "moe", "gpt"])
def test_torch_dist_round_trip_through_a_reconfiguration(mcore, cpu_writer, cluster, tmp_path,
                                                         kind):
    cf, co = cluster
    kw = {"llama": {}, "moe": {"experts": 4}, "gpt": {"gpt": True}}[kind]
    m = gpt_model(384, **kw)
    state = trained(m)
    args = argparse.Namespace(num_attention_heads=4, vocab_size=VOCAB, padded_vocab_size=384,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              transformer_impl="local", moe_router_topk=2)
    save_megatron(m, state, tmp_path / "meg", args)
    job = f"mc{kind}"
    out = json.loads(ptcctl(cf, "import", job, str(tmp_path / "meg"), "--format", "mcore",
                            "--json").stdout)
    want = {"llama": f"llama:{LLAMA},tied=0,norms=local",
            "moe": f"moe:{LLAMA},tied=0,norms=local,experts=4,topk=2",
            "gpt": "gpt:layers=2,hidden=64,heads=4,vocab=300,ffn=96,seq=32,swiglu=0,"
                   "names=mcore,norms=local,tied=1"}[kind]
    assert (out["model"], out["dtype"], out["optimizer"], out["step"]) == (want, "bf16", "adam",
                                                                           5)
    check_job(co, job, state, {})
    to = "tp=2,dp=2,ep=2" if kind == "moe" else "tp=2,pp=2"
    ptcctl(cf, "reconfigure", job, "--to", to, "--hosts", "h0:2,h1:2")
    check_job(co, job, state, {})
    ptcctl(cf, "export", job, str(tmp_path / "out"), "--format", "mcore")
    # tp=2 pads the vocabulary to 512: what Megatron-LM at tp=2 loads
    load_back(gpt_model(512, **kw), state, tmp_path / "out")


def test_bad_torch_dist_checkpoints_fail_with_one_line(cluster, tmp_path):
    cf, _ = cluster
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("7")
    it = tmp_path / "b" / "iter_0000007"
    it.mkdir(parents=True)
    (it / ".metadata").write_bytes(b"")
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    for src, says in ((tmp_path / "a", "iter_0000007: no .metadata"),
                      (it, "sharded_backend is 'zarr'; only torch_dist")):
        r = ptcctl(cf, "import", "bad", str(src), "--format", "mcore", check=False)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
