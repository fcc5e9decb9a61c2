"""Model presets: LLaMA and MoE names and shapes, optimizer state, and that
every preset validates and plans."""

from __future__ import annotations

import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.llama import llama, moe
from ptcfs.model.modelkit import OPTIMIZERS, add_states, with_optimizer
from ptcfs.model.presets import VOCAB_PAD, parse_model
from ptcfs.plan.planner import plan
from ptcfs.sharding import parse_config, rank_coords, rank_tensors, validate
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

# hidden 64, 8 heads of 8, 2 key/value heads (query groups of 4 heads)
SMALL = "layers=2,hidden=64,heads=8,kv_heads=2,vocab=1000,ffn=96"
LLAMA_HF = f"llama:{SMALL},names=hf"
LLAMA_MCORE = f"llama:{SMALL}"
MOE_HF = f"moe:{SMALL},experts=4,names=hf"
MOE_MCORE = f"moe:{SMALL},experts=4,topk=1"


def by_name(model: ModelSpec) -> dict[str, TensorSpec]:
    return {s.name: s for s in model.tensors}


def test_llama_hf_names_shapes_and_rules():
    m = parse_model(LLAMA_HF, dtype="bf16")
    t = by_name(m)
    layer = {
        "input_layernorm.weight": ((64,), None),
        "self_attn.q_proj.weight": ((64, 64), 0),
        "self_attn.k_proj.weight": ((16, 64), 0),
        "self_attn.v_proj.weight": ((16, 64), 0),
        "self_attn.o_proj.weight": ((64, 64), 1),
        "post_attention_layernorm.weight": ((64,), None),
        "mlp.gate_proj.weight": ((96, 64), 0),
        "mlp.up_proj.weight": ((96, 64), 0),
        "mlp.down_proj.weight": ((64, 96), 1),
    }
    expected = {"model.embed_tokens.weight": ((1000, 64), 0), "model.norm.weight": ((64,), None),
                "lm_head.weight": ((1000, 64), 0)}
    for i in range(2):
        expected.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    assert {n: (s.shape, s.rule.split_dim) for n, s in t.items()} == expected
    assert all(s.dtype == "bf16" and s.rule.groups == 1 and s.rule.pad_multiple is None
               and s.rule.expert is None for s in m.tensors)
    assert t["model.embed_tokens.weight"].rule.stage == "first"
    assert t["model.layers.1.mlp.up_proj.weight"].rule.stage == 1
    assert t["model.norm.weight"].rule.stage == t["lm_head.weight"].rule.stage == "last"
    assert m.pp_only == () and m.experts == 0 and m.name == "llama"
    assert m.tp_divides == (("heads", 8), ("kv_heads", 2))
    assert dict(m.params)["names"] == "hf" and dict(m.params)["kv_heads"] == 2


def test_llama_mcore_names_shapes_and_rules():
    m = parse_model(LLAMA_MCORE)
    t = by_name(m)
    p = "decoder.layers.0."
    assert [n for n in t if n.startswith(p)] == [  # module order, as named_parameters()
        p + "self_attention.linear_proj.weight",
        p + "self_attention.linear_qkv.layer_norm_weight",
        p + "self_attention.linear_qkv.weight",
        p + "mlp.linear_fc1.layer_norm_weight",
        p + "mlp.linear_fc1.weight",
        p + "mlp.linear_fc2.weight",
    ]
    assert t[p + "self_attention.linear_qkv.weight"].shape == ((8 + 2 * 2) * 8, 64)
    assert t[p + "self_attention.linear_qkv.weight"].rule == ShardRule(split_dim=0, stage=0)
    assert t[p + "self_attention.linear_proj.weight"].rule == ShardRule(split_dim=1, stage=0)
    assert t[p + "mlp.linear_fc1.weight"].shape == (192, 64)
    assert t[p + "mlp.linear_fc1.weight"].rule == ShardRule(split_dim=0, groups=2, stage=0)
    assert t[p + "mlp.linear_fc2.weight"].shape == (64, 96)
    pad = ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="first")
    assert t["embedding.word_embeddings.weight"].rule == pad
    assert t["output_layer.weight"].rule == ShardRule(split_dim=0, pad_multiple=128, stage="last")
    assert t["decoder.final_layernorm.weight"].rule == ShardRule(stage="last")
    assert not any("bias" in n or "position" in n for n in t)
    assert len(m.tensors) == 1 + 2 * 6 + 2


def test_mcore_local_norms_and_gpt_mcore_names():
    local = by_name(parse_model(LLAMA_MCORE + ",norms=local"))
    p = "decoder.layers.1."
    assert [n for n in local if n.startswith(p)] == [
        p + "input_layernorm.weight", p + "self_attention.linear_proj.weight",
        p + "self_attention.linear_qkv.weight", p + "pre_mlp_layernorm.weight",
        p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    moe_local = by_name(parse_model(MOE_MCORE + ",norms=local"))
    assert {p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"} <= set(moe_local)
    g = parse_model("gpt:layers=2,hidden=64,heads=4,vocab=300,names=mcore,swiglu=1")
    t = by_name(g)
    assert t[p + "self_attention.linear_qkv.layer_norm_bias"].shape == (64,)
    assert t[p + "mlp.linear_fc1.bias"].rule == ShardRule(split_dim=0, groups=2, stage=1)
    assert t["embedding.position_embeddings.weight"].shape == (2048, 64)
    assert "output_layer.weight" not in t and g.pp_only[0].same_as == \
        "embedding.word_embeddings.weight"
    untied = by_name(parse_model("gpt:layers=1,hidden=64,heads=4,vocab=300,names=mcore,tied=0"))
    assert untied["output_layer.weight"].rule.pad_multiple == VOCAB_PAD
    with pytest.raises(InvalidConfig, match="tied=0 needs names=mcore"):
        parse_model("gpt:layers=1,hidden=64,heads=4,vocab=300,tied=0")
    with pytest.raises(InvalidConfig, match="norms='x': use one of te, local"):
        parse_model(LLAMA_MCORE + ",norms=x")


def test_mcore_qkv_splits_by_query_group():
    """tp=2 over 2 query groups: rank 0 holds group 0's 4 query heads, its key
    and its value, rows 0..47 of the fused tensor."""
    m = parse_model(LLAMA_MCORE)
    cfg = parse_config("tp=2", "h0:2")
    got = {s.name: sl for s, sl in rank_tensors(m, cfg, 1)}
    sl = got["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert sl.pieces((96, 64)) == [(((48, 96), (0, 64)), ((0, 48), (0, 64)))]
    fc1 = got["decoder.layers.0.mlp.linear_fc1.weight"]
    assert [p[0][0] for p in fc1.pieces((192, 64))] == [(48, 96), (144, 192)]


@pytest.mark.parametrize("text", [LLAMA_HF, LLAMA_MCORE, MOE_HF, MOE_MCORE])
def test_tp_must_divide_kv_heads(text):
    m = parse_model(text)
    validate(m, parse_config("tp=2", "h0:4"))
    with pytest.raises(InvalidConfig, match=r"tp=4 does not divide kv_heads=2"):
        validate(m, parse_config("tp=4", "h0:4"))


def test_hf_vocab_is_not_padded_so_tp_must_divide_it():
    m = parse_model("llama:layers=1,hidden=64,heads=8,kv_heads=8,vocab=1001,ffn=96,names=hf")
    with pytest.raises(InvalidConfig, match=r"tp=2 does not divide dimension 0 of "
                                            r"model.embed_tokens.weight: 1001"):
        validate(m, parse_config("tp=2", "h0:2"))
    padded = parse_model("llama:layers=1,hidden=64,heads=8,kv_heads=8,vocab=1001,ffn=96")
    validate(padded, parse_config("tp=2", "h0:2"))


def test_moe_mcore_experts():
    m = parse_model(MOE_MCORE)
    t = by_name(m)
    p = "decoder.layers.1."
    assert m.name == "moe" and m.experts == 4
    assert dict(m.params)["experts"] == 4 and dict(m.params)["topk"] == 1
    assert t[p + "pre_mlp_layernorm.weight"].shape == (64,)
    assert t[p + "mlp.router.weight"].shape == (4, 64)
    assert t[p + "mlp.router.weight"].rule == ShardRule(stage=1)
    assert p + "mlp.linear_fc1.weight" not in t
    assert p + "mlp.linear_fc1.layer_norm_weight" not in t
    for j in range(4):
        e = f"{p}mlp.experts.local_experts.{j}."
        assert t[e + "linear_fc1.weight"].shape == (192, 64)
        assert t[e + "linear_fc1.weight"].rule == ShardRule(0, groups=2, stage=1, expert=j)
        assert t[e + "linear_fc2.weight"].rule == ShardRule(1, stage=1, expert=j)
    experts = [s for s in m.tensors if s.rule.expert is not None]
    assert len(experts) == 2 * 4 * 2


def test_moe_hf_mixtral_names():
    m = parse_model(MOE_HF)
    t = by_name(m)
    p = "model.layers.0."
    assert t[p + "block_sparse_moe.gate.weight"].shape == (4, 64)
    assert t[p + "post_attention_layernorm.weight"].shape == (64,)
    for j in range(4):
        e = f"{p}block_sparse_moe.experts.{j}."
        assert t[e + "w1.weight"].shape == t[e + "w3.weight"].shape == (96, 64)
        assert t[e + "w2.weight"].shape == (64, 96)
        assert t[e + "w1.weight"].rule == ShardRule(0, stage=0, expert=j)
        assert t[e + "w2.weight"].rule == ShardRule(1, stage=0, expert=j)
    assert not any(".mlp." in n for n in t)


def test_expert_parallelism_places_experts():
    m = parse_model(MOE_MCORE, optimizer="adam")
    cfg = parse_config("fsdp=2,ep=2", "h0:2")
    for c in rank_coords(cfg):
        held = {s.rule.expert for s, _ in rank_tensors(m, cfg, c.rank)} - {None}
        assert held == {2 * c.ep_rank, 2 * c.ep_rank + 1}
    with pytest.raises(InvalidConfig, match="ep=3 does not divide the model's 4 experts"):
        validate(m, parse_config("fsdp=3,ep=3", "h0:3"))


def test_tied_output_layer():
    mc = parse_model(LLAMA_MCORE + ",tied=1", optimizer="adam")
    assert "output_layer.weight" not in by_name(mc)
    head = {s.name: s for s in mc.pp_only}
    assert head["output_layer.weight"].same_as == "embedding.word_embeddings.weight"
    assert head["output_layer.weight"].rule.stage == "last"
    assert head["optim/exp_avg/output_layer.weight"].same_as == \
        "optim/exp_avg/embedding.word_embeddings.weight"
    assert "output_layer.weight" in {s.name for s in mc.tensors_for(2)}
    hf = parse_model(LLAMA_HF + ",tied=1")
    assert "lm_head.weight" not in by_name(hf) and hf.pp_only == ()
    assert dict(hf.params)["tied"] == 1


@pytest.mark.parametrize("text, message", [
    ("llama:layers=2,hidden=64,heads=8,vocab=10,ffn=8", "lacks kv_heads"),
    ("llama:layers=2,hidden=64,heads=8,kv_heads=3,vocab=10,ffn=8",
     "kv_heads=3 does not divide heads=8"),
    ("llama:layers=2,hidden=60,heads=8,kv_heads=2,vocab=10,ffn=8",
     "heads=8 does not divide hidden=60"),
    ("llama:layers=0,hidden=64,heads=8,kv_heads=2,vocab=10,ffn=8", "layers=0 must be at least 1"),
    (f"llama:{SMALL},names=meta", "names='meta': use one of mcore, hf"),
    (f"llama:{SMALL},tied=2", "tied=2 must be 0 or 1"),
    (f"llama:{SMALL},experts=2", "bad model option 'experts=2'"),
    (f"llama:{SMALL},ffn=5", "ffn is given twice"),
    (f"moe:{SMALL}", "lacks experts"),
    (f"moe:{SMALL},experts=0", "moe: experts=0 must be at least 1"),
    (f"moe:{SMALL},experts=2,topk=3", "topk=3 is more than experts=2"),
    (f"moe:{SMALL},experts=x", "experts='x' is not a whole number"),
    ("mamba:layers=2", "unknown model 'mamba'"),
])
def test_bad_options_are_named(text, message):
    with pytest.raises(InvalidConfig, match=message.replace("(", r"\(")) as e:
        parse_model(text)
    assert "\n" not in str(e.value)


def test_bad_dtype_and_names_in_calls():
    with pytest.raises(InvalidConfig, match="llama: unknown dtype 'fp8'"):
        llama(2, 64, 8, 2, 1000, 96, dtype="fp8")
    with pytest.raises(InvalidConfig, match="moe: unknown names='x'"):
        moe(2, 64, 8, 2, 1000, 96, experts=2, names="x")


# --- optimizer state ----------------------------------------------------------


def test_optimizers_and_their_states():
    assert OPTIMIZERS == ("none", "adam", "adamw", "sgd")
    base = parse_model(MOE_MCORE)
    assert with_optimizer(base, "none") is base
    for opt, kinds in (("adam", ["exp_avg", "exp_avg_sq"]), ("adamw", ["exp_avg", "exp_avg_sq"]),
                       ("sgd", ["momentum_buffer"])):
        m = parse_model(MOE_MCORE, optimizer=opt)
        assert m.experts == 4 and dict(m.params)["optimizer"] == opt
        assert m.tensors[:len(base.tensors)] == base.tensors
        states = {s.name: s for s in m.tensors if s.is_optim}
        assert len(states) == len(base.tensors) * (len(kinds) + 1)
        for p in base.tensors:
            for k in kinds + ["master"]:
                s = states[f"optim/{k}/{p.name}"]
                assert (s.shape, s.dtype, s.rule) == (p.shape, "fp32", p.rule)


def test_fp32_parameters_get_no_master_copy():
    m = parse_model(LLAMA_HF, dtype="fp32", optimizer="sgd")
    kinds = {s.name.split("/")[1] for s in m.tensors if s.is_optim}
    assert kinds == {"momentum_buffer"}


def test_unknown_optimizer_is_refused():
    with pytest.raises(InvalidConfig, match="unknown optimizer 'lion'; use one of none, adam"):
        parse_model(LLAMA_HF, optimizer="lion")


def test_add_states_checks_names_and_skips_states():
    m = add_states(parse_model(LLAMA_HF), ["m1"], master=False)
    again = add_states(m, ["m2"], master=False)
    assert not any(s.name.startswith("optim/m2/optim/") for s in again.tensors)
    for bad in (["a/b"], [""], ["master"], ["x", "x"]):
        with pytest.raises(InvalidConfig, match="optimizer state"):
            add_states(m, bad, master=True)


# --- every preset validates and plans -------------------------------------------

ALL = [
    "gpt:layers=2,hidden=64,heads=4,vocab=1000",
    "gpt:layers=2,hidden=64,heads=4,vocab=1000,swiglu=1",
    "vit:layers=2,hidden=64,heads=4,image=32,patch=8,classes=10",
    LLAMA_HF, LLAMA_MCORE, LLAMA_HF + ",tied=1", LLAMA_MCORE + ",tied=1",
    MOE_HF, MOE_MCORE, MOE_MCORE + ",tied=1",
]
HOSTS = "h0:2,h1:2"


@pytest.mark.parametrize("text", ALL)
@pytest.mark.parametrize("old, new", [("fsdp=4", "tp=2,fsdp=2"), ("tp=2,fsdp=2", "pp=2,tp=2"),
                                      ("pp=2,fsdp=2", "dp=2,tp=2,zero=1")])
def test_every_preset_plans_at_the_lower_bound(text, old, new):
    m = parse_model(text, optimizer="adam")
    a, b = parse_config(old, HOSTS), parse_config(new, HOSTS)
    p = plan(m, a, b)
    assert p.bytes_cross_host == p.bytes_min_cross_host > 0


@pytest.mark.parametrize("text", [MOE_HF, MOE_MCORE])
def test_moe_plans_with_expert_parallelism(text):
    m = parse_model(text, optimizer="adamw")
    p = plan(m, parse_config("fsdp=4,ep=2", HOSTS), parse_config("tp=2,fsdp=2,ep=2", HOSTS))
    assert p.bytes_cross_host == p.bytes_min_cross_host
    back = plan(m, parse_config("tp=2,fsdp=2,ep=2", HOSTS), parse_config("fsdp=4,ep=4", HOSTS))
    assert back.bytes_cross_host == back.bytes_min_cross_host


# --- the Hugging Face names are the real ones ----------------------------------------


def _hf_state(model) -> dict[str, tuple[int, ...]]:
    """The state dict's names and shapes as saved: a tensor that shares its
    storage with an earlier one (the tied ``lm_head``) is left out."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = tuple(t.shape)
    return out


def _hf_config(tied: bool) -> dict[str, int | bool]:
    return dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_match_transformers_llama(tied):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_config(tied)))
    ours = parse_model(LLAMA_HF + f",tied={int(tied)}")
    assert _hf_state(model) == {s.name: s.shape for s in ours.tensors}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_match_transformers_mixtral(tied):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_hf_config(tied), num_local_experts=4, num_experts_per_tok=2))
    state = _hf_state(model)
    if not any("block_sparse_moe.experts." in n for n in state):
        pytest.skip(f"transformers {transformers.__version__} fuses Mixtral's experts in its "
                    "state dict; the presets follow the per-expert checkpoint names")
    ours = parse_model(MOE_HF + f",tied={int(tied)}")
    assert state == {s.name: s.shape for s in ours.tensors}
