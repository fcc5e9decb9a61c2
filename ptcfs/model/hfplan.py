"""What a Hugging Face tensor-parallel plan says about each tensor, and the
one table of what it does not say (no torch here).

transformers gives each causal LM a plan (``config.base_model_tp_plan``
and the model class's ``_tp_plan``): module name pattern → style. A
parameter takes the style of its own name or of its module
(:func:`style_of`, as transformers' ``_get_parameter_tp_plan`` does), and
:func:`split_of` says what the style does to it, as transformers' parallel
layers cut it:

- ``colwise``, ``colwise_rep``, ``local_colwise``: a weight's output rows
  (``Shard(-2)``), a bias along its one dimension (``Shard(-1)``);
- ``rowwise``, ``rowwise_rep``, ``local_rowwise``: a weight's input columns
  (``Shard(-1)``), a bias replicated;
- ``local_packed_rowwise``: the last dimension, packed ``[gate | up]``,
  each half split on its own (``groups=2``);
- ``grouped_gemm``: stacked experts (``[experts, ...]``) by expert,
  dimension 0;
- ``replicate``, ``sequence_parallel``, ``gather``, ``local``,
  ``ep_router``: replicated (they act on activations or whole modules).

Where the plan is not the model's truth, :data:`TABLE` (keyed by
architecture, each row tested in ``tests/test_hf_spec.py``) says more, from
the config: Phi-3's fused ``qkv_proj`` (query heads, then key and value
heads: unequal parts that the plan's contiguous split would give one rank
all the queries and the other all the keys) and ``gate_up_proj``; the
low-rank attention (MLA) of DeepSeek-V2/V3, which the plan leaves whole,
split by heads. A row's split is given as :class:`~ptcfs.types.Part`\\ s,
so tensor parallelism must divide each part's heads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ptcfs.errors import InvalidConfig
from ptcfs.types import Part

__all__ = ["STYLES", "TABLE", "Split", "generic", "split_of", "style_of", "table_split"]

#: plan style → what it does to a parameter (see the module docstring);
#: None: replicated.
STYLES: dict[str, str | None] = {
    "colwise": "out", "colwise_rep": "out", "local_colwise": "out",
    "rowwise": "in", "rowwise_rep": "in", "local_rowwise": "in",
    "local_packed_rowwise": "packed", "grouped_gemm": "experts",
    "replicate": None, "sequence_parallel": None, "gather": None, "local": None,
    "ep_router": None,
}

#: ``(split dimension or None, groups, parts)`` of one tensor
Split = tuple[int | None, int, tuple[Part, ...]]


def generic(name: str) -> str:
    """A name with every number replaced by ``*``, as plans write them."""
    return re.sub(r"\d+", "*", name)


def style_of(name: str, plan: Mapping[str, str]) -> str | None:
    """The plan's style of parameter ``name``: its own, else its module's."""
    g = generic(name)
    if g in plan:
        return plan[g]
    module = g.rpartition(".")[0]
    return plan.get(module) if module else None


def split_of(name: str, shape: tuple[int, ...], style: str | None) -> Split:
    """How ``style`` cuts parameter ``name`` of ``shape`` (see the module docstring)."""
    if style is None:
        return None, 1, ()
    if style not in STYLES:
        raise InvalidConfig(f"{name}: the tensor-parallel plan gives it style {style!r}, which "
                            "ptcfs does not know; describe the model in a spec file "
                            "(`ptcctl spec --from-hf DIR` writes one to start from) and import "
                            "with --model-spec FILE")
    what = STYLES[style]
    ndim = len(shape)
    bias = name.endswith(".bias")
    if what is None or ndim == 0:
        return None, 1, ()
    if what == "out":
        return (ndim - 1 if bias or ndim == 1 else ndim - 2), 1, ()
    if what == "in":
        return (None if bias else ndim - 1), 1, ()
    if what == "packed":
        return ndim - 1, 2, ()
    return 0, 1, ()  # experts


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfig(f"config.json: {key} is {value!r}, not a whole number of at least 1")
    return value


def _heads(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head width)`` of a config."""
    heads = _int(config, "num_attention_heads")
    kv = _int(config, "num_key_value_heads", heads)
    width = config.get("head_dim") or _int(config, "hidden_size") // heads
    return heads, kv, width


def _phi3_qkv(c: Mapping[str, Any]) -> Split:
    heads, kv, hd = _heads(c)
    return 0, 1, (Part("q", heads * hd, heads, "heads"), Part("k", kv * hd, kv, "heads"),
                  Part("v", kv * hd, kv, "heads"))


def _gate_up(c: Mapping[str, Any]) -> Split:
    ffn = _int(c, "intermediate_size")
    return 0, 1, (Part("gate", ffn, ffn), Part("up", ffn, ffn))


def _mla(dim: int, width: Callable[[Mapping[str, Any]], int]) -> Callable[[Mapping[str, Any]],
                                                                          Split]:
    """A DeepSeek attention projection split by heads along ``dim``, each
    head ``width(config)`` wide."""
    def split(c: Mapping[str, Any]) -> Split:
        heads = _int(c, "num_attention_heads")
        return dim, 1, (Part("heads", heads * width(c), heads, "heads"),)

    return split


def _qk(c: Mapping[str, Any]) -> int:
    return _int(c, "qk_nope_head_dim") + _int(c, "qk_rope_head_dim")


def _kv(c: Mapping[str, Any]) -> int:
    return _int(c, "qk_nope_head_dim") + _int(c, "v_head_dim")


_DEEPSEEK: dict[str, Callable[[Mapping[str, Any]], Split]] = {
    "model.layers.*.self_attn.q_proj.weight": _mla(0, _qk),
    "model.layers.*.self_attn.q_b_proj.weight": _mla(0, _qk),
    "model.layers.*.self_attn.kv_b_proj.weight": _mla(0, _kv),
    "model.layers.*.self_attn.o_proj.weight": _mla(1, lambda c: _int(c, "v_head_dim")),
}

#: architecture → generic tensor name → its split from the config: what
#: the plan does not say (see the module docstring).
TABLE: dict[str, dict[str, Callable[[Mapping[str, Any]], Split]]] = {
    "Phi3ForCausalLM": {"model.layers.*.self_attn.qkv_proj.weight": _phi3_qkv,
                        "model.layers.*.mlp.gate_up_proj.weight": _gate_up},
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
}


def table_split(arch: str, name: str, config: Mapping[str, Any]) -> Split | None:
    """:data:`TABLE`'s split of tensor ``name`` of ``arch``, or None."""
    row = TABLE.get(arch, {}).get(generic(name))
    return None if row is None else row(config)
