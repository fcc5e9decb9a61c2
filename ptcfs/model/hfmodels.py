"""Hugging Face models: the spec of a ``save_pretrained`` directory from its
``config.json``, and back (no torch here).

:func:`spec_from_config` knows five architectures (``architectures[0]``, else
``model_type``), each with the tensor names of its ``*ForCausalLM``
``state_dict`` in ``named_parameters()`` order:

- ``LlamaForCausalLM`` and ``MistralForCausalLM``: the ``llama`` preset with
  ``names=hf`` (:mod:`ptcfs.model.llama`); ``tie_word_embeddings`` gives ``tied``;
- ``Qwen2ForCausalLM``: the same with biases on ``q/k/v_proj``, split along
  dimension 0 like their weights;
- ``MixtralForCausalLM``: the ``moe`` preset with ``names=hf``;
- ``GPT2LMHeadModel``: :func:`gpt2`, HF's own names. Its ``Conv1D`` weights
  are stored ``[in, out]``, so column-parallel ones (``c_attn``, ``c_fc``)
  split dimension 1 and row-parallel ones (``c_proj``) dimension 0;
  ``c_attn`` is ``[q | k | v]`` along dimension 1, split per group
  (``groups=3``), which keeps whole heads on each rank when tp divides the
  heads. ``lm_head.weight`` is tied to ``transformer.wte.weight`` unless the
  config says ``tie_word_embeddings: false``.

No vocabulary padding (the embedding keeps the HF module's shape), so
tensor parallelism must divide the vocabulary. Every layout assumption is
checked against the config; one that does not hold raises
:class:`~ptcfs.errors.InvalidConfig` naming the key.

The job keeps the directory's ``config.json`` (and ``generation_config.json``,
and of a ``Trainer`` checkpoint ``trainer_state.json`` and ``scheduler.pt``,
the latter in base64) as text in the spec's ``params`` (:func:`with_hf_files`,
:func:`hf_files`), so an export writes them back as they were (with the
job's step); the optimizer's hyper-parameters, per group, go under
:data:`OPTIMIZER_GROUPS`. For a ``llama``/``moe`` preset job
with ``names=hf`` that has none, :func:`config_for_preset` writes one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ptcfs.errors import InvalidConfig
from ptcfs.model.llama import llama, moe
from ptcfs.model.modelkit import check_dtype, check_positive
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

__all__ = [
    "ARCHITECTURES",
    "BINARY_FILES",
    "CONFIG_FILES",
    "OPTIMIZER_GROUPS",
    "RECORDED_PARAMS",
    "architecture",
    "config_for_preset",
    "decays",
    "dumps",
    "gpt2",
    "hf_files",
    "spec_from_config",
    "torch_dtype_name",
    "with_dtypes",
    "with_hf_files",
    "with_param",
]

#: HF class → the ``model_type`` it belongs to.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "MixtralForCausalLM": "mixtral",
                 "GPT2LMHeadModel": "gpt2"}
_CLASS = {v: k for k, v in ARCHITECTURES.items()}
#: The files of a model directory a job keeps, and the ``params`` key of each.
CONFIG_FILES = {"config.json": "hf_config", "generation_config.json": "hf_generation_config",
                "trainer_state.json": "hf_trainer_state", "scheduler.pt": "hf_scheduler"}
#: Those of :data:`CONFIG_FILES` kept in base64.
BINARY_FILES = frozenset({"scheduler.pt"})
#: The ``params`` key of the optimizer's hyper-parameters (JSON: each group's
#: settings, without its ``params``), as the Trainer's ``optimizer.pt`` had them.
OPTIMIZER_GROUPS = "hf_optimizer_groups"
#: Every ``params`` key that holds something recorded, not a size.
RECORDED_PARAMS = frozenset({*CONFIG_FILES.values(), OPTIMIZER_GROUPS})
_TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def architecture(config: Mapping[str, Any]) -> str:
    """The HF class a config names: ``architectures[0]``, else its
    ``model_type``'s ``*ForCausalLM`` when ptcfs knows it; else the text."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        return str(archs[0])
    kind = str(config.get("model_type", "?"))
    return _CLASS.get(kind, kind)


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"config.json: {key} is {value!r}, not a whole number"
                            if key in config else f"config.json: has no {key}")
    return value


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise InvalidConfig(f"config.json: {key} is {value!r}, not true or false")
    return value


def _refuse(config: Mapping[str, Any], arch: str, *keys: str) -> None:
    for key in keys:
        if config.get(key):
            raise InvalidConfig(f"config.json: {key}={config[key]!r} adds tensors the {arch} "
                                "layout of ptcfs does not have; import it with --model-spec")


# HF registers a decoder layer's modules in this order (named_parameters order).
_LAYER_ORDER = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.",
                "self_attn.o_proj.", "mlp.", "block_sparse_moe.gate.",
                "block_sparse_moe.experts.", "input_layernorm.", "post_attention_layernorm.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _hf_order(t: TensorSpec) -> tuple[int, int, int]:
    if t.name == "model.embed_tokens.weight":
        return (0, 0, 0)
    m = _HF_LAYER.match(t.name)
    if m is None:
        return (2, 0, 0)  # model.norm, lm_head
    rest = m.group(2)
    return (1, int(m.group(1)), next(k for k, p in enumerate(_LAYER_ORDER) if rest.startswith(p)))


def _llama_family(config: Mapping[str, Any], arch: str, dtype: str) -> ModelSpec:
    kind = ARCHITECTURES[arch]
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    check_positive(arch, hidden_size=hidden, num_attention_heads=heads)
    kv = _int(config, "num_key_value_heads", heads)
    if hidden % heads:
        raise InvalidConfig(f"config.json: num_attention_heads={heads} does not divide "
                            f"hidden_size={hidden}")
    if kv < 1 or heads % kv:
        raise InvalidConfig(f"config.json: num_key_value_heads={kv} does not divide "
                            f"num_attention_heads={heads}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise InvalidConfig(f"config.json: head_dim={head_dim} is not hidden_size / "
                            f"num_attention_heads = {hidden // heads}, which ptcfs's {arch} "
                            "layout assumes; import it with --model-spec")
    if kind in ("llama", "mistral"):
        _refuse(config, arch, "attention_bias", "mlp_bias")
    layers, vocab = _int(config, "num_hidden_layers"), _int(config, "vocab_size")
    ffn, tied = _int(config, "intermediate_size"), _flag(config, "tie_word_embeddings", False)
    try:
        if kind == "mixtral":
            model = moe(layers, hidden, heads, kv, vocab, ffn, _int(config, "num_local_experts"),
                        _int(config, "num_experts_per_tok", 2), tied, "hf", dtype)
        else:
            model = llama(layers, hidden, heads, kv, vocab, ffn, tied, "hf", dtype)
    except InvalidConfig as e:
        raise InvalidConfig(f"config.json: {e}") from None
    tensors = list(model.tensors)
    if kind == "qwen2":
        hd = hidden // heads
        for i in range(model.layers):
            for proj, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                tensors.append(TensorSpec(f"model.layers.{i}.self_attn.{proj}_proj.bias",
                                          (rows,), dtype, ShardRule(split_dim=0, stage=i)))
    tensors.sort(key=lambda t: (_hf_order(t), t.name.endswith(".bias")))
    return replace(model, name=kind, tensors=tuple(tensors))


def gpt2(layers: int, hidden: int, heads: int, vocab: int, positions: int,
         ffn: int | None = None, tied: bool = True, dtype: str = "fp32") -> ModelSpec:
    """GPT-2 with the names of HF ``GPT2LMHeadModel`` (see the module docstring)."""
    check_positive("gpt2", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                   positions=positions)
    if hidden % heads:
        raise InvalidConfig(f"gpt2: n_head={heads} does not divide n_embd={hidden}")
    check_dtype("gpt2", dtype)
    f = ffn if ffn is not None else 4 * hidden
    check_positive("gpt2", n_inner=f)
    first = ShardRule(stage="first")
    tensors = [TensorSpec("transformer.wte.weight", (vocab, hidden), dtype,
                          ShardRule(split_dim=0, stage="first")),
               TensorSpec("transformer.wpe.weight", (positions, hidden), dtype, first)]
    for i in range(layers):
        p = f"transformer.h.{i}."
        rep, in_dim, out_dim = (ShardRule(stage=i), ShardRule(split_dim=0, stage=i),
                                ShardRule(split_dim=1, stage=i))
        qkv_w = ShardRule(split_dim=1, groups=3, stage=i)
        qkv_b = ShardRule(split_dim=0, groups=3, stage=i)
        tensors += [
            TensorSpec(p + "ln_1.weight", (hidden,), dtype, rep),
            TensorSpec(p + "ln_1.bias", (hidden,), dtype, rep),
            TensorSpec(p + "attn.c_attn.weight", (hidden, 3 * hidden), dtype, qkv_w),
            TensorSpec(p + "attn.c_attn.bias", (3 * hidden,), dtype, qkv_b),
            TensorSpec(p + "attn.c_proj.weight", (hidden, hidden), dtype, in_dim),
            TensorSpec(p + "attn.c_proj.bias", (hidden,), dtype, rep),
            TensorSpec(p + "ln_2.weight", (hidden,), dtype, rep),
            TensorSpec(p + "ln_2.bias", (hidden,), dtype, rep),
            TensorSpec(p + "mlp.c_fc.weight", (hidden, f), dtype, out_dim),
            TensorSpec(p + "mlp.c_fc.bias", (f,), dtype, in_dim),
            TensorSpec(p + "mlp.c_proj.weight", (f, hidden), dtype, in_dim),
            TensorSpec(p + "mlp.c_proj.bias", (hidden,), dtype, rep),
        ]
    last = ShardRule(stage="last")
    tensors += [TensorSpec("transformer.ln_f.weight", (hidden,), dtype, last),
                TensorSpec("transformer.ln_f.bias", (hidden,), dtype, last)]
    if not tied:
        tensors.append(TensorSpec("lm_head.weight", (vocab, hidden), dtype,
                                  ShardRule(split_dim=0, stage="last")))
    params: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab),
        ("ffn", f), ("seq", positions), ("tied", int(tied)), ("dtype", dtype))
    return ModelSpec("gpt2", layers, tuple(tensors), (("heads", heads),), (), params)


def _gpt2(config: Mapping[str, Any], dtype: str) -> ModelSpec:
    _refuse(config, "GPT2LMHeadModel", "add_cross_attention")
    try:
        ffn = _int(config, "n_inner") if config.get("n_inner") is not None else None
        return gpt2(_int(config, "n_layer"), _int(config, "n_embd"), _int(config, "n_head"),
                    _int(config, "vocab_size"), _int(config, "n_positions"), ffn,
                    _flag(config, "tie_word_embeddings", True), dtype)
    except InvalidConfig as e:
        raise InvalidConfig(f"config.json: {e}") from None


def spec_from_config(config: Mapping[str, Any], dtype: str) -> ModelSpec:
    """The parameters (no optimizer state) of the model ``config`` describes,
    all of ``dtype``; InvalidConfig for an architecture ptcfs does not know."""
    arch = architecture(config)
    if arch not in ARCHITECTURES:
        raise InvalidConfig(f"architecture {arch}")
    kind = ARCHITECTURES[arch]
    if config.get("model_type", kind) != kind:
        raise InvalidConfig(f"config.json: model_type {config['model_type']!r} does not go "
                            f"with {arch}")
    if kind == "gpt2":
        return _gpt2(config, dtype)
    return _llama_family(config, arch, dtype)


def with_dtypes(model: ModelSpec, dtypes: Mapping[str, str]) -> ModelSpec:
    """``model`` with the dtype of each tensor named in ``dtypes`` replaced."""
    tensors = tuple(replace(t, dtype=dtypes.get(t.name, t.dtype)) for t in model.tensors)
    return replace(model, tensors=tensors)


def with_hf_files(model: ModelSpec, files: Mapping[str, str]) -> ModelSpec:
    """``model`` recording the text of the :data:`CONFIG_FILES` in ``files``."""
    keep = tuple((k, v) for k, v in model.params if k not in CONFIG_FILES.values())
    add = tuple((CONFIG_FILES[f], text) for f, text in files.items() if f in CONFIG_FILES)
    return replace(model, params=keep + add)


def with_param(model: ModelSpec, key: str, value: str) -> ModelSpec:
    """``model`` with ``params[key]`` set to ``value``."""
    return replace(model, params=tuple((k, v) for k, v in model.params if k != key)
                   + ((key, value),))


def hf_files(model: ModelSpec) -> dict[str, str]:
    """The directory files a job recorded (file name → text)."""
    params = dict(model.params)
    return {f: str(params[k]) for f, k in CONFIG_FILES.items() if k in params}


def torch_dtype_name(dtype: str) -> str:
    """``bfloat16`` for ``bf16``: the name config.json gives a dtype."""
    return _TORCH_NAMES.get(dtype, "float32")


def config_for_preset(model: ModelSpec) -> dict[str, Any] | None:
    """A config.json for a ``llama``/``moe`` preset with ``names=hf``
    (LLaMA or Mixtral), else None."""
    p = dict(model.params)
    if model.name not in ("llama", "moe") or p.get("names") != "hf":
        return None
    missing = [k for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab") if k not in p]
    if missing:
        raise InvalidConfig(f"the {model.name} model records no {', '.join(missing)} (imported "
                            "from a checkpoint that does not say them?), which config.json needs; "
                            "import it again with --heads, or with --model giving them")
    arch = "MixtralForCausalLM" if model.name == "moe" else "LlamaForCausalLM"
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "hidden_size": p["hidden"], "intermediate_size": p["ffn"],
        "num_hidden_layers": p["layers"], "num_attention_heads": p["heads"],
        "num_key_value_heads": p["kv_heads"], "vocab_size": p["vocab"],
        "tie_word_embeddings": bool(p["tied"]),
        "torch_dtype": torch_dtype_name(str(p.get("dtype", "fp32")))}
    if model.name == "moe":
        out.update(num_local_experts=p["experts"], num_experts_per_tok=p["topk"])
    return out


_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                     r"_norm(?:$|\.)")]


def decays(t: TensorSpec) -> bool:
    """Whether the HF Trainer puts parameter ``t`` in its weight-decay group:
    no bias and no norm by name (its patterns) and, since it also leaves out
    every ``nn.LayerNorm`` (GPT-2's ``ln_*``), not 1-D."""
    return len(t.shape) >= 2 and not any(p.search(t.name.lower()) for p in _NO_DECAY)


def dumps(config: Mapping[str, Any]) -> str:
    """A config as ``save_pretrained`` writes it: indented, keys sorted."""
    return json.dumps(config, indent=2, sort_keys=True) + "\n"
