"""σ, φ, α: slices, rank order, placement, pipeline stages, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.presets import gpt, parse_model
from ptcfs.plan.reshard import cut, merge
from ptcfs.sharding import (
    host_ranks,
    parse_config,
    rank_coords,
    rank_tensors,
    stage_chunks,
    stage_layers,
    stage_of,
    validate,
)
from ptcfs.types import ShardRule, Slice, TensorSpec

GPT = "gpt:layers=24,hidden=1536,heads=16,vocab=50257"


def shapes(model, cfg, rank=0):
    return {s.name: sl.local_shape(s.shape) for s, sl in rank_tensors(model, cfg, rank)}


@pytest.mark.parametrize(
    "tp, emb, qkv, down",
    [(1, (50304, 1536), (4608, 1536), (1536, 6144)),
     (2, (25216, 1536), (2304, 1536), (1536, 3072)),
     (4, (12672, 1536), (1152, 1536), (1536, 1536))],
)
def test_gpt_shapes_per_rank(tp, emb, qkv, down):
    m = parse_model(GPT)
    s = shapes(m, parse_config(f"tp={tp}", "h0:4"))
    assert s["embedding.word_embeddings.weight"] == emb
    assert s["encoder.layers.0.self_attention.query_key_value.weight"] == qkv
    assert s["encoder.layers.0.mlp.dense_4h_to_h.weight"] == down
    assert s["encoder.layers.3.self_attention.dense.bias"] == (1536,)
    assert s["embedding.position_embeddings.weight"] == (2048, 1536)


def test_megatron_rank_order_and_hosts():
    cfg = parse_config("tp=2,pp=2,dp=3", "a:4,b:4,c:4")
    coords = rank_coords(cfg)
    assert [(c.tp_rank, c.dp_rank, c.pp_rank) for c in coords[:7]] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0), (0, 0, 1)]
    for c in coords:
        assert c.rank == c.tp_rank + 2 * (c.dp_rank + 3 * c.pp_rank)
    assert host_ranks(cfg) == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11]}


def test_fewer_ranks_than_gpus_leaves_last_hosts_empty():
    cfg = parse_config("tp=2", "a:2,b:2")
    assert host_ranks(cfg) == {"a": [0, 1], "b": []}


@pytest.mark.parametrize("layers, pp, sizes", [
    (24, 4, [6, 6, 6, 6]), (10, 4, [3, 3, 2, 2]), (7, 3, [3, 2, 2]), (5, 5, [1] * 5)])
def test_uneven_pipeline_split(layers, pp, sizes):
    stages = stage_layers(layers, pp)
    assert [len(s) for s in stages] == sizes
    assert [i for s in stages for i in s] == list(range(layers))
    for s, layer_range in enumerate(stages):
        for i in layer_range:
            assert stage_of(ShardRule(stage=i), layers, pp) == s


def test_pipeline_assigns_whole_layers_and_ends():
    m = gpt(layers=5, hidden=64, heads=4, vocab=1000)
    cfg = parse_config("tp=1,pp=2", "h:2")
    first = {s.name for s, _ in rank_tensors(m, cfg, 0)}
    last = {s.name for s, _ in rank_tensors(m, cfg, 1)}
    assert "embedding.word_embeddings.weight" in first
    assert "encoder.layers.2.mlp.dense_h_to_4h.weight" in first
    assert "encoder.layers.3.mlp.dense_h_to_4h.weight" in last
    assert {"encoder.final_layernorm.weight", "word_embeddings_for_head.weight"} <= last
    assert not first & last
    one = {s.name for s, _ in rank_tensors(m, parse_config("tp=1", "h:1"), 0)}
    assert "word_embeddings_for_head.weight" not in one


def test_an_interleaved_pipeline_puts_chunk_c_on_stage_c_mod_pp():
    m = gpt(layers=6, hidden=64, heads=4, vocab=1000)
    cfg = parse_config("pp=2,vpp=3", "h:2")
    assert (cfg.pp, cfg.vpp) == (2, 3)
    validate(m, cfg)
    held = [{s.name for s, _ in rank_tensors(m, cfg, r)} for r in (0, 1)]
    for layer in range(6):  # chunks of one layer: 0, 2, 4 on stage 0; 1, 3, 5 on stage 1
        assert f"encoder.layers.{layer}.mlp.dense_h_to_4h.weight" in held[layer % 2]
    assert "embedding.word_embeddings.weight" in held[0]
    assert "encoder.final_layernorm.weight" in held[1]  # the last chunk's stage
    assert not held[0] & held[1]
    assert stage_chunks(6, 2, (), 3) == [[range(0, 1), range(2, 3), range(4, 5)],
                                         [range(1, 2), range(3, 4), range(5, 6)]]
    # pp_layers then counts each chunk's layers, in chunk order
    cfg = parse_config("vpp=2,pp_layers=2:1:1:2", "h:2")
    assert (cfg.pp, cfg.vpp, cfg.pp_layers) == (2, 2, (2, 1, 1, 2))
    assert cfg.degrees_text() == "tp=1,pp=2,dp=1,vpp=2,pp_layers=2:1:1:2"
    assert stage_chunks(6, 2, cfg.pp_layers, 2) == [[range(0, 2), range(3, 4)],
                                                    [range(2, 3), range(4, 6)]]
    assert [stage_of(ShardRule(stage=i), 6, 2, cfg.pp_layers, 2) for i in range(6)] == \
        [0, 0, 1, 0, 1, 1]
    for degrees, message in (("pp=2,vpp=4", "pp\\*vpp = 8 chunks is more than the model's 6"),
                             ("pp=1,vpp=2", "vpp=2: virtual stages interleave"),
                             ("pp=2,vpp=2,pp_layers=3:3", "pp_layers has 2 counts but there "
                              "are 4 chunks")):
        with pytest.raises(InvalidConfig, match=message):
            validate(m, parse_config(degrees, "h:2"))


def test_context_parallel_ranks_hold_replicas_unless_cp_shard():
    """cp_shard=0 (the default, Megatron-Core's layout): the ranks of a cp
    group hold the same slices; cp_shard=1 (torchtitan's dp_shard_cp): FSDP
    chunk fsdp_rank*cp + cp_rank of fsdp*cp. The option round-trips through
    the text, degrees() and a version's metadata, and needs cp > 1."""
    from ptcfs.jobstate import config_from_meta

    m = gpt(layers=2, hidden=64, heads=4, vocab=1000)
    replicas = parse_config("fsdp=2,cp=2", "h:4")
    assert replicas.cp_shard == 0 and replicas.fsdp_shards == 2
    assert rank_tensors(m, replicas, 0) == rank_tensors(m, replicas, 1)  # cp ranks 0, 1
    assert "cp_shard" not in replicas.degrees() and "cp_shard" not in replicas.degrees_text()
    sharded = parse_config("fsdp=2,cp=2,cp_shard=1", "h:4")
    assert sharded.fsdp_shards == 4 and sharded.degrees_text() == \
        "tp=1,pp=1,dp=1,fsdp=2,cp=2,cp_shard=1"
    for rank in range(4):  # rank = cp_rank + 2*fsdp_rank: chunk fsdp_rank*2 + cp_rank
        assert {sl.cuts[-1].key() for _, sl in rank_tensors(m, sharded, rank)
                if sl.cuts and sl.cuts[-1].chunk} == {f"c0.{rank}of4"}
    meta = {**sharded.degrees(), "hosts": [["h", 4]]}
    assert config_from_meta(meta) == sharded
    assert config_from_meta({**replicas.degrees(), "hosts": [["h", 4]]}) == replicas
    validate(m, sharded)
    for degrees in ("cp_shard=1", "cp=2,cp_shard=2"):
        with pytest.raises(InvalidConfig, match="cp_shard=.: use cp_shard=1 .* only with cp > 1"):
            validate(m, parse_config(degrees, "h:4"))


def test_data_parallel_replicates():
    m = gpt(layers=2, hidden=64, heads=4, vocab=1000)
    cfg = parse_config("tp=2,dp=2", "h:4")
    assert rank_tensors(m, cfg, 0) == rank_tensors(m, cfg, 2)
    assert rank_tensors(m, cfg, 1) == rank_tensors(m, cfg, 3)
    assert rank_tensors(m, cfg, 0) != rank_tensors(m, cfg, 1)


def test_swiglu_groups_split_separately():
    spec = TensorSpec("w", (8, 3), "fp32", ShardRule(split_dim=0, groups=2))
    logical = np.arange(24, dtype=np.float32).reshape(8, 3)
    gate, up = logical[:4], logical[4:]
    halves = [Slice.split(0, i, 2, 2) for i in range(2)]
    parts = [(sl, cut(spec, sl, logical)) for sl in halves]
    np.testing.assert_array_equal(parts[0][1], np.concatenate([gate[:2], up[:2]]))
    np.testing.assert_array_equal(parts[1][1], np.concatenate([gate[2:], up[2:]]))
    np.testing.assert_array_equal(merge(spec, parts), logical)
    m = gpt(layers=1, hidden=64, heads=4, vocab=1000, swiglu=True)
    s = shapes(m, parse_config("tp=4", "h:4"))
    assert s["encoder.layers.0.mlp.dense_h_to_4h.weight"] == (128, 64)


def test_vocab_padding_across_tp_changes():
    spec = TensorSpec("e", (300, 2), "fp32", ShardRule(split_dim=0, pad_multiple=128))
    logical = np.random.default_rng(0).standard_normal((300, 2)).astype(np.float32)
    for tp in (1, 2, 3, 4):
        padded = -(-300 // (128 * tp)) * 128 * tp
        parts = []
        for r in range(tp):
            sl = Slice.split(0, r, tp, 1, padded)
            sub = cut(spec, sl, logical)
            assert sub.shape == (padded // tp, 2)
            parts.append((sl, sub))
        tail = np.concatenate([p for _, p in parts])[300:]
        assert not tail.any(), "padding rows are zero"
        np.testing.assert_array_equal(merge(spec, parts), logical)
    # a rank made only of padding holds no state pieces
    assert Slice.split(0, 3, 4, 1, 512).pieces((300, 2)) == []


@pytest.mark.parametrize("degrees, hosts, message", [
    ("tp=3", "h:4", "tp=3 does not divide heads=16"),
    ("tp=2,dp=4", "h0:2,h1:2", "8 ranks, but the hosts have only 4 GPUs"),
    ("pp=25", "h:32", "pp=25 is more than the model's 24 layers"),
    ("tp=0", "h:4", "tp=0"),
    ("tp=1", "h:0", "a host has 1 to 4096 GPUs"),
    ("tp=1", "h:2,h:2", "listed twice"),
])
def test_bad_configurations_are_refused_by_name(degrees, hosts, message):
    m = parse_model(GPT)
    with pytest.raises(InvalidConfig, match=message):
        validate(m, parse_config(degrees, hosts))


def test_tp_must_divide_ffn():
    m = gpt(layers=1, hidden=64, heads=8, vocab=1000, ffn=100)
    with pytest.raises(InvalidConfig, match="tp=8 does not divide dimension 0 of .*dense_h_to_4h"):
        validate(m, parse_config("tp=8", "h:8"))


@pytest.mark.parametrize("text, message", [
    ("tp=2,xp=3", "bad degree 'xp=3'"), ("tp=two", "not a whole number")])
def test_bad_degree_text(text, message):
    with pytest.raises(InvalidConfig, match=message):
        parse_config(text, "h:4")


@pytest.mark.parametrize("hosts, message", [
    ("h0", "expected name:gpus"), ("h0:x", "bad GPU count"), ("", "no hosts")])
def test_bad_host_text(hosts, message):
    with pytest.raises(InvalidConfig, match=message):
        parse_config("tp=1", hosts)


@pytest.mark.parametrize("text, message", [
    ("bert:layers=1", "unknown model 'bert'"),
    ("gpt:layers=2,hidden=64", "lacks heads, vocab"),
    ("gpt:layers=2,hidden=64,heads=5,vocab=10", "heads=5 does not divide hidden=64"),
    ("gpt:layers=2,width=3", "bad model option 'width=3'"),
])
def test_bad_models(text, message):
    with pytest.raises(InvalidConfig, match=message):
        parse_model(text)


def test_adam_state_is_sharded_like_params():
    m = parse_model("gpt:layers=1,hidden=64,heads=4,vocab=1000", dtype="bf16", optimizer="adam")
    s = shapes(m, parse_config("tp=2", "h:2"))
    w = "encoder.layers.0.self_attention.dense.weight"
    for kind in ("exp_avg", "exp_avg_sq", "master"):
        assert s[f"optim/{kind}/{w}"] == s[w] == (64, 32)
    specs = {t.name: t for t in m.tensors}
    assert specs[f"optim/master/{w}"].dtype == "fp32"
    m32 = parse_model("gpt:layers=1,hidden=64,heads=4,vocab=1000", dtype="fp32", optimizer="adam")
    assert not any(t.name.startswith("optim/master/") for t in m32.tensors)
