"""A preset recognised from a checkpoint's tensor names and shapes.

A checkpoint that records no model (a DCP directory saved by a torch job,
a state dict) can still be one of the presets: :func:`llama_hf` knows the
names of Hugging Face ``LlamaForCausalLM`` (the ``llama:...,names=hf``
preset). Shapes give every dimension but the number of attention heads:
given ``heads``, the answer is the preset itself (its text, and its spec
with ``tp_divides`` of heads and key/value heads); without, it is the same
tensors with the same rules, and tensor parallelism is then checked
against the tensors' shapes only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ptcfs.errors import InvalidConfig
from ptcfs.model.llama import llama
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

__all__ = ["llama_hf"]

#: The tensors of one layer, in the preset's order: name → tp split dimension.
_LAYER = {"input_layernorm.weight": None, "self_attn.q_proj.weight": 0,
          "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
          "self_attn.o_proj.weight": 1, "post_attention_layernorm.weight": None,
          "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EMB, _NORM, _HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def llama_hf(shapes: Mapping[str, tuple[int, ...]], dtype: str, heads: int | None = None
             ) -> tuple[str, ModelSpec] | None:
    """``(model text, spec)`` when ``shapes`` (name → shape) are exactly a
    Hugging Face LLaMA's tensors, else None. The text is the preset's when
    ``heads`` is given, else ``"llama (hf names, heads unknown)"``."""
    if _EMB not in shapes or _NORM not in shapes:
        return None
    layers: dict[int, set[str]] = {}
    for name in shapes:
        m = _LAYER_NAME.fullmatch(name)
        if m is not None and m.group(2) in _LAYER:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
        elif name not in (_EMB, _NORM, _HEAD):
            return None
    n = len(layers)
    if not n or sorted(layers) != list(range(n)) or any(v != set(_LAYER) for v in
                                                        layers.values()):
        return None
    vocab, hidden = shapes[_EMB]
    q, kv, ffn = (shapes[f"model.layers.0.{k}"][0] for k in
                  ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight"))
    tied = _HEAD not in shapes
    if heads is not None:
        if heads < 1 or hidden % heads or q != hidden or kv % (hidden // heads):
            raise InvalidConfig(f"heads={heads} does not fit the checkpoint's LLaMA "
                                f"(hidden={hidden}, key/value rows {kv})")
        kv_heads = kv // (hidden // heads)
        text = (f"llama:layers={n},hidden={hidden},heads={heads},kv_heads={kv_heads},"
                f"vocab={vocab},ffn={ffn},tied={int(tied)},names=hf")
        return text, llama(n, hidden, heads, kv_heads, vocab, ffn, tied, "hf", dtype)
    tensors = [TensorSpec(_EMB, (vocab, hidden), dtype, ShardRule(split_dim=0, stage="first"))]
    for i in range(n):
        tensors += [TensorSpec(f"model.layers.{i}.{k}", tuple(shapes[f"model.layers.{i}.{k}"]),
                               dtype, ShardRule(split_dim=d, stage=i)) for k, d in _LAYER.items()]
    tensors.append(TensorSpec(_NORM, (hidden,), dtype, ShardRule(stage="last")))
    if not tied:
        tensors.append(TensorSpec(_HEAD, (vocab, hidden), dtype,
                                  ShardRule(split_dim=0, stage="last")))
    params: tuple[tuple[str, int | str], ...] = (
        ("layers", n), ("hidden", hidden), ("vocab", vocab), ("ffn", ffn), ("tied", int(tied)),
        ("names", "hf"), ("dtype", dtype))
    return "llama (hf names, heads unknown)", ModelSpec("llama", n, tuple(tensors), (), (),
                                                        params)
