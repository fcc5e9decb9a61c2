"""A preset recognised from a checkpoint's tensor names and shapes.

A checkpoint that records no model (a DCP directory saved by a torch job,
a state dict) can still be one of the presets: :func:`llama_hf` knows the
names of Hugging Face ``LlamaForCausalLM`` (the ``llama:...,names=hf``
preset). Shapes give every dimension but the number of attention heads:
given ``heads``, the answer is the preset itself (its text, and its spec
with ``tp_divides`` of heads and key/value heads); without, it is the same
tensors with the same rules, and tensor parallelism is then checked
against the tensors' shapes only.

:func:`llama_titan` knows torchtitan's llama3 names (``tok_embeddings``,
``layers.<i>.attention.qkv_linear.wq`` as torchtitan 0.3 writes them,
``layers.<i>.attention.wq`` and ``output`` as earlier releases did, the
``feed_forward`` SwiGLU ``w1``/``w3``/``w2``): the same LLaMA under the
table :data:`TITAN_TO_HF`, which renames its tensors both ways.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

from ptcfs.errors import InvalidConfig
from ptcfs.model.llama import llama
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

__all__ = ["llama_hf", "llama_titan", "TITAN_TO_HF", "titan_to_hf", "hf_to_titan",
           "hf_names"]

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


#: torchtitan llama3's names (per layer, after ``layers.<i>.``, or whole) → Hugging Face's
TITAN_TO_HF = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TITAN_WHOLE = {"tok_embeddings.weight": _EMB, "norm.weight": _NORM, "lm_head.weight": _HEAD,
                "output.weight": _HEAD}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def titan_to_hf(name: str, whole: Mapping[str, str] = _TITAN_WHOLE,
                layer: Mapping[str, str] = TITAN_TO_HF) -> str | None:
    """The Hugging Face name of a torchtitan tensor name (None: not one), by
    ``whole`` (names outside the layers) and ``layer`` (names after
    ``layers.<i>.``): llama3's by default."""
    if name in whole:
        return whole[name]
    m = _TITAN_LAYER.fullmatch(name)
    if m is None or m.group(2) not in layer:
        return None
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"


def hf_to_titan(name: str, legacy: bool = False) -> str | None:
    """The torchtitan llama3 name of a Hugging Face LLaMA tensor name: as
    torchtitan 0.3 names it (``qkv_linear``, ``lm_head``), or as earlier
    releases did (``legacy``: ``attention.wq``, ``output``); None: not one."""
    if name == _HEAD:
        return "output.weight" if legacy else "lm_head.weight"
    for titan, hf in _TITAN_WHOLE.items():
        if hf == name:
            return titan
    m = _LAYER_NAME.fullmatch(name)
    if m is None:
        return None
    for titan, hf in TITAN_TO_HF.items():
        qkv = titan.startswith(("attention.qkv_linear.", "attention.wq.", "attention.wk.",
                                "attention.wv."))
        if hf == m.group(2) and (not qkv or titan.startswith("attention.qkv_linear.") != legacy):
            return f"layers.{m.group(1)}.{titan}"
    return None


def hf_names(shapes: Mapping[str, tuple[int, ...]], to_hf: Callable[[str], str | None]
             ) -> dict[str, str] | None:
    """Hugging Face name → the checkpoint's name, for every tensor of
    ``shapes`` (``to_hf``: one model's mapping); None when a name is not
    that model's or two map to one."""
    back: dict[str, str] = {}
    for name in shapes:
        hf = to_hf(name)
        if hf is None or hf in back:
            return None
        back[hf] = name
    return back


def llama_titan(shapes: Mapping[str, tuple[int, ...]], dtype: str, heads: int | None = None
                ) -> tuple[str, ModelSpec] | None:
    """``(model text, spec)`` when ``shapes`` are exactly a torchtitan llama3's
    tensors (either naming), else None: :func:`llama_hf` of the same tensors
    under Hugging Face's names, its spec's tensors named back as given."""
    back = hf_names(shapes, titan_to_hf)
    if back is None:
        return None
    known = llama_hf({hf: shapes[t] for hf, t in back.items()}, dtype, heads)
    if known is None:
        return None
    text, spec = known
    tensors = tuple(replace(t, name=back[t.name]) for t in spec.tensors)
    params = tuple((k, "torchtitan") if k == "names" else (k, v) for k, v in spec.params)
    text = text.replace("names=hf", "names=torchtitan").replace("hf names", "torchtitan names")
    return text, replace(spec, tensors=tensors, params=params)
