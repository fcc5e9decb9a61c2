"""LLaMA and mixture-of-experts presets, with Megatron-Core or Hugging Face names.

``llama:layers=L,hidden=H,heads=A,kv_heads=G,vocab=V,ffn=F[,tied=0][,names=mcore][,norms=te]``
is a LLaMA: RMSNorm weights and no biases, rotary positions (no tensor),
grouped-query attention (``G`` key/value heads, ``head_dim = H / A``), a
SwiGLU MLP of ``F`` units, and an output layer of its own unless ``tied=1``.
``moe:...,experts=E[,topk=K]`` replaces every MLP by a router and ``E``
experts of ``F`` units (Mixtral); ``topk`` is only recorded.

``names=mcore`` (the default) gives Megatron-Core ``GPTModel`` state-dict
names, in the order the modules register their parameters. ``norms=te``
(the default) names the norms as the Transformer-Engine layer spec
(``get_gpt_layer_with_transformer_engine_spec``) does: the input norm is
fused into ``linear_qkv`` (``self_attention.linear_qkv.layer_norm_weight``),
the pre-MLP norm into ``linear_fc1`` (``mlp.linear_fc1.layer_norm_weight``),
except with experts, whose MLP has no ``linear_fc1`` (``pre_mlp_layernorm.weight``).
``norms=local`` names them as the local spec (``get_gpt_layer_local_spec``)
does: ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``. (Both
specs give the same keys in a ``torch_dist`` checkpoint, the fused ones.)
Experts are named as ``SequentialMLP`` names them,
``mlp.experts.local_experts.<j>`` with ``j`` global. ``linear_qkv``
holds, for each of the ``G`` query groups, that group's query heads, then
its key and its value, so an even split of its rows is the split by query
groups. The vocabulary is padded to a multiple of ``128 * tp``. With
``tied=1`` the last stage keeps a copy of the embedding
(``output_layer.weight``) when ``pp > 1``.

``names=hf`` gives exactly the state-dict names of Hugging Face
``LlamaForCausalLM`` / ``MixtralForCausalLM``: separate ``q/k/v_proj`` and
``gate/up_proj``, no vocabulary padding, and no ``lm_head`` when tied.

Tensor parallelism must divide ``heads`` and ``kv_heads`` (and, through the
tensors, ``ffn`` and, with ``hf`` names, ``vocab``). Layer indices and
expert indices are global.
"""

from __future__ import annotations

from ptcfs.errors import InvalidConfig
from ptcfs.model.modelkit import VOCAB_PAD, check_dtype, check_positive, with_optimizer
from ptcfs.types import ModelSpec, ShardRule, TensorSpec

__all__ = ["NAMES", "NORMS", "llama", "moe"]

#: The naming schemes of the presets.
NAMES = ("mcore", "hf")
#: How ``names=mcore`` names the norms: Transformer-Engine or local layer spec.
NORMS = ("te", "local")


def _rules(i: int, expert: int | None = None) -> tuple[ShardRule, ShardRule, ShardRule,
                                                       ShardRule]:
    """Column, row, fused ``[gate; up]`` and replicated rules of layer ``i``."""
    return (ShardRule(split_dim=0, stage=i, expert=expert),
            ShardRule(split_dim=1, stage=i, expert=expert),
            ShardRule(split_dim=0, groups=2, stage=i, expert=expert),
            ShardRule(stage=i, expert=expert))


def _mcore_layer(i: int, h: int, heads: int, kv: int, f: int, experts: int,
                 dtype: str, norms: str = "te") -> list[TensorSpec]:
    p = f"decoder.layers.{i}."
    hd = h // heads
    col, row, fused, rep = _rules(i)
    te = norms == "te"
    out = [] if te else [TensorSpec(p + "input_layernorm.weight", (h,), dtype, rep)]
    out.append(TensorSpec(p + "self_attention.linear_proj.weight", (h, heads * hd), dtype, row))
    if te:
        out.append(TensorSpec(p + "self_attention.linear_qkv.layer_norm_weight", (h,), dtype,
                              rep))
    out.append(TensorSpec(p + "self_attention.linear_qkv.weight", ((heads + 2 * kv) * hd, h),
                          dtype, col))
    if not experts:
        norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
        return out + [
            TensorSpec(p + norm, (h,), dtype, rep),
            TensorSpec(p + "mlp.linear_fc1.weight", (2 * f, h), dtype, fused),
            TensorSpec(p + "mlp.linear_fc2.weight", (h, f), dtype, row),
        ]
    out += [
        TensorSpec(p + "pre_mlp_layernorm.weight", (h,), dtype, rep),
        TensorSpec(p + "mlp.router.weight", (experts, h), dtype, rep),
    ]
    for j in range(experts):
        e = f"{p}mlp.experts.local_experts.{j}."
        _, erow, efused, _ = _rules(i, j)
        out += [TensorSpec(e + "linear_fc1.weight", (2 * f, h), dtype, efused),
                TensorSpec(e + "linear_fc2.weight", (h, f), dtype, erow)]
    return out


def _hf_layer(i: int, h: int, heads: int, kv: int, f: int, experts: int,
              dtype: str, norms: str = "te") -> list[TensorSpec]:
    p = f"model.layers.{i}."
    hd = h // heads
    col, row, _, rep = _rules(i)
    out = [
        TensorSpec(p + "input_layernorm.weight", (h,), dtype, rep),
        TensorSpec(p + "self_attn.q_proj.weight", (heads * hd, h), dtype, col),
        TensorSpec(p + "self_attn.k_proj.weight", (kv * hd, h), dtype, col),
        TensorSpec(p + "self_attn.v_proj.weight", (kv * hd, h), dtype, col),
        TensorSpec(p + "self_attn.o_proj.weight", (h, heads * hd), dtype, row),
        TensorSpec(p + "post_attention_layernorm.weight", (h,), dtype, rep),
    ]
    if not experts:
        return out + [
            TensorSpec(p + "mlp.gate_proj.weight", (f, h), dtype, col),
            TensorSpec(p + "mlp.up_proj.weight", (f, h), dtype, col),
            TensorSpec(p + "mlp.down_proj.weight", (h, f), dtype, row),
        ]
    out.append(TensorSpec(p + "block_sparse_moe.gate.weight", (experts, h), dtype, rep))
    for j in range(experts):
        e = f"{p}block_sparse_moe.experts.{j}."
        ecol, erow, _, _ = _rules(i, j)
        out += [TensorSpec(e + "w1.weight", (f, h), dtype, ecol),
                TensorSpec(e + "w2.weight", (h, f), dtype, erow),
                TensorSpec(e + "w3.weight", (f, h), dtype, ecol)]
    return out


def _build(preset: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
           ffn: int, experts: int, tied: bool, names: str, dtype: str,
           extra: tuple[tuple[str, int | str], ...], norms: str = "te") -> ModelSpec:
    check_positive(preset, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                   vocab=vocab, ffn=ffn)
    if hidden % heads:
        raise InvalidConfig(f"{preset}: heads={heads} does not divide hidden={hidden}")
    if heads % kv_heads:
        raise InvalidConfig(f"{preset}: kv_heads={kv_heads} does not divide heads={heads}")
    if names not in NAMES:
        raise InvalidConfig(f"{preset}: unknown names={names!r}; use mcore or hf")
    if norms not in NORMS:
        raise InvalidConfig(f"{preset}: unknown norms={norms!r}; use te or local")
    check_dtype(preset, dtype)
    last = ShardRule(stage="last")
    pp_only: tuple[TensorSpec, ...] = ()
    if names == "mcore":
        emb, norm, head = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                           "output_layer.weight")
        layer = _mcore_layer
        emb_rule = ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="first")
        head_rule = ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="last")
        if tied:
            pp_only = (TensorSpec(head, (vocab, hidden), dtype, head_rule, same_as=emb),)
    else:
        emb, norm, head = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
        layer = _hf_layer
        emb_rule = ShardRule(split_dim=0, stage="first")
        head_rule = ShardRule(split_dim=0, stage="last")
    tensors = [TensorSpec(emb, (vocab, hidden), dtype, emb_rule)]
    for i in range(layers):
        tensors += layer(i, hidden, heads, kv_heads, ffn, experts, dtype, norms)
    tensors.append(TensorSpec(norm, (hidden,), dtype, last))
    if not tied:
        tensors.append(TensorSpec(head, (vocab, hidden), dtype, head_rule))
    params: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
        ("vocab", vocab), ("ffn", ffn)) + extra + (
        ("tied", int(tied)), ("names", names)) + (
        (("norms", norms),) if names == "mcore" else ()) + (("dtype", dtype),)
    return ModelSpec(preset, layers, tuple(tensors), (("heads", heads), ("kv_heads", kv_heads)),
                     pp_only, params, experts)


def llama(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    ffn: int,
    tied: bool = False,
    names: str = "mcore",
    dtype: str = "fp16",
    optimizer: str = "none",
    norms: str = "te",
) -> ModelSpec:
    """A LLaMA with ``names`` ``mcore`` (Megatron-Core, with ``norms`` ``te`` or
    ``local``) or ``hf`` (Hugging Face)."""
    model = _build("llama", layers, hidden, heads, kv_heads, vocab, ffn, 0, tied, names, dtype,
                   (), norms)
    return with_optimizer(model, optimizer)


def moe(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    ffn: int,
    experts: int,
    topk: int = 2,
    tied: bool = False,
    names: str = "mcore",
    dtype: str = "fp16",
    optimizer: str = "none",
    norms: str = "te",
) -> ModelSpec:
    """A LLaMA whose MLPs are each a router and ``experts`` experts (Mixtral);
    every expert tensor's rule names its global expert index."""
    check_positive("moe", experts=experts, topk=topk)
    if topk > experts:
        raise InvalidConfig(f"moe: topk={topk} is more than experts={experts}")
    model = _build("moe", layers, hidden, heads, kv_heads, vocab, ffn, experts, tied, names,
                   dtype, (("experts", experts), ("topk", topk)), norms)
    return with_optimizer(model, optimizer)
