"""ptcctl import/export: checkpoints built by torch itself in each format's real
layout go into a job and come back out, tensor by tensor."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ptcfs.client.conn import Cluster  # noqa: E402
from ptcfs.client.coordinator import Coordinator  # noqa: E402
from ptcfs.client.torchmodule import logical_module  # noqa: E402
from ptcfs.client.torchstate import to_numpy  # noqa: E402
from ptcfs.presets import parse_model  # noqa: E402
from tests.daemons import running  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=300,seq=32"
HEAD = "word_embeddings_for_head.weight"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(tmp_path_factory.mktemp("ckpt"), 2) as lc:
        c = Cluster.load(lc.cluster_file)
        try:
            yield lc.cluster_file, Coordinator(c)
        finally:
            c.close()


@pytest.fixture(scope="module")
def trained():
    """A model with the job's names after two Adam steps, and its optimizer."""
    torch.manual_seed(0)
    m = logical_module(parse_model(MODEL, dtype="fp32"))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        sum(((p - 0.1) ** 2).sum() for p in m.parameters()).backward()
        opt.step()
    return m, opt


def params(m) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in m.named_parameters()}


def check_job(co: Coordinator, job: str, m, opt, step: int = 2) -> None:
    st = co.state(job)
    assert st.step == step and st.optimizer == "adam"
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(co.fetch_tensor(st, n), to_numpy(p), err_msg=n)
        for kind in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/{kind}/{n}"),
                                          to_numpy(opt.state[p][kind]), err_msg=f"{kind} {n}")


def test_torch_save_round_trip(cluster, trained, tmp_path):
    cf, co = cluster
    m, opt = trained
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 2},
               tmp_path / "ckpt.pt")
    out = json.loads(ptcctl(cf, "import", "tsave", str(tmp_path / "ckpt.pt"), "--format", "torch",
                            "--heads", "4", "--config", "tp=2", "--hosts", "h0:1,h1:1",
                            "--json").stdout)
    assert out["model"] == "gpt:layers=4,hidden=64,heads=4,vocab=300,ffn=256,seq=32,swiglu=0"
    assert (out["config"], out["optimizer"], out["step"]) == ("tp=2,pp=1,dp=1 on h0:1,h1:1",
                                                              "adam", 2)
    check_job(co, "tsave", m, opt)
    ptcctl(cf, "export", "tsave", str(tmp_path / "out"), "--format", "torch")
    # the export loads straight into a module of the job's names and Adam
    back = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    m2 = logical_module(parse_model(MODEL, dtype="fp32"))
    m2.load_state_dict(back["model"])
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(back["optimizer"])
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][kind], opt2.state[p2][kind]), (kind, n)
    # and imports again as it is (the model is recorded: no --heads)
    ptcctl(cf, "import", "tsave2", str(tmp_path / "out"), "--format", "torch")
    check_job(co, "tsave2", m, opt)


def test_dcp_round_trip(cluster, trained, tmp_path):
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cf, co = cluster
    m, opt = trained
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    assert (tmp_path / "dcp" / ".metadata").is_file()
    ptcctl(cf, "import", "dcp", str(tmp_path / "dcp"), "--format", "torch-dcp", "--heads", "4",
           "--config", "tp=2,dp=2", "--hosts", "h0:2,h1:2")
    check_job(co, "dcp", m, opt)
    ptcctl(cf, "export", "dcp", str(tmp_path / "dcp-out"), "--format", "torch-dcp")
    m2 = logical_module(parse_model(MODEL, dtype="fp32"))
    for p in m2.parameters():
        torch.nn.init.zeros_(p)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    msd2, osd2 = get_state_dict(m2, opt2)
    osd2 = {"state": {n: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)} for n, p in msd2.items()},
            "param_groups": osd2["param_groups"]}
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp-out"))
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][kind], opt2.state[p2][kind]), (kind, n)


def megatron_shards(m, tp: int, pp: int, vocab_size: bool) -> dict[tuple[int, int], dict]:
    """Rank files as Megatron-LM writes them, cut here by hand: column-parallel
    rows, row-parallel columns, the vocabulary padded to 128*tp, local layer
    numbers per stage, the tied head on the last stage."""
    w = params(m)
    layers_per = 4 // pp
    padded = -(-300 // (128 * tp)) * 128 * tp
    emb = torch.cat([w["embedding.word_embeddings.weight"], torch.zeros(padded - 300, 64)])
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4,
                              ffn_hidden_size=256, max_position_embeddings=32,
                              padded_vocab_size=padded, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp)
    if vocab_size:
        args.vocab_size = 300
    cols = ("query_key_value.weight", "query_key_value.bias", "dense_h_to_4h.weight",
            "dense_h_to_4h.bias")
    rows = ("self_attention.dense.weight", "dense_4h_to_h.weight")
    out = {}
    for p in range(pp):
        for t in range(tp):
            enc = {}
            for i in range(p * layers_per, (p + 1) * layers_per):
                for n, v in w.items():
                    if not n.startswith(f"encoder.layers.{i}."):
                        continue
                    rest = n.split(".", 3)[3]
                    if rest.endswith(cols):
                        v = v.chunk(tp, dim=0)[t]
                    elif rest.endswith(rows):
                        v = v.chunk(tp, dim=1)[t]
                    enc[f"layers.{i - p * layers_per}.{rest}"] = v.clone()
            lm: dict = {"encoder": enc}
            model: dict = {"language_model": lm}
            if p == 0:
                lm["embedding"] = {
                    "word_embeddings": {"weight": emb.chunk(tp)[t].clone()},
                    "position_embeddings": {"weight": w["embedding.position_embeddings.weight"]}}
            if p == pp - 1:
                enc["final_layernorm.weight"] = w["encoder.final_layernorm.weight"]
                enc["final_layernorm.bias"] = w["encoder.final_layernorm.bias"]
                if pp > 1:
                    model["word_embeddings_for_head"] = {"weight": emb.chunk(tp)[t].clone()}
            out[(t, p)] = {"args": args, "checkpoint_version": 3.0, "iteration": 2,
                           "model": model, "rng_state": [{"random_rng_state": (3, (1, 2))}]}
    return out


def write_megatron_dir(root, shards, pp: int) -> None:
    for (t, p), sd in shards.items():
        d = root / "iter_0000002" / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
        d.mkdir(parents=True)
        torch.save(sd, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("2")


def test_megatron_round_trip(cluster, trained, tmp_path):
    cf, co = cluster
    m, _ = trained
    shards = megatron_shards(m, tp=2, pp=2, vocab_size=True)
    write_megatron_dir(tmp_path / "meg", shards, pp=2)
    out = json.loads(ptcctl(cf, "import", "meg", str(tmp_path / "meg"), "--format", "megatron",
                            "--config", "tp=1,dp=2", "--hosts", "h0:1,h1:1", "--json").stdout)
    assert out["step"] == 2 and out["optimizer"] == "none" and out["notes"]
    st = co.state("meg")
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(co.fetch_tensor(st, n), to_numpy(p), err_msg=n)
    # export under tp=2, pp=2 gives back the very files' tensors
    ptcctl(cf, "reconfigure", "meg", "--to", "tp=2,pp=2", "--hosts", "h0:2,h1:2")
    ptcctl(cf, "export", "meg", str(tmp_path / "back"), "--format", "megatron")
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for (t, p), sd in shards.items():
        got = torch.load(tmp_path / "back" / "iter_0000002" / f"mp_rank_{t:02d}_{p:03d}" /
                         "model_optim_rng.pt", weights_only=False)
        assert got["iteration"] == 2 and got["args"].num_attention_heads == 4
        want_flat, got_flat = flat(sd["model"]), flat(got["model"])
        assert set(want_flat) == set(got_flat), (t, p)
        for k, v in want_flat.items():
            assert torch.equal(v, got_flat[k]), (t, p, k)


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_megatron_without_vocab_size_and_tp_only(cluster, trained, tmp_path):
    """No vocab_size in args: the padded vocabulary is the vocabulary."""
    cf, co = cluster
    m, _ = trained
    write_megatron_dir(tmp_path / "meg", megatron_shards(m, tp=2, pp=1, vocab_size=False), pp=1)
    out = json.loads(ptcctl(cf, "import", "meg1", str(tmp_path / "meg"), "--format", "megatron",
                            "--optimizer", "adam", "--json").stdout)
    assert "vocab=512" in out["model"] and out["config"].startswith("tp=2,pp=1,dp=1")
    st = co.state("meg1")
    emb = co.fetch_tensor(st, "embedding.word_embeddings.weight")
    np.testing.assert_array_equal(emb[:300], to_numpy(m.embedding.word_embeddings.weight))
    assert not emb[300:].any()
    assert not co.fetch_tensor(st, "optim/exp_avg/embedding.word_embeddings.weight").any()


def test_bad_checkpoints_fail_with_one_line(cluster, trained, tmp_path):
    cf, _ = cluster
    m, opt = trained
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    sd = m.state_dict()
    sd["encoder.layers.1.mlp.dense_4h_to_h.weight"] = torch.zeros(64, 7)
    torch.save(sd, tmp_path / "shape.pt")
    write_megatron_dir(tmp_path / "meg", megatron_shards(m, tp=2, pp=1, vocab_size=True), pp=1)
    (tmp_path / "meg" / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    (tmp_path / "meg" / "iter_0000002" / "mp_rank_01").rmdir()
    cases = [
        (["junk", str(tmp_path / "junk.pt"), "--format", "torch", "--heads", "4"], "junk.pt"),
        (["shape", str(tmp_path / "shape.pt"), "--format", "torch", "--heads", "4"],
         "encoder.layers.1.mlp.dense_4h_to_h.weight has shape (64, 7)"),
        (["noheads", str(tmp_path / "shape.pt"), "--format", "torch"], "--heads"),
        (["nodcp", str(tmp_path), "--format", "torch-dcp"], "no .metadata"),
        (["meg", str(tmp_path / "meg"), "--format", "megatron"], "mp_rank_01 is missing"),
        (["gone", str(tmp_path / "nothing"), "--format", "megatron"], "no such file"),
    ]
    for args, message in cases:
        r = ptcctl(cf, "import", *args, check=False)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = ptcctl(cf, "export", "nojob", str(tmp_path / "x"), "--format", "torch", check=False)
    assert r.returncode == 2 and "nojob" in r.stderr
