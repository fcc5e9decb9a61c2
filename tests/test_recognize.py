"""Presets recognised from a checkpoint's names and shapes (ptcfs.model.recognize)."""

from __future__ import annotations

import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.presets import parse_model
from ptcfs.model.recognize import hf_to_titan, llama_hf, llama_titan, titan_to_hf

TEXT = "llama:layers=3,hidden=64,heads=8,kv_heads=2,vocab=300,ffn=96,tied={},names=hf"


@pytest.mark.parametrize("tied", [0, 1])
def test_llama_hf_names_are_the_preset(tied: int) -> None:
    preset = parse_model(TEXT.format(tied), dtype="bf16")
    shapes = {s.name: s.shape for s in reversed(preset.tensors)}  # any order
    text, spec = llama_hf(shapes, "bf16", heads=8)  # type: ignore[misc]
    assert text == TEXT.format(tied) and spec == preset
    text, spec = llama_hf(shapes, "bf16")  # type: ignore[misc]
    assert spec.tensors == preset.tensors and spec.tp_divides == ()
    assert text == "llama (hf names, heads unknown)"


def test_other_names_are_not_a_llama() -> None:
    shapes = {s.name: s.shape for s in parse_model(TEXT.format(0)).tensors}
    assert llama_hf({**shapes, "model.layers.0.mlp.bias": (96,)}, "fp16") is None
    del shapes["model.layers.2.mlp.up_proj.weight"]
    assert llama_hf(shapes, "fp16") is None
    assert llama_hf({"embedding.word_embeddings.weight": (300, 64)}, "fp16") is None
    with pytest.raises(InvalidConfig, match="heads=5 does not fit"):
        llama_hf({s.name: s.shape for s in parse_model(TEXT.format(0)).tensors}, "fp16", 5)


@pytest.mark.parametrize("legacy", [False, True])
def test_torchtitan_names_are_the_llama_renamed(legacy: bool) -> None:
    """torchtitan 0.3's names (``qkv_linear``, ``lm_head``) and earlier
    releases' (``attention.wq``, ``output``) give the LLaMA's tensors and rules."""
    preset = parse_model(TEXT.format(0), dtype="fp32")
    names = {s.name: hf_to_titan(s.name, legacy) for s in preset.tensors}
    assert all(names.values()) and len(set(names.values())) == len(names)
    assert all(titan_to_hf(t) == hf for hf, t in names.items())
    assert ("layers.0.attention.wq.weight" in names.values()) == legacy
    assert ("output.weight" if legacy else "lm_head.weight") in names.values()
    shapes = {names[s.name]: s.shape for s in preset.tensors}
    text, spec = llama_titan(shapes, "fp32", heads=8)  # type: ignore[misc]
    assert text == TEXT.format(0).replace("names=hf", "names=torchtitan")
    assert [t.name for t in spec.tensors] == [names[t.name] for t in preset.tensors]
    assert [t.rule for t in spec.tensors] == [t.rule for t in preset.tensors]
    assert spec.tp_divides == preset.tp_divides and ("names", "torchtitan") in spec.params
    assert llama_titan({**shapes, "layers.0.extra.weight": (4,)}, "fp32") is None
    assert llama_titan({"tok_embeddings.weight": (300, 64)}, "fp32") is None
