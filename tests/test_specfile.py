"""Model spec files: round trips through dict, TOML, JSON and the compact
text; names with rules; and every refusal, named on one line."""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path

import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.presets import parse_model
from ptcfs.model.specfile import (
    decode_spec,
    dump_spec,
    encode_spec,
    load_spec_file,
    spec_from_dict,
    spec_to_dict,
)
from ptcfs.sharding import parse_config, validate
from ptcfs.types import ModelSpec, Part, ShardRule, TensorSpec

SMALL = "layers=2,hidden=64,heads=8,kv_heads=2,vocab=1000,ffn=96"
MODELS = [
    ("gpt:layers=2,hidden=64,heads=4,vocab=1000", "adam"),
    ("gpt:layers=3,hidden=64,heads=4,vocab=1000,swiglu=1", "sgd"),
    ("vit:layers=2,hidden=64,heads=4,image=32,patch=8,classes=10", "adamw"),
    (f"llama:{SMALL},names=hf", "adam"),
    (f"llama:{SMALL},tied=1", "adam"),
    (f"moe:{SMALL},experts=4,names=hf", "none"),
    (f"moe:{SMALL},experts=4,tied=1,topk=1", "adam"),
]


@pytest.fixture(params=MODELS, ids=[m[0].partition(":")[0] + "-" + m[1] for m in MODELS])
def model(request) -> ModelSpec:
    text, optimizer = request.param
    return parse_model(text, dtype="bf16", optimizer=optimizer)


def test_dict_round_trip(model):
    d = spec_to_dict(model)
    assert spec_from_dict(d) == model
    assert spec_from_dict(json.loads(json.dumps(d))) == model


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_file_round_trip(model, fmt, tmp_path):
    path = tmp_path / f"model.{fmt}"
    path.write_text(dump_spec(model, fmt))
    assert load_spec_file(path) == model
    assert load_spec_file(str(path)) == model


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_fused_parts_round_trip(fmt, tmp_path):
    """A fused tensor of unequal parts (Phi-3's qkv_proj) through a spec file."""
    parts = (Part("q", 64, 4, "heads"), Part("k", 32, 2, "heads"), Part("v", 32, 2, "heads"))
    model = ModelSpec("phi3", 1, (TensorSpec("qkv", (128, 64), "bf16",
                                             ShardRule(split_dim=0, stage=0, parts=parts)),))
    path = tmp_path / f"model.{fmt}"
    path.write_text(dump_spec(model, fmt))
    assert load_spec_file(path) == model
    assert decode_spec(encode_spec(model)) == model


def test_compact_text_round_trip(model):
    text = encode_spec(model)
    assert text.isascii() and "\n" not in text
    assert decode_spec(text) == model
    assert decode_spec(text) is decode_spec(text)


def test_compact_text_is_small():
    big = parse_model("gpt:layers=96,hidden=12288,heads=96,vocab=50257", optimizer="adam")
    assert len(big.tensors) == 4624
    assert len(encode_spec(big)) < 40_000


def test_dict_leaves_defaults_out():
    d = spec_to_dict(parse_model("gpt:layers=1,hidden=64,heads=4,vocab=1000"))
    assert list(d) == ["name", "layers", "tp_divides", "params", "tensors", "pp_only"]
    by = {t["name"]: t for t in d["tensors"]}
    assert by["encoder.layers.0.input_layernorm.weight"] == {
        "name": "encoder.layers.0.input_layernorm.weight", "shape": [64], "dtype": "fp16",
        "stage": 0}
    assert by["embedding.word_embeddings.weight"] == {
        "name": "embedding.word_embeddings.weight", "shape": [1000, 64], "dtype": "fp16",
        "split_dim": 0, "pad_multiple": 128, "stage": "first"}
    moe = spec_to_dict(parse_model(f"moe:{SMALL},experts=2"))
    assert moe["experts"] == 2 and "pp_only" not in moe
    fc2 = next(t for t in moe["tensors"] if t["name"].endswith("local_experts.1.linear_fc2.weight"))
    assert fc2["expert"] == 1 and fc2["split_dim"] == 1 and "groups" not in fc2


def test_odd_names_survive_toml(tmp_path):
    names = ['a"b', "c\\d", "ünï.cödé", "emoji.\U0001f600", "x y", "optim/m/a.b"]
    m = ModelSpec("odd \"one\"", 2, tuple(
        TensorSpec(n, (2, 3), "fp32", ShardRule(split_dim=1, stage=i % 2))
        for i, n in enumerate(names)), (("a.b", 1),), (), (("key with space", "v\n"),
                                                          ("n", -3)))
    for fmt in ("toml", "json"):
        path = tmp_path / f"odd.{fmt}"
        path.write_text(dump_spec(m, fmt), encoding="utf-8")
        assert load_spec_file(path) == m
    assert decode_spec(encode_spec(m)) == m
    # control characters (a tab, DEL) are refused, as in job names
    for bad in ("tab\there", "del\x7f"):
        odd = ModelSpec("odd", 1, (TensorSpec(bad, (2,), "fp32", ShardRule()),))
        path = tmp_path / "bad.json"
        path.write_text(dump_spec(odd, "json"), encoding="utf-8")
        with pytest.raises(InvalidConfig, match="control character"):
            load_spec_file(path)


def test_dump_is_one_tensor_a_line():
    m = parse_model("gpt:layers=1,hidden=64,heads=4,vocab=1000")
    for fmt in ("toml", "json"):
        lines = dump_spec(m, fmt).splitlines()
        assert sum('"encoder.layers.0.' in line for line in lines) == 12
    with pytest.raises(InvalidConfig, match="unknown spec format 'yaml'"):
        dump_spec(m, "yaml")


# --- names and rules ----------------------------------------------------------------

HF_RULES = [
    {"match": "model.embed_tokens.weight", "split_dim": 0, "stage": "first"},
    {"match": r"re:.*\.self_attn\.[qkv]_proj\.weight", "split_dim": 0, "stage": "layer"},
    {"match": "*.o_proj.weight", "split_dim": 1, "stage": "layer"},
    {"match": "*.experts.*.w2.weight", "split_dim": 1, "stage": "layer", "expert": "index"},
    {"match": "*.experts.*.w[13].weight", "split_dim": 0, "stage": "layer", "expert": "index"},
    {"match": "model.norm.weight", "stage": "last"},
    {"match": "lm_head.weight", "split_dim": 0, "stage": "last"},
    {"match": "*", "stage": "layer"},
]


def test_rules_rebuild_the_mixtral_preset():
    preset = parse_model(f"moe:{SMALL},experts=4,names=hf", dtype="bf16", optimizer="adam")
    params = [s for s in preset.tensors if not s.is_optim]
    d = {"name": "moe", "layers": 2, "experts": 4, "dtype": "bf16",
         "tp_divides": dict(preset.tp_divides), "params": dict(preset.params),
         "names": [[s.name, list(s.shape)] for s in params], "rules": HF_RULES,
         "optimizer": {"states": ["exp_avg", "exp_avg_sq"], "master": True}}
    assert spec_from_dict(d) == preset
    toml = dump_spec(preset)
    assert tomllib.loads(toml)["name"] == "moe"


def test_names_as_a_table_and_dtypes(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("""
name = "tiny"
layers = 2
experts = 2
tp_divides = {heads = 4}

tensors = [
  {name = "emb", shape = [100, 8], dtype = "fp32", split_dim = 0, pad_multiple = 128},
]

[names]
"decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" = [32, 8]
"decoder.layers.1.norm.weight" = {shape = [8], dtype = "fp32"}
"decoder.layers.1.linear_proj.weight" = [8, 8]

[[rules]]
match = "*.local_experts.*"
split_dim = 0
groups = 2
stage = "layer"
expert = "index"

[[rules]]
match = "re:decoder\\\\.layers\\\\.\\\\d+\\\\.linear_proj\\\\.weight"
split_dim = 1
stage = 1

[[rules]]
match = "*"
stage = "last"
""")
    m = load_spec_file(path)
    assert m.tensors == (
        TensorSpec("emb", (100, 8), "fp32", ShardRule(0, pad_multiple=128)),
        TensorSpec("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", (32, 8),
                   "fp16", ShardRule(0, groups=2, stage=0, expert=1)),
        TensorSpec("decoder.layers.1.norm.weight", (8,), "fp32", ShardRule(stage="last")),
        TensorSpec("decoder.layers.1.linear_proj.weight", (8, 8), "fp16",
                   ShardRule(1, stage=1)))
    assert m.experts == 2 and m.tp_divides == (("heads", 4),)
    validate(m, parse_config("tp=2,pp=2", "h0:4"))


def test_optimizer_states_for_a_spelled_out_model():
    d = {"name": "m", "layers": 1, "tensors": [
        {"name": "w", "shape": [4, 4], "dtype": "fp16", "split_dim": 1, "stage": 0},
        {"name": "b", "shape": [4], "dtype": "fp32", "stage": 0}],
        "optimizer": {"states": ["momentum_buffer"], "master": True}}
    names = [s.name for s in spec_from_dict(d).tensors]
    assert names == ["w", "b", "optim/momentum_buffer/w", "optim/master/w",
                     "optim/momentum_buffer/b"]


# --- refusals ----------------------------------------------------------------------

BASE = {"name": "m", "layers": 2, "tensors": [
    {"name": "layers.0.w", "shape": [4, 4], "dtype": "fp16", "split_dim": 0, "stage": 0}]}


def _with(**changes):
    d = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            del d[key]
        else:
            d[key] = value
    return d


def _tensor(**changes):
    t = dict(BASE["tensors"][0])
    for key, value in changes.items():
        if value is None:
            del t[key]
        else:
            t[key] = value
    return _with(tensors=[t])


NAMES = {"names": [["layers.1.x", [4]]]}

BAD = [
    (_with(name=None), "missing key 'name'"),
    (_with(layers=None), "missing key 'layers'"),
    (_with(layers=0), "layers must be a whole number of at least 1, not 0"),
    (_with(layers="2"), "layers must be a whole number"),
    (_with(tensors=None), "the spec has no tensors: give 'tensors'"),
    (_with(tensors=[]), "the spec has no tensors"),
    (_with(tensors={}), "tensors must be a list"),
    (_with(shapes=[]), "unknown key 'shapes'"),
    (_with(tp_divides={"heads": 0}), "tp_divides: heads must be a whole number of at least 1"),
    (_with(params={"x": True}), "params: x must be a whole number or a string"),
    (_with(params={"x": 1.5}), "params: x must be a whole number or a string"),
    (_with(experts=-1), "experts must be a whole number of at least 0"),
    (_tensor(shape=None), r"tensors\[0\] \('layers.0.w'\): missing key 'shape'"),
    (_tensor(name=None), r"tensors\[0\]: missing key 'name'"),
    (_tensor(dtype=None), "missing key 'dtype'"),
    (_tensor(shape=[4, -1]), r"bad shape \[4, -1\]"),
    (_tensor(shape="4x4"), "bad shape '4x4'"),
    (_tensor(shape=[4.0]), r"bad shape \[4.0\]"),
    (_tensor(dtype="float16"), "unknown dtype 'float16'; use one of fp32"),
    (_tensor(stage=2), "stage 2 must be \"first\", \"last\" or a layer index below layers=2"),
    (_tensor(stage="middle"), "stage 'middle' must be"),
    (_tensor(split_dim=2), r"split_dim 2 is out of range for shape \[4, 4\]"),
    (_tensor(groups=0), "groups must be a whole number of at least 1, not 0"),
    (_tensor(pad_multiple=0), "pad_multiple must be a whole number of at least 1"),
    (_tensor(expert=0), "expert 0 needs experts > 0 at the top of the spec"),
    (_tensor(same_as="nothing"), "same_as 'nothing' is not another tensor"),
    (_tensor(same_as="layers.0.w"), "same_as 'layers.0.w' is not another tensor"),
    (_tensor(rule={}), "unknown key 'rule'"),
    (_with(tensors=BASE["tensors"] * 2), "duplicate tensor name 'layers.0.w'"),
    (_with(**NAMES), "'layers.1.x' matches no rule"),
    (_with(**NAMES, rules=[{"match": "*.w"}]), "'layers.1.x' matches no rule"),
    (_with(names=[["layers.0.w", [4]]], rules=[{"match": "*"}]), "duplicate tensor name"),
    (_with(names=[["a", [4], "fp16", 1]]), r"names\[0\]: expected \[name, shape\]"),
    (_with(names=[{"name": "a"}]), r"names\[0\]: missing key 'shape'"),
    (_with(names=[["a", [4], "f16"]], rules=[{"match": "*"}]), "unknown dtype 'f16'"),
    (_with(names={"a": 4}, rules=[{"match": "*"}]), "bad shape 4"),
    (_with(**NAMES, dtype="half"), "dtype: unknown dtype 'half'"),
    (_with(**NAMES, rules=[{"match": "re:(", "stage": 0}]), "bad regular expression '\\('"),
    (_with(**NAMES, rules=[{"stage": 0}]), r"rules\[0\]: match must be a non-empty string"),
    (_with(**NAMES, rules=[{"match": "*", "stage": 0, "dim": 0}]), "unknown key 'dim'"),
    (_with(names=[["emb", [4]]], rules=[{"match": "*", "stage": "layer"}]),
     "gives stage \"layer\" but 'emb' has no layer number"),
    (_with(names=[["layers.7.x", [4]]], rules=[{"match": "*", "stage": "layer"}]),
     "stage 7 must be"),
    (_with(names=[["layers.1.x", [4]]], rules=[{"match": "*", "expert": "index"}]),
     "gives expert \"index\" but 'layers.1.x' has no experts.<j>"),
    (_with(experts=2, names=[["experts.2.x", [4]]], rules=[{"match": "*", "expert": "index"}]),
     "expert 2 needs experts > 2"),
    (_with(optimizer={"states": ["a/b"]}), "bad optimizer state 'a/b'"),
    (_with(optimizer={"states": "exp_avg"}), "optimizer: states must be a list"),
    (_with(optimizer={"master": 1}), "optimizer: master must be true or false"),
    (_with(optimizer={"moments": []}), "optimizer: unknown key 'moments'"),
    (_tensor(parts=[{"name": "q", "size": 4}]), r"parts\[0\]: missing key 'units'"),
    (_tensor(parts=[{"name": "q", "size": 4, "units": 0}]), "units must be a whole number of "
     "at least 1"),
    (_tensor(parts=[{"name": "q", "size": 4, "units": 2, "heads": 2}]), "unknown key 'heads'"),
    (_tensor(parts="q,k,v"), "parts must be a list"),
]


@pytest.mark.parametrize("d, message", BAD)
def test_bad_specs_are_named(d, message):
    with pytest.raises(InvalidConfig, match=message) as e:
        spec_from_dict(d)
    assert "\n" not in str(e.value)


def test_not_a_table():
    with pytest.raises(InvalidConfig, match="a model spec must be a table"):
        spec_from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("file, text, message", [
    ("m.yaml", "name: m", "unknown spec file type '.yaml'; use .toml or .json"),
    ("m.toml", "name = ", "not valid TOML"),
    ("m.json", "{", "not valid JSON"),
    ("m.json", "[]", "a model spec must be a table"),
    ("m.toml", 'name = "m"\n', "missing key 'layers'"),
    ("m.json", json.dumps(_tensor(dtype="fp12")), "unknown dtype 'fp12'"),
    ("m.toml", None, "cannot read the spec file"),
])
def test_bad_files_are_named(tmp_path, file, text, message):
    path = tmp_path / file
    if text is not None:
        path.write_text(text)
    with pytest.raises(InvalidConfig, match=message) as e:
        load_spec_file(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["", "not base64!", "aGVsbG8=", "eJyrrgUAAXUA+Q=="])
def test_bad_compact_text(text):
    with pytest.raises(InvalidConfig):
        decode_spec(text)


def test_docs_example_loads():
    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    block = page.split("## Model spec files", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    m = spec_from_dict(tomllib.loads(block))
    assert len([s for s in m.tensors if not s.is_optim]) == 4
    validate(m, parse_config("tp=2,pp=2", "h0:4"))
