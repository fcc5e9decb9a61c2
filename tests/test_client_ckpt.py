"""ptcctl import/export: checkpoints built by torch itself in each format's real
layout go into a job and come back out, tensor by tensor."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.torch.module import logical_module  # noqa: E402
from ptcfs.client.torch.state import to_numpy  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=300,seq=32"
HEAD = "word_embeddings_for_head.weight"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("ckpt"), 2) as cc:
        yield cc


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
                            "--heads", "4", "--qkv-order", "per-head", "--config", "tp=2",
                            "--hosts", "h0:1,h1:1", "--json").stdout)
    assert out["model"] == "gpt:layers=4,hidden=64,heads=4,vocab=300,ffn=256,seq=32,swiglu=0"
    assert (out["config"], out["optimizer"], out["step"]) == ("tp=2,pp=1,dp=1 on h0:1,h1:1",
                                                              "adam", 2)
    check_job(co, "tsave", m, opt)
    ptcctl(cf, "export", "tsave", str(tmp_path / "out"), "--format", "torch")
    # the export loads straight into a module of the job's names and Adam
    back = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    m2 = logical_module(parse_model(MODEL, dtype="fp32"))
    m2.load_state_dict(back["model"])
    opt2 = torch.optim.Adam(m2.parameters())
    opt2.load_state_dict(back["optimizer"])
    assert opt2.param_groups[0]["lr"] == 1e-2  # the job's, not torch's default
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
           "--qkv-order", "per-head",
           "--config", "tp=2,dp=2", "--hosts", "h0:2,h1:2")
    check_job(co, "dcp", m, opt)
    ptcctl(cf, "export", "dcp", str(tmp_path / "dcp-out"), "--format", "torch-dcp")
    m2 = logical_module(parse_model(MODEL, dtype="fp32"))
    for p in m2.parameters():
        torch.nn.init.zeros_(p)
    opt2 = torch.optim.Adam(m2.parameters())
    msd2, osd2 = get_state_dict(m2, opt2)
    osd2 = {"state": {n: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)} for n, p in msd2.items()},
            "param_groups": osd2["param_groups"]}
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp-out"))
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert [g["lr"] for g in opt2.param_groups] == [1e-2]  # the job's, not torch's default
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][kind], opt2.state[p2][kind]), (kind, n)


def megatron_shards(m, tp: int, pp: int, vocab_size: bool, opt=None,
                    dtype=torch.float32, vpp: int = 1,
                    split: tuple[int, ...] | None = None) -> dict[tuple[int, int], dict]:
    """Rank files as Megatron-LM writes them, cut here by hand: column-parallel
    rows, row-parallel columns, the vocabulary padded to 128*tp, local layer
    numbers per stage, the tied head on the last stage, tensors in module
    order. With ``opt`` (the logical Adam), each file's optimizer entry is a
    torch Adam over the rank's shards in Megatron's two groups (2-D tensors
    with weight decay, then 1-D ones), wrapped with fp32 masters as Megatron's
    mixed-precision optimizer saves it when ``dtype`` is not fp32. With
    ``vpp`` > 1, an interleaved pipeline's files: ``model0``, ``model1``, ...
    per stage, chunk v of stage p holding the pipeline's chunk v * pp + p,
    its layers numbered from 0, and the optimizer's groups over the chunks
    in order. ``split``: each chunk's layer count (default: even)."""
    w = params(m)
    split = split or (4 // (pp * vpp),) * (pp * vpp)
    starts = [sum(split[:c]) for c in range(pp * vpp + 1)]
    padded = -(-300 // (128 * tp)) * 128 * tp
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4,
                              ffn_hidden_size=256, max_position_embeddings=32,
                              padded_vocab_size=padded, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp)
    if vocab_size:
        args.vocab_size = 300
    cols = ("query_key_value.weight", "query_key_value.bias", "dense_h_to_4h.weight",
            "dense_h_to_4h.bias")
    rows = ("self_attention.dense.weight", "dense_4h_to_h.weight")

    def cut(name: str, v: torch.Tensor, t: int) -> torch.Tensor:
        if name in ("embedding.word_embeddings.weight", HEAD):
            v = torch.cat([v, torch.zeros(padded - 300, 64)])
            return v.chunk(tp)[t].clone()
        if name.endswith(cols):
            return v.chunk(tp, dim=0)[t].clone()
        if name.endswith(rows):
            return v.chunk(tp, dim=1)[t].clone()
        return v.clone()

    out = {}
    if vpp > 1:
        args.virtual_pipeline_model_parallel_size = vpp
    for p in range(pp):
        for t in range(tp):
            models = []
            names = []  # this rank's tensors, job names, module order (chunk by chunk)
            for c in range(p, pp * vpp, pp):  # the stage's chunks
                chunk = []
                if c == 0:
                    chunk += ["embedding.word_embeddings.weight",
                              "embedding.position_embeddings.weight"]
                chunk += [n for n in w if n.startswith("encoder.layers.")
                          and starts[c] <= int(n.split(".")[2]) < starts[c + 1]]
                if c == pp * vpp - 1:
                    chunk += ["encoder.final_layernorm.weight", "encoder.final_layernorm.bias"]
                    if pp > 1:
                        chunk.append(HEAD)
                lm: dict = {}
                model: dict = {"language_model": lm}
                for n in chunk:
                    v = cut(n, w["embedding.word_embeddings.weight" if n == HEAD else n],
                            t).to(dtype)
                    if n.startswith("embedding."):
                        _, table, leaf = n.split(".")
                        lm.setdefault("embedding", {}).setdefault(table, {})[leaf] = v
                    elif n.startswith("encoder.layers."):
                        i, rest = n.split(".", 3)[2:]
                        local = int(i) - starts[c]
                        lm.setdefault("encoder", {})[f"layers.{local}.{rest}"] = v
                    elif n.startswith("encoder."):
                        lm.setdefault("encoder", {})[n[len("encoder."):]] = v
                    else:
                        model["word_embeddings_for_head"] = {"weight": v}
                models.append(model)
                names += chunk
            base = {n: w["embedding.word_embeddings.weight" if n == HEAD else n] for n in names}
            out[(t, p)] = {"args": args, "checkpoint_version": 3.0, "iteration": 2,
                           "rng_state": [{"random_rng_state": (3, (1, 2))}],
                           **({"model": models[0]} if vpp == 1 else
                              {f"model{v}": mv for v, mv in enumerate(models)})}
            if opt is None:
                continue
            by_name = dict(m.named_parameters())
            groups = [[n for n in names if base[n].dim() >= 2],
                      [n for n in names if base[n].dim() < 2]]
            shards = {n: torch.nn.Parameter(cut(n, base[n], t)) for n in names}
            adam = torch.optim.Adam([{"params": [shards[n] for n in groups[0]],
                                      "weight_decay": 0.01, "wd_mult": 1.0},
                                     {"params": [shards[n] for n in groups[1]],
                                      "weight_decay": 0.0, "wd_mult": 0.0}], lr=1e-2)
            for n in names:
                st = opt.state[by_name["embedding.word_embeddings.weight" if n == HEAD else n]]
                adam.state[shards[n]] = {"step": st["step"].clone(),
                                         "exp_avg": cut(n, st["exp_avg"], t),
                                         "exp_avg_sq": cut(n, st["exp_avg_sq"], t)}
            sd = adam.state_dict()
            if dtype != torch.float32:
                sd = {"optimizer": sd, "fp32_from_fp16_params": [[shards[n].detach() for n in g]
                                                                 for g in groups]}
            out[(t, p)]["optimizer"] = sd
    return out


def model_chunks(sd: dict) -> list[dict]:
    """A rank file's model state dicts: ``model``, else ``model0``, ``model1``, ..."""
    return [sd["model"]] if "model" in sd else [sd[f"model{v}"] for v in range(
        sum(1 for k in sd if k.startswith("model")))]


def same_models(want: dict, got: dict) -> bool:
    """Two rank files hold the same model chunks: keys, module order, tensors."""
    if [k for k in want if k.startswith("model")] != [k for k in got if k.startswith("model")]:
        return False
    for w, g in zip(model_chunks(want), model_chunks(got)):
        wf, gf = flat(w), flat(g)
        if list(wf) != list(gf) or not all(torch.equal(v, gf[k]) for k, v in wf.items()):
            return False
    return True


def write_megatron_dir(root, shards, pp: int) -> None:
    for (t, p), sd in shards.items():
        d = root / "iter_0000002" / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
        d.mkdir(parents=True)
        torch.save(sd, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("2")


def test_megatron_round_trip(cluster, trained, tmp_path):
    cf, co = cluster
    m, opt = trained
    shards = megatron_shards(m, tp=2, pp=2, vocab_size=True, opt=opt)
    write_megatron_dir(tmp_path / "meg", shards, pp=2)
    out = json.loads(ptcctl(cf, "import", "meg", str(tmp_path / "meg"), "--format", "megatron",
                            "--config", "tp=1,dp=2", "--hosts", "h0:1,h1:1", "--json").stdout)
    assert (out["step"], out["optimizer"], out["notes"]) == (2, "adam", [])
    check_job(co, "meg", m, opt)
    # export under tp=2, pp=2 gives back the very files' tensors and optimizer
    ptcctl(cf, "reconfigure", "meg", "--to", "tp=2,pp=2", "--hosts", "h0:2,h1:2")
    ptcctl(cf, "export", "meg", str(tmp_path / "back"), "--format", "megatron")
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for (t, p), sd in shards.items():
        got = torch.load(tmp_path / "back" / "iter_0000002" / f"mp_rank_{t:02d}_{p:03d}" /
                         "model_optim_rng.pt", weights_only=False)
        assert got["iteration"] == 2 and got["args"].num_attention_heads == 4
        assert same_models(sd, got), (t, p)  # Megatron's module order too
        same_adam(sd["optimizer"], got["optimizer"], (t, p))


def test_megatron_interleaved_pipeline_round_trip(cluster, trained, tmp_path):
    """A legacy checkpoint of an interleaved pipeline (``model0``, ``model1``
    per stage file) imports on its own mesh, with no --config, moves to a
    mesh without a pipeline and back, and exports the same files."""
    cf, co = cluster
    m, opt = trained
    shards = megatron_shards(m, tp=2, pp=2, vocab_size=True, opt=opt, vpp=2)
    write_megatron_dir(tmp_path / "meg", shards, pp=2)
    out = json.loads(ptcctl(cf, "import", "megv", str(tmp_path / "meg"), "--format",
                            "megatron", "--hosts", "h0:2,h1:2", "--json").stdout)
    assert (out["step"], out["optimizer"], out["notes"]) == (2, "adam", [])
    cfg = co.state("megv").config
    assert (cfg.tp, cfg.pp, cfg.vpp, cfg.pp_layers) == (2, 2, 2, ())
    check_job(co, "megv", m, opt)
    for got in moved_and_exported(cf, "megv", "tp=2,pp=2,vpp=2", shards, tmp_path):
        assert "model" not in got and got["args"].virtual_pipeline_model_parallel_size == 2


def moved_and_exported(cf, job: str, mesh: str, shards, tmp_path) -> list[dict]:
    """Job ``job`` (of ``megatron_shards``' files) moved to tp=1,dp=2 and back
    to ``mesh``, exported: each rank file holds the same models and Adam
    state as ``shards``'. Returns the exported files' contents."""
    ptcctl(cf, "reconfigure", job, "--to", "tp=1,dp=2", "--hosts", "h0:1,h1:1")
    ptcctl(cf, "reconfigure", job, "--to", mesh, "--hosts", "h0:2,h1:2")
    ptcctl(cf, "export", job, str(tmp_path / "back"), "--format", "megatron")
    out = []
    for (t, p), sd in shards.items():
        got = torch.load(tmp_path / "back" / "iter_0000002" / f"mp_rank_{t:02d}_{p:03d}" /
                         "model_optim_rng.pt", weights_only=False)
        assert same_models(sd, got), (t, p)
        same_adam(sd["optimizer"], got["optimizer"], (t, p))
        out.append(got)
    return out


@pytest.mark.extended
def test_megatron_uneven_pipeline_round_trip(cluster, trained, tmp_path):
    """A legacy checkpoint whose stages hold 1 and 3 of the 4 layers imports on
    its own uneven split, with no --config, moves to a mesh without a pipeline
    and back, and exports the same files."""
    cf, co = cluster
    m, opt = trained
    shards = megatron_shards(m, tp=2, pp=2, vocab_size=True, opt=opt, split=(1, 3))
    write_megatron_dir(tmp_path / "meg", shards, pp=2)
    out = json.loads(ptcctl(cf, "import", "megu", str(tmp_path / "meg"), "--format",
                            "megatron", "--hosts", "h0:2,h1:2", "--json").stdout)
    assert (out["step"], out["optimizer"], out["notes"]) == (2, "adam", [])
    cfg = co.state("megu").config
    assert (cfg.tp, cfg.pp, cfg.pp_layers) == (2, 2, (1, 3))
    check_job(co, "megu", m, opt)
    moved_and_exported(cf, "megu", "tp=2,pp=2,pp_layers=1:3", shards, tmp_path)


def same_adam(want: dict, got: dict, where) -> None:
    """Two Adam state dicts with the same groups, moments and steps."""
    assert [g["params"] for g in want["param_groups"]] == \
        [g["params"] for g in got["param_groups"]], where
    # Megatron's scheduler sets each group's weight decay from wd_mult every step
    assert [g["wd_mult"] for g in want["param_groups"]] == \
        [g["wd_mult"] for g in got["param_groups"]], where
    # and every other setting the checkpoint's groups had: the learning rate too
    assert [{k: v for k, v in g.items() if k != "params"} for g in want["param_groups"]] == \
        [{k: g2[k] for k in g if k != "params"}
         for g, g2 in zip(want["param_groups"], got["param_groups"], strict=True)], where
    assert set(want["state"]) == set(got["state"]), where
    for i, st in want["state"].items():
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[kind], got["state"][i][kind]), (where, i, kind)


def test_megatron_mixed_precision_optimizer(cluster, trained, tmp_path):
    """bf16 parameters with fp32 masters (Megatron's Float16OptimizerWithFloat16Params
    layout) import as the job's params, masters and moments and export the same."""
    cf, co = cluster
    m, opt = trained
    shards = megatron_shards(m, tp=2, pp=1, vocab_size=True, opt=opt, dtype=torch.bfloat16)
    write_megatron_dir(tmp_path / "meg", shards, pp=1)
    out = json.loads(ptcctl(cf, "import", "megbf", str(tmp_path / "meg"), "--format", "megatron",
                            "--json").stdout)
    assert (out["dtype"], out["optimizer"]) == ("bf16", "adam")
    assert out["config"].startswith("tp=2,pp=1,dp=1 ")
    st = co.state("megbf")
    for n, p in m.named_parameters():
        got = co.fetch_tensor(st, n)
        assert torch.equal(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16),
                           p.detach().to(torch.bfloat16)), n
        np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/master/{n}"), to_numpy(p))
        for kind in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/{kind}/{n}"),
                                          to_numpy(opt.state[p][kind]), err_msg=f"{kind} {n}")
    ptcctl(cf, "export", "megbf", str(tmp_path / "back"), "--format", "megatron")
    for (t, _), sd in shards.items():
        got = torch.load(tmp_path / "back" / "iter_0000002" / f"mp_rank_{t:02d}" /
                         "model_optim_rng.pt", weights_only=False)["optimizer"]
        same_adam(sd["optimizer"]["optimizer"], got["optimizer"], t)
        for want_g, got_g in zip(sd["optimizer"]["fp32_from_fp16_params"],
                                 got["fp32_from_fp16_params"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(want_g, got_g, strict=True)), t
    # parameter groups that are not Megatron's split: refused in one line, naming the way out
    f = tmp_path / "meg" / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    groups = sd["optimizer"]["optimizer"]["param_groups"]
    groups[1]["params"].insert(0, groups[0]["params"].pop())
    torch.save(sd, f)
    r = ptcctl(cf, "import", "megbad", str(tmp_path / "meg"), "--format", "megatron",
               check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "parameter groups hold [" in r.stderr and "--optimizer none" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    out = json.loads(ptcctl(cf, "import", "megbad", str(tmp_path / "meg"), "--format",
                            "megatron", "--optimizer", "none", "--json").stdout)
    assert out["optimizer"] == "none"
    # a distrib_optim.pt of a layout ptcfs does not know: refused, not misread
    # (tests/test_ckpt_distopt.py reads real ones)
    for t in (0, 1):
        f = tmp_path / "meg" / "iter_0000002" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        sd = torch.load(f, weights_only=False)
        sd["optimizer"]["optimizer"].pop("state")
        torch.save(sd, f)
        torch.save({"param_state": torch.zeros(3)}, f.parent / "distrib_optim.pt")
    r = ptcctl(cf, "import", "megdist", str(tmp_path / "meg"), "--format", "megatron",
               "--optimizer", "adam", check=False)
    assert r.returncode == 2 and "distrib_optim.pt: not the coalesced" in r.stderr, r.stderr
    out = json.loads(ptcctl(cf, "import", "megdist", str(tmp_path / "meg"), "--format",
                            "megatron", "--optimizer", "none", "--json").stdout)
    assert out["optimizer"] == "none"


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
    assert any("no optimizer state" in n for n in out["notes"])


def test_gpt2_renamed_without_reordering_is_refused_then_reordered(cluster, tmp_path):
    """A GPT-2 state dict (transformers' own) renamed to the gpt preset's
    names with its Conv1D weights transposed has the right shapes, but its
    fused query/key/value rows go q, k, v by kind, not per head: a plain
    state dict cannot say which, so the import asks, and with --qkv-order
    grouped reorders the rows (and the Adam moments) per head."""
    transformers = pytest.importorskip("transformers")
    cf, co = cluster
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32))
    sd = hf.state_dict()
    model = {"embedding.word_embeddings.weight": sd["transformer.wte.weight"],
             "embedding.position_embeddings.weight": sd["transformer.wpe.weight"]}
    for i in range(2):
        src, dst = f"transformer.h.{i}.", f"encoder.layers.{i}."
        for a, b in (("ln_1", "input_layernorm"), ("attn.c_attn", "self_attention.query_key_value"),
                     ("attn.c_proj", "self_attention.dense"), ("ln_2", "post_attention_layernorm"),
                     ("mlp.c_fc", "mlp.dense_h_to_4h"), ("mlp.c_proj", "mlp.dense_4h_to_h")):
            w = sd[f"{src}{a}.weight"]
            model[f"{dst}{b}.weight"] = w if a.startswith("ln") else w.t().contiguous()
            model[f"{dst}{b}.bias"] = sd[f"{src}{a}.bias"]
    model["encoder.final_layernorm.weight"] = sd["transformer.ln_f.weight"]
    model["encoder.final_layernorm.bias"] = sd["transformer.ln_f.bias"]
    model[HEAD] = sd["lm_head.weight"]
    params = [torch.nn.Parameter(t.clone()) for t in model.values()]
    opt = torch.optim.Adam(params)
    sum((p ** 2).sum() for p in params).backward()
    opt.step()
    torch.save({"model": model, "optimizer": opt.state_dict(), "step": 1}, tmp_path / "gpt2.pt")
    preset = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32"
    args = ["import", "g2", str(tmp_path / "gpt2.pt"), "--format", "torch", "--model", preset,
            "--config", "tp=2", "--hosts", "h0:1,h1:1"]
    r = ptcctl(cf, *args, check=False)
    assert r.returncode == 2 and "--qkv-order" in r.stderr and "Traceback" not in r.stderr
    ptcctl(cf, *args, "--qkv-order", "grouped")
    st = co.state("g2")

    def per_head(a: torch.Tensor) -> np.ndarray:  # Megatron's order: q, k, v of head 0, ...
        q, k, v = a.detach().numpy().reshape(3, 4, 16, *a.shape[1:])
        return np.stack([q, k, v], axis=1).reshape(a.shape)

    name = "encoder.layers.1.self_attention.query_key_value"
    for kind in ("weight", "bias"):
        w = model[f"{name}.{kind}"]
        np.testing.assert_array_equal(co.fetch_tensor(st, f"{name}.{kind}"), per_head(w))
        moment = opt.state[params[list(model).index(f"{name}.{kind}")]]["exp_avg"]
        np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/exp_avg/{name}.{kind}"),
                                      per_head(moment))
    # tp=2: rank 0 holds the q, k and v rows of heads 0 and 1
    w = model[f"{name}.weight"].detach().numpy()
    q, k, v = w[:64], w[64:128], w[128:]
    want = np.concatenate([np.concatenate([q[h * 16:(h + 1) * 16], k[h * 16:(h + 1) * 16],
                                           v[h * 16:(h + 1) * 16]]) for h in (0, 1)])
    np.testing.assert_array_equal(co.fetch_tensor(st, f"{name}.weight")[:96], want)


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
        (["shape", str(tmp_path / "shape.pt"), "--format", "torch", "--heads", "4",
          "--qkv-order", "per-head"],
         "encoder.layers.1.mlp.dense_4h_to_h.weight has shape (64, 7)"),
        (["order", str(tmp_path / "shape.pt"), "--format", "torch", "--heads", "4"],
         "--qkv-order per-head"),
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
    assert r.returncode == 1 and "nojob" in r.stderr
