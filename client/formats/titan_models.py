"""torchtitan models other than llama3, recognised from a checkpoint's names.

torchtitan's qwen3 (dense) names its tensors as its state-dict adapter to
Hugging Face says (``Qwen3StateDictAdapter.from_hf_map``, read from the
installed torchtitan, not copied here): llama3's names plus the per-head
norms ``attention.q_norm``/``attention.k_norm``. :func:`qwen3_titan` renames
a checkpoint's tensors to Hugging Face's, builds transformers' ``Qwen3Config``
from their shapes and takes its spec from transformers
(:func:`~ptcfs.client.formats.hf_spec.spec_from_hf`), named back as given.
The shapes tell every size: the query norm's length is the head size, so
the query and key rows give the heads and key/value heads (a ``--heads``
that disagrees is refused). What no tensor holds (the RoPE base, the norms'
epsilon, the context length) changes no tensor and is left at
transformers' defaults.

A mixture-of-experts qwen3 (``moe.router``, ``moe.routed_experts``: each
expert's weights stacked in one tensor) is not recognised.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from functools import cache

from ptcfs.client.formats.hf_spec import spec_from_hf
from ptcfs.errors import CheckpointError
from ptcfs.model.recognize import hf_names, titan_to_hf
from ptcfs.types import ModelSpec

__all__ = ["norm_heads", "qwen3_titan", "qwen3_hf_to_titan", "qwen3_titan_to_hf"]

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_Q, _K, _QN = ("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight",
               "attention.q_norm.weight")


@cache
def _qwen3_map() -> tuple[dict[str, str], dict[str, str]] | None:
    """torchtitan qwen3's dense names → Hugging Face's: (whole tensors,
    per-layer suffixes); None without torchtitan."""
    try:
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    except ImportError:
        return None
    whole, layer = {}, {}
    for hf, titan in Qwen3StateDictAdapter(None, None).from_hf_map.items():
        if titan is None or hf.count("{}") > 1 or ".moe." in titan:
            continue  # buffers it drops; the experts of a mixture-of-experts layer
        if "{}" in hf:
            layer[titan.removeprefix("layers.{}.")] = hf.removeprefix("model.layers.{}.")
        else:
            whole[titan] = hf
    return whole, layer


def qwen3_titan_to_hf(name: str) -> str | None:
    """The Hugging Face name of a torchtitan qwen3 (dense) tensor name."""
    maps = _qwen3_map()
    if maps is None:
        return None
    return titan_to_hf(name, *maps)


def qwen3_hf_to_titan(name: str) -> str | None:
    """The torchtitan qwen3 name of a Hugging Face Qwen3 tensor name."""
    maps = _qwen3_map()
    if maps is None:
        return None
    whole, layer = maps
    for titan, hf in whole.items():
        if hf == name:
            return titan
    m = _HF_LAYER.fullmatch(name)
    for titan, hf in layer.items():
        if m is not None and hf == m.group(2):
            return f"layers.{m.group(1)}.{titan}"
    return None


def norm_heads(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The attention heads of a model with per-head query norms (qwen3):
    query rows over the norm's length; None for a model without them."""
    norm, q = shapes.get(f"layers.0.{_QN}"), shapes.get(f"layers.0.{_Q}")
    if norm is None or q is None or len(norm) != 1 or not norm[0] or q[0] % norm[0]:
        return None
    return q[0] // norm[0]


def qwen3_titan(shapes: Mapping[str, tuple[int, ...]], dtype: str, heads: int | None = None
                ) -> tuple[str, ModelSpec] | None:
    """``(model text, spec)`` when ``shapes`` are exactly a dense torchtitan
    qwen3's tensors, else None (see the module docstring)."""
    back = hf_names(shapes, qwen3_titan_to_hf)
    found = norm_heads(shapes)
    if back is None or found is None or "tok_embeddings.weight" not in shapes:
        return None
    if heads is not None and heads != found:
        raise CheckpointError(f"--heads {heads} does not fit the checkpoint's qwen3: its "
                              f"query rows and head size give {found} heads")
    layers: int = 1 + max(int(m.group(1)) for n in shapes if (m := _LAYER.fullmatch(n)))
    vocab, hidden = shapes["tok_embeddings.weight"]
    head_dim = shapes[f"layers.0.{_QN}"][0]
    kv_heads = shapes[f"layers.0.{_K}"][0] // head_dim
    ffn = shapes["layers.0.feed_forward.w1.weight"][0]
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
              "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": found,
              "num_key_value_heads": kv_heads,
              "head_dim": head_dim,
              "intermediate_size": ffn,
              "tie_word_embeddings": "lm_head.weight" not in shapes}
    spec = spec_from_hf(config, dtype)
    if {t.name for t in spec.tensors} != set(back) or any(
            tuple(shapes[back[t.name]]) != t.shape for t in spec.tensors):
        return None  # the names of a qwen3, not its shapes
    tensors = tuple(replace(t, name=back[t.name]) for t in spec.tensors)
    pp_only = tuple(replace(t, name="lm_head.weight", same_as=back.get(t.same_as or "", None))
                    for t in spec.pp_only)
    sizes: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", found), ("kv_heads", kv_heads),
        ("head_dim", head_dim), ("vocab", vocab), ("ffn", ffn))
    params = tuple((k, "torchtitan") if k == "names" else (k, v) for k, v in spec.params
                   if k != "layers")
    text = "qwen3:" + ",".join(f"{k}={v}" for k, v in sizes) + ",names=torchtitan"
    return text, replace(spec, tensors=tensors, pp_only=pp_only, params=params + sizes)
