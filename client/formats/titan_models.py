"""torchtitan models other than llama3, recognised from a checkpoint's names.

torchtitan's qwen3 (dense and mixture-of-experts) and deepseek_v3 name their
tensors as their state-dict adapters to Hugging Face say
(``Qwen3StateDictAdapter`` / ``DeepSeekV3StateDictAdapter.from_hf_map``,
read from the installed torchtitan, not copied here): qwen3 has llama3's
names plus the per-head norms ``attention.q_norm``/``attention.k_norm``;
deepseek_v3 its low-rank attention (MLA: ``attention.wq`` or
``wq_a``/``q_norm``/``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``);
both MoE layers a router (``moe.router.gate``), the routed experts stacked
in one tensor per projection (``moe.routed_experts.inner_experts.w1_EFD``,
``[experts, hidden, dim]``), deepseek_v3 shared experts
(``moe.shared_experts.w1``...) and the load-balancing bias
(``moe.expert_bias_E``). The import gives a job one tensor per expert
(:mod:`ptcfs.client.formats.titan_experts`), so the names here are those:
expert ``j`` of ``...w1_EFD`` is ``...w1_EFD.<j>``, which the adapter maps to
Hugging Face's ``mlp.experts.<j>.gate_proj.weight``.

:func:`qwen3_titan` and :func:`deepseek_titan` rename a checkpoint's tensors
to Hugging Face's, build transformers' config (``Qwen3Config``,
``Qwen3MoeConfig``, ``DeepseekV3Config``) from their shapes and take the
spec from transformers (:func:`~ptcfs.client.formats.hf_spec.spec_from_hf`:
its tensor-parallel plan, MLA split by heads, each expert's tensors on
their expert), named back as given. The shapes tell every size: qwen3's
query norm's length is its head size (so the query and key rows give the
heads); deepseek_v3's head count and head sizes follow from ``wq`` (or
``wq_b``), ``wkv_a``, ``kv_norm``, ``wkv_b`` and ``wo``; a ``--heads`` that
disagrees is refused. What no tensor holds (the RoPE base, the norms'
epsilon, the experts each token takes) changes no tensor and is left at
transformers' defaults. qwen3's ``expert_bias_E``, which the adapter gives
no Hugging Face name (torchtitan drops it on its own export), is kept
replicated on its layer's stage. deepseek_v3's multi-token-prediction
layers (``mtp_layers``) are not recognised.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache, partial
from types import SimpleNamespace

from ptcfs.client.formats.hf_spec import spec_from_hf
from ptcfs.dcp.titan import GROUPED, expert_name, expert_of
from ptcfs.errors import CheckpointError
from ptcfs.model.recognize import hf_names
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

__all__ = ["NAMES", "deepseek_titan", "hf_titan_name", "norm_heads", "qwen3_hf_to_titan",
           "qwen3_titan", "qwen3_titan_to_hf", "titan_hf_name", "titan_only"]

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)")
_Q, _K, _QN = ("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight",
               "attention.q_norm.weight")
_GATE, _BIAS = "moe.router.gate.weight", "moe.expert_bias_E"
_W1 = GROUPED.lstrip(".") + "w1_EFD"
#: each model's state-dict adapter (module, class) in the installed torchtitan
_ADAPTERS = {"qwen3": ("torchtitan.models.qwen3.state_dict_adapter", "Qwen3StateDictAdapter"),
             "deepseek_v3": ("torchtitan.models.deepseek_v3.state_dict_adapter",
                             "DeepSeekV3StateDictAdapter")}


@dataclass(frozen=True)
class _Maps:
    """torchtitan → Hugging Face names: whole tensors, per-layer suffixes
    (after ``layers.<i>.``), stacked experts' suffixes → Hugging Face's
    with ``{}`` for the expert."""

    whole: dict[str, str]
    layer: dict[str, str]
    experts: dict[str, str]


@cache
def _maps(model: str) -> _Maps | None:
    """The names of ``model``'s adapter; None without torchtitan."""
    module, cls = _ADAPTERS[model]
    try:
        adapter = getattr(importlib.import_module(module), cls)
    except ImportError:
        return None
    hf_map: dict[str, str | None] = {}
    for q_lora in (0, 1):  # deepseek_v3's adapter names wq, or wq_a/wq_b, by the config's rank
        stub = SimpleNamespace(layers=[SimpleNamespace(attention=SimpleNamespace(
            q_lora_rank=q_lora))])
        hf_map.update(adapter(stub, None).from_hf_map)
    out = _Maps({}, {}, {})
    for hf, titan in hf_map.items():
        if titan is None:
            continue  # buffers it drops
        if hf.count("{}") == 2:
            out.experts[titan.removeprefix("layers.{}.")] = hf.removeprefix(
                "model.layers.{}.").replace("{}", "{j}")
        elif "{}" in hf:
            out.layer[titan.removeprefix("layers.{}.")] = hf.removeprefix("model.layers.{}.")
        else:
            out.whole[titan] = hf
    return out


def titan_hf_name(model: str, name: str) -> str | None:
    """The Hugging Face name of a job's tensor of torchtitan ``model``'s names
    (an expert's as ``<stacked>.<j>``); None: not one."""
    maps = _maps(model)
    if maps is None:
        return None
    if name in maps.whole:
        return maps.whole[name]
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    i, rest = m.groups()
    if rest in maps.layer:
        return f"model.layers.{i}.{maps.layer[rest]}"
    e = expert_of(name)
    if e is not None:
        stacked = _LAYER.fullmatch(e[0])
        hf = maps.experts.get(stacked.group(2)) if stacked else None
        return f"model.layers.{i}.{hf.format(j=e[1])}" if hf else None
    return None


def hf_titan_name(model: str, name: str) -> str | None:
    """The job's torchtitan name of a Hugging Face tensor name of ``model``."""
    maps = _maps(model)
    if maps is None:
        return None
    for titan, hf in maps.whole.items():
        if hf == name:
            return titan
    m = _HF_EXPERT.fullmatch(name)
    if m is not None:
        i, j, rest = m.groups()
        stacked = next((t for t, hf in maps.experts.items()
                        if hf == f"mlp.experts.{{j}}.{rest}"), None)
        return expert_name(f"layers.{i}.{stacked}", int(j)) if stacked else None
    m = _HF_LAYER.fullmatch(name)
    for titan, hf in maps.layer.items():
        if m is not None and hf == m.group(2):
            return f"layers.{m.group(1)}.{titan}"
    return None


qwen3_titan_to_hf: Callable[[str], str | None] = partial(titan_hf_name, "qwen3")
qwen3_hf_to_titan: Callable[[str], str | None] = partial(hf_titan_name, "qwen3")
#: each model's (torchtitan → Hugging Face, Hugging Face → torchtitan) names
NAMES: dict[str, tuple[Callable[[str], str | None], Callable[[str], str | None]]] = {
    m: (partial(titan_hf_name, m), partial(hf_titan_name, m)) for m in _ADAPTERS}


def titan_only(name: str) -> bool:
    """A torchtitan tensor that Hugging Face's model may lack: the MoE's
    load-balancing bias (qwen3's adapter names none)."""
    return name.endswith(f".{_BIAS}") and _LAYER.fullmatch(name) is not None


def norm_heads(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The attention heads of a model with per-head query norms (qwen3):
    query rows over the norm's length; None for a model without them."""
    norm, q = shapes.get(f"layers.0.{_QN}"), shapes.get(f"layers.0.{_Q}")
    if norm is None or q is None or len(norm) != 1 or not norm[0] or q[0] % norm[0]:
        return None
    return q[0] // norm[0]


def _layers(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return 1 + max((int(m.group(1)) for n in shapes if (m := _LAYER.fullmatch(n))), default=-1)


def _moe(shapes: Mapping[str, tuple[int, ...]], layers: int
         ) -> tuple[list[int], list[int], int, int, int]:
    """``(dense layers, MoE layers, dense hidden size, experts, expert hidden
    size)`` (0 where there is none)."""
    dense = [i for i in range(layers) if f"layers.{i}.feed_forward.w1.weight" in shapes]
    moe = [i for i in range(layers) if f"layers.{i}.{_GATE}" in shapes]
    ffn = shapes[f"layers.{dense[0]}.feed_forward.w1.weight"][0] if dense else 0
    experts = shapes[f"layers.{moe[0]}.{_GATE}"][0] if moe else 0
    w1 = shapes.get(expert_name(f"layers.{moe[0]}.{_W1}", 0)) if moe else None
    return dense, moe, ffn, experts, w1[0] if w1 else 0


def _heads_agree(model: str, found: int, heads: int | None) -> None:
    if heads is not None and heads != found:
        raise CheckpointError(f"--heads {heads} does not fit the checkpoint's {model}: its "
                              f"shapes give {found} heads")


def _named_back(model: str, config: dict[str, object], dtype: str,
                shapes: Mapping[str, tuple[int, ...]], back: dict[str, str],
                extra: list[str], sizes: tuple[tuple[str, int | str], ...],
                absent: str | None = None) -> tuple[str, ModelSpec] | None:
    """transformers' spec of ``config`` under the checkpoint's names
    (``back``: Hugging Face name → the checkpoint's), less its tensors
    named ``...<absent>``, ``extra`` tensors replicated on their layer's
    stage; None when its tensors are not exactly the checkpoint's."""
    spec = spec_from_hf(config, dtype)
    if absent is not None:
        spec = replace(spec, tensors=tuple(t for t in spec.tensors
                                           if not t.name.endswith(absent)))
    if {t.name for t in spec.tensors} != set(back) or any(
            tuple(shapes[back[t.name]]) != t.shape for t in spec.tensors):
        return None  # the names of the model, not its shapes
    tensors = tuple(replace(t, name=back[t.name]) for t in spec.tensors) + tuple(
        TensorSpec(n, tuple(shapes[n]), dtype, ShardRule(stage=int(n.split(".")[1])))
        for n in extra)
    pp_only = tuple(replace(t, name=back.get(t.name, t.name), same_as=back.get(
        t.same_as or "", None)) for t in spec.pp_only)
    params = tuple((k, "torchtitan") if k == "names" else (k, v) for k, v in spec.params
                   if k != "layers")
    text = f"{model}:" + ",".join(f"{k}={v}" for k, v in sizes) + ",names=torchtitan"
    return text, replace(spec, tensors=tensors, pp_only=pp_only, params=params + sizes)


def qwen3_titan(shapes: Mapping[str, tuple[int, ...]], dtype: str, heads: int | None = None
                ) -> tuple[str, ModelSpec] | None:
    """``(model text, spec)`` when ``shapes`` are exactly a torchtitan qwen3's
    tensors (dense, or with experts, one tensor per expert), else None."""
    extra = [n for n in shapes if titan_only(n) and qwen3_titan_to_hf(n) is None]
    back = hf_names({n: s for n, s in shapes.items() if n not in extra}, qwen3_titan_to_hf)
    found = norm_heads(shapes)
    if back is None or found is None or "tok_embeddings.weight" not in shapes:
        return None
    _heads_agree("qwen3", found, heads)
    layers = _layers(shapes)
    vocab, hidden = shapes["tok_embeddings.weight"]
    head_dim = shapes[f"layers.0.{_QN}"][0]
    kv_heads = shapes[f"layers.0.{_K}"][0] // head_dim
    dense, moe, ffn, experts, moe_ffn = _moe(shapes, layers)
    config: dict[str, object] = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": found,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": ffn,
        "tie_word_embeddings": "lm_head.weight" not in shapes}
    sizes: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", found), ("kv_heads", kv_heads),
        ("head_dim", head_dim), ("vocab", vocab)) + ((("ffn", ffn),) if dense else ())
    if moe:
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      intermediate_size=ffn or moe_ffn, num_experts=experts,
                      moe_intermediate_size=moe_ffn, num_experts_per_tok=1,
                      decoder_sparse_step=1, mlp_only_layers=dense)
        sizes += (("experts", experts), ("moe_ffn", moe_ffn))
    return _named_back("qwen3" if not moe else "qwen3_moe", config, dtype, shapes, back, extra,
                       sizes)


def _mla(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int] | None:
    """deepseek_v3's attention sizes from layer 0's shapes (None: not MLA)."""
    a = "layers.0.attention."
    q = shapes.get(f"{a}wq.weight") or shapes.get(f"{a}wq_b.weight")
    kv_a, kv_norm = shapes.get(f"{a}wkv_a.weight"), shapes.get(f"{a}kv_norm.weight")
    kv_b, wo = shapes.get(f"{a}wkv_b.weight"), shapes.get(f"{a}wo.weight")
    if q is None or kv_a is None or kv_norm is None or kv_b is None or wo is None:
        return None
    kv_lora = kv_norm[0]
    rope = kv_a[0] - kv_lora
    heads = (q[0] - kv_b[0] + wo[1]) // rope if rope > 0 else 0
    if heads < 1 or heads * rope != q[0] - kv_b[0] + wo[1] or (kv_b[0] - wo[1]) % heads or \
            wo[1] % heads or kv_b[0] <= wo[1]:
        return None
    q_a = shapes.get(f"{a}wq_a.weight")
    return {"heads": heads, "q_lora": q_a[0] if q_a else 0, "kv_lora": kv_lora,
            "qk_nope": (kv_b[0] - wo[1]) // heads, "qk_rope": rope, "v_head": wo[1] // heads}


def deepseek_titan(shapes: Mapping[str, tuple[int, ...]], dtype: str, heads: int | None = None
                   ) -> tuple[str, ModelSpec] | None:
    """``(model text, spec)`` when ``shapes`` are exactly a torchtitan
    deepseek_v3's tensors (one tensor per expert; no multi-token prediction
    layers), else None."""
    back = hf_names(shapes, NAMES["deepseek_v3"][0])
    mla = _mla(shapes)
    if back is None or mla is None or "tok_embeddings.weight" not in shapes:
        return None
    _heads_agree("deepseek_v3", mla["heads"], heads)
    layers = _layers(shapes)
    vocab, hidden = shapes["tok_embeddings.weight"]
    dense, moe, ffn, experts, moe_ffn = _moe(shapes, layers)
    shared = shapes.get(f"layers.{moe[0]}.moe.shared_experts.w1.weight") if moe else None
    if not moe or dense != list(range(len(dense))) or shared is None or not moe_ffn or \
            shared[0] % moe_ffn:
        return None  # transformers' DeepSeek-V3: dense layers first, then MoE with shared experts
    config: dict[str, object] = {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": mla["heads"], "num_key_value_heads": mla["heads"],
        "intermediate_size": ffn or moe_ffn, "moe_intermediate_size": moe_ffn,
        "n_routed_experts": experts, "n_shared_experts": shared[0] // moe_ffn,
        "first_k_dense_replace": len(dense), "q_lora_rank": mla["q_lora"] or None,
        "kv_lora_rank": mla["kv_lora"], "qk_nope_head_dim": mla["qk_nope"],
        "qk_rope_head_dim": mla["qk_rope"], "head_dim": mla["qk_rope"],
        "v_head_dim": mla["v_head"], "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
        "tie_word_embeddings": "lm_head.weight" not in shapes}
    sizes: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), *mla.items(), ("vocab", vocab), ("ffn", ffn),
        ("dense_layers", len(dense)), ("experts", experts), ("moe_ffn", moe_ffn),
        ("shared_experts", shared[0] // moe_ffn))
    bias = any(n.endswith(f".{_BIAS}") for n in shapes)  # a MoE without load_balance_coeff
    return _named_back("deepseek_v3", config, dtype, shapes, back, [], sizes,
                       None if bias else ".mlp.gate.e_score_correction_bias")
