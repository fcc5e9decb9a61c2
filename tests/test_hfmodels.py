"""Hugging Face layouts from config.json (ptcfs.model.hfmodels) against the models
transformers builds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.hfmodels import (
    config_for_preset,
    decays,
    gpt2,
    hf_files,
    spec_from_config,
    with_hf_files,
)
from ptcfs.model.presets import parse_model
from ptcfs.model.specfile import decode_spec, encode_spec
from ptcfs.plan.reshard import cut
from ptcfs.sharding import parse_config, rank_tensors, validate

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def hf_config(arch: str):
    T = pytest.importorskip("transformers")
    return {
        "llama": lambda: T.LlamaConfig(**SIZES, tie_word_embeddings=True),
        "mistral": lambda: T.MistralConfig(**SIZES),
        "qwen2": lambda: T.Qwen2Config(**SIZES),
        "mixtral": lambda: T.MixtralConfig(**SIZES, num_local_experts=3),
        "gpt2": lambda: T.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4,
                                     n_positions=32, n_inner=80),
    }[arch]()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "mixtral", "gpt2"])
def test_spec_is_the_models_parameters_in_order(arch):
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    cfg = hf_config(arch)
    with torch.device("meta"):
        m = T.AutoModelForCausalLM.from_config(cfg)
    config = json.loads(cfg.to_json_string())
    config["architectures"] = [type(m).__name__]
    model = spec_from_config(config, "bf16")
    assert [(t.name, t.shape) for t in model.tensors] == \
        [(n, tuple(p.shape)) for n, p in m.named_parameters()]
    assert {t.dtype for t in model.tensors} == {"bf16"}
    # the Trainer's weight-decay group
    decay = set(T.Trainer.get_decay_parameter_names(None, m))
    assert {t.name for t in model.tensors if decays(t)} == \
        {n for n, _ in m.named_parameters() if n in decay}


def test_model_type_alone_and_unknown_architectures():
    config = dict(SIZES, model_type="mistral")
    assert spec_from_config(config, "fp16").name == "mistral"
    with pytest.raises(InvalidConfig, match="architecture FalconForCausalLM"):
        spec_from_config({"architectures": ["FalconForCausalLM"], **SIZES}, "fp16")
    with pytest.raises(InvalidConfig, match="architecture LlamaModel"):
        spec_from_config({"architectures": ["LlamaModel"], **SIZES}, "fp16")


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 5}, "num_attention_heads=5 does not divide hidden_size=64"),
    ({"num_key_value_heads": 3},
     "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"head_dim": 8}, "head_dim=8 is not hidden_size / num_attention_heads = 16"),
    ({"mlp_bias": True}, "mlp_bias=True adds tensors"),
    ({"model_type": "qwen2"}, "model_type 'qwen2' does not go with LlamaForCausalLM"),
    ({"vocab_size": "many"}, "vocab_size is 'many', not a whole number"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings is 1, not true or false"),
    ({"intermediate_size": None}, "intermediate_size is None, not a whole number"),
])
def test_configs_that_do_not_fit_are_refused(change, message):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES, **change}
    with pytest.raises(InvalidConfig) as e:
        spec_from_config(config, "fp32")
    assert message in str(e.value)


def test_gpt2_tensor_parallel_keeps_whole_heads():
    """tp=2 of c_attn [H, 3H] gives each rank the q, k and v columns of its own
    heads; c_fc splits its outputs, both c_proj their inputs (dimension 0)."""
    h, heads, tp = 64, 4, 2
    model = gpt2(2, h, heads, 256, 32, dtype="fp32")
    cfg = parse_config(f"tp={tp}", "h0:2")
    hd = h // heads
    w = np.arange(h * 3 * h, dtype=np.float32).reshape(h, 3 * h)
    for rank in range(tp):
        held = {s.name: (s, sl) for s, sl in rank_tensors(model, cfg, rank)}
        s, sl = held["transformer.h.1.attn.c_attn.weight"]
        mine = range(rank * heads // tp, (rank + 1) * heads // tp)
        want = np.concatenate([w[:, g * h + a * hd:g * h + (a + 1) * hd]
                               for g in range(3) for a in mine], axis=1)
        np.testing.assert_array_equal(cut(s, sl, w), want)
        b = np.arange(3 * h, dtype=np.float32)
        s, sl = held["transformer.h.1.attn.c_attn.bias"]
        np.testing.assert_array_equal(cut(s, sl, b), np.concatenate(
            [b[g * h + a * hd:g * h + (a + 1) * hd] for g in range(3) for a in mine]))
        assert held["transformer.h.1.attn.c_proj.weight"][1].local_shape((h, h)) == (h // tp, h)
        assert held["transformer.h.1.mlp.c_fc.weight"][1].local_shape((h, 4 * h)) == \
            (h, 4 * h // tp)
        assert held["transformer.h.1.mlp.c_proj.weight"][1].local_shape((4 * h, h)) == \
            (4 * h // tp, h)
    with pytest.raises(InvalidConfig, match="tp=4 does not divide heads=6"):
        validate(gpt2(2, 96, 6, 300, 32), parse_config("tp=4", "h0:4"))


def test_config_files_ride_in_the_spec_and_presets_get_one():
    model = with_hf_files(gpt2(1, 64, 4, 256, 32), {"config.json": '{"a": 1}\n'})
    assert hf_files(decode_spec(encode_spec(model))) == {"config.json": '{"a": 1}\n'}
    assert config_for_preset(model) is None
    preset = parse_model("moe:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,ffn=96,experts=4,"
                         "names=hf,tied=1", dtype="bf16")
    config = config_for_preset(preset)
    assert config is not None and config["torch_dtype"] == "bfloat16"
    back = spec_from_config(config, "bf16")
    assert sorted((t.name, t.shape) for t in back.tensors) == \
        sorted((t.name, t.shape) for t in preset.tensors)
    assert config_for_preset(parse_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,"
                                         "vocab=256,ffn=96")) is None  # mcore names
