"""Model presets: the tensors of well-known models, and :func:`parse_model`.

``parse_model("gpt:layers=24,hidden=1536,heads=16,vocab=50257")`` builds a
:class:`~ptcfs.types.ModelSpec` of a GPT with Megatron-LM names;
``vit:...`` a vision transformer with the same layers (:func:`vit`);
``llama:...`` and ``moe:...`` LLaMA and mixture-of-experts models with
Megatron-Core or Hugging Face names (:mod:`ptcfs.model.llama`). Layer indices
are global. GPT and ViT options:

- ``ffn`` (default ``4*hidden``) and ``seq`` (default 2048);
- ``swiglu=1``: the MLP's first matrix is a fused ``[gate; up]`` of
  ``2*ffn`` rows, split per group;
- ``names=mcore`` (GPT only): Megatron-Core ``GPTModel`` names
  (``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...), with
  ``norms=te`` or ``local`` as for LLaMA (:mod:`ptcfs.model.llama`), and
  ``tied=0`` for an output layer of its own (``output_layer.weight``);
  the default ``names=megatron`` keeps the legacy Megatron-LM names.

Every preset takes ``dtype`` (``fp16``, ``bf16``, ``fp32``) and
``optimizer`` (one of :data:`~ptcfs.model.modelkit.OPTIMIZERS`) as keyword
arguments; optimizer state is added by :func:`~ptcfs.model.modelkit.with_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable

from ptcfs.errors import InvalidConfig
from ptcfs.model.llama import NAMES, NORMS, llama, moe
from ptcfs.model.modelkit import OPTIMIZERS, VOCAB_PAD, check_dtype, with_optimizer
from ptcfs.types import ModelSpec, ShardRule, Stage, TensorSpec

__all__ = ["gpt", "vit", "llama", "moe", "parse_model", "with_optimizer", "PRESETS",
           "OPTIMIZERS", "VOCAB_PAD", "GPT_NAMES"]

#: The naming schemes of the GPT preset: legacy Megatron-LM or Megatron-Core.
GPT_NAMES = ("megatron", "mcore")


def _layer(i: int, h: int, f: int, dtype: str, swiglu: bool) -> list[TensorSpec]:
    p = f"encoder.layers.{i}."
    col = ShardRule(split_dim=0, stage=i)
    row = ShardRule(split_dim=1, stage=i)
    rep = ShardRule(stage=i)
    up_rows = 2 * f if swiglu else f
    up_rule = ShardRule(split_dim=0, groups=2 if swiglu else 1, stage=i)
    return [
        TensorSpec(p + "input_layernorm.weight", (h,), dtype, rep),
        TensorSpec(p + "input_layernorm.bias", (h,), dtype, rep),
        TensorSpec(p + "self_attention.query_key_value.weight", (3 * h, h), dtype, col),
        TensorSpec(p + "self_attention.query_key_value.bias", (3 * h,), dtype, col),
        TensorSpec(p + "self_attention.dense.weight", (h, h), dtype, row),
        TensorSpec(p + "self_attention.dense.bias", (h,), dtype, rep),
        TensorSpec(p + "post_attention_layernorm.weight", (h,), dtype, rep),
        TensorSpec(p + "post_attention_layernorm.bias", (h,), dtype, rep),
        TensorSpec(p + "mlp.dense_h_to_4h.weight", (up_rows, h), dtype, up_rule),
        TensorSpec(p + "mlp.dense_h_to_4h.bias", (up_rows,), dtype, up_rule),
        TensorSpec(p + "mlp.dense_4h_to_h.weight", (h, f), dtype, row),
        TensorSpec(p + "mlp.dense_4h_to_h.bias", (h,), dtype, rep),
    ]


def _mcore_layer(i: int, h: int, f: int, dtype: str, swiglu: bool, norms: str
                 ) -> list[TensorSpec]:
    """A GPT layer of Megatron-Core (LayerNorm, biases), in module order."""
    p = f"decoder.layers.{i}."
    col = ShardRule(split_dim=0, stage=i)
    row = ShardRule(split_dim=1, stage=i)
    rep = ShardRule(stage=i)
    up_rows = 2 * f if swiglu else f
    up_rule = ShardRule(split_dim=0, groups=2 if swiglu else 1, stage=i)
    te = norms == "te"

    def norm(name: str) -> list[TensorSpec]:
        return [TensorSpec(p + name + s, (h,), dtype, rep) for s in ("weight", "bias")]

    attn_norm = norm("self_attention.linear_qkv.layer_norm_" if te else "input_layernorm.")
    mlp_norm = norm("mlp.linear_fc1.layer_norm_" if te else "pre_mlp_layernorm.")
    return [
        *([] if te else attn_norm),
        TensorSpec(p + "self_attention.linear_proj.weight", (h, h), dtype, row),
        TensorSpec(p + "self_attention.linear_proj.bias", (h,), dtype, rep),
        *(attn_norm if te else []),
        TensorSpec(p + "self_attention.linear_qkv.weight", (3 * h, h), dtype, col),
        TensorSpec(p + "self_attention.linear_qkv.bias", (3 * h,), dtype, col),
        *mlp_norm,
        TensorSpec(p + "mlp.linear_fc1.weight", (up_rows, h), dtype, up_rule),
        TensorSpec(p + "mlp.linear_fc1.bias", (up_rows,), dtype, up_rule),
        TensorSpec(p + "mlp.linear_fc2.weight", (h, f), dtype, row),
        TensorSpec(p + "mlp.linear_fc2.bias", (h,), dtype, rep),
    ]


def gpt(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    ffn: int | None = None,
    seq: int = 2048,
    swiglu: bool = False,
    dtype: str = "fp16",
    optimizer: str = "none",
    names: str = "megatron",
    norms: str = "te",
    tied: bool = True,
) -> ModelSpec:
    """A GPT with global layer indices: legacy Megatron-LM names, or
    Megatron-Core's with ``names="mcore"``."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("vocab", vocab), ("seq", seq)):
        if value < 1:
            raise InvalidConfig(f"gpt: {name}={value} must be at least 1")
    if hidden % heads:
        raise InvalidConfig(f"gpt: heads={heads} does not divide hidden={hidden}")
    check_dtype("gpt", dtype)
    f = ffn if ffn is not None else 4 * hidden
    if f < 1:
        raise InvalidConfig(f"gpt: ffn={f} must be at least 1")
    if names not in GPT_NAMES:
        raise InvalidConfig(f"gpt: unknown names={names!r}; use megatron or mcore")
    if norms not in NORMS:
        raise InvalidConfig(f"gpt: unknown norms={norms!r}; use te or local")
    if names == "mcore":
        return with_optimizer(_mcore_gpt(layers, hidden, heads, vocab, f, seq, swiglu, dtype,
                                         norms, tied), optimizer)
    if not tied:
        raise InvalidConfig("gpt: tied=0 needs names=mcore (the legacy GPT ties its output "
                            "layer to the embedding)")
    emb_rule = ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="first")
    tensors = [
        TensorSpec("embedding.word_embeddings.weight", (vocab, hidden), dtype, emb_rule),
        TensorSpec("embedding.position_embeddings.weight", (seq, hidden), dtype,
                   ShardRule(stage="first")),
    ]
    for i in range(layers):
        tensors += _layer(i, hidden, f, dtype, swiglu)
    last: Stage = "last"
    tensors += [
        TensorSpec("encoder.final_layernorm.weight", (hidden,), dtype, ShardRule(stage=last)),
        TensorSpec("encoder.final_layernorm.bias", (hidden,), dtype, ShardRule(stage=last)),
    ]
    head = TensorSpec(
        "word_embeddings_for_head.weight", (vocab, hidden), dtype,
        ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="last"),
        same_as="embedding.word_embeddings.weight",
    )
    params: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab),
        ("ffn", f), ("seq", seq), ("swiglu", int(swiglu)), ("dtype", dtype),
    )
    model = ModelSpec("gpt", layers, tuple(tensors), (("heads", heads),), (head,), params)
    return with_optimizer(model, optimizer)


def _mcore_gpt(layers: int, hidden: int, heads: int, vocab: int, f: int, seq: int,
               swiglu: bool, dtype: str, norms: str, tied: bool) -> ModelSpec:
    emb = "embedding.word_embeddings.weight"
    tensors = [
        TensorSpec(emb, (vocab, hidden), dtype,
                   ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="first")),
        TensorSpec("embedding.position_embeddings.weight", (seq, hidden), dtype,
                   ShardRule(stage="first")),
    ]
    for i in range(layers):
        tensors += _mcore_layer(i, hidden, f, dtype, swiglu, norms)
    tensors += [TensorSpec(f"decoder.final_layernorm.{s}", (hidden,), dtype,
                           ShardRule(stage="last")) for s in ("weight", "bias")]
    head = TensorSpec("output_layer.weight", (vocab, hidden), dtype,
                      ShardRule(split_dim=0, pad_multiple=VOCAB_PAD, stage="last"),
                      same_as=emb if tied else None)
    if not tied:
        tensors.append(head)
    params: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab),
        ("ffn", f), ("seq", seq), ("swiglu", int(swiglu)), ("names", "mcore"),
        ("norms", norms), ("tied", int(tied)), ("dtype", dtype),
    )
    return ModelSpec("gpt", layers, tuple(tensors), (("heads", heads),),
                     (head,) if tied else (), params)


def vit(
    layers: int,
    hidden: int,
    heads: int,
    image: int = 224,
    patch: int = 16,
    channels: int = 3,
    classes: int = 1000,
    ffn: int | None = None,
    swiglu: bool = False,
    dtype: str = "fp16",
    optimizer: str = "none",
) -> ModelSpec:
    """A vision transformer: Megatron-LM layers, with the patch embedding as a
    convolution ``[hidden, channels, patch, patch]``, the class token
    ``[1, 1, hidden]`` and position embeddings ``[1, patches + 1, hidden]``
    (replicated, first stage) and a classification head (last stage)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("image", image), ("patch", patch), ("channels", channels),
                        ("classes", classes)):
        if value < 1:
            raise InvalidConfig(f"vit: {name}={value} must be at least 1")
    if hidden % heads:
        raise InvalidConfig(f"vit: heads={heads} does not divide hidden={hidden}")
    if image % patch:
        raise InvalidConfig(f"vit: patch={patch} does not divide image={image}")
    check_dtype("vit", dtype)
    f = ffn if ffn is not None else 4 * hidden
    first, last = ShardRule(stage="first"), ShardRule(stage="last")
    n = (image // patch) ** 2
    tensors = [
        TensorSpec("embedding.patch_embeddings.weight", (hidden, channels, patch, patch), dtype,
                   first),
        TensorSpec("embedding.patch_embeddings.bias", (hidden,), dtype, first),
        TensorSpec("embedding.cls_token", (1, 1, hidden), dtype, first),
        TensorSpec("embedding.position_embeddings", (1, n + 1, hidden), dtype, first),
    ]
    for i in range(layers):
        tensors += _layer(i, hidden, f, dtype, swiglu)
    tensors += [
        TensorSpec("encoder.final_layernorm.weight", (hidden,), dtype, last),
        TensorSpec("encoder.final_layernorm.bias", (hidden,), dtype, last),
        TensorSpec("head.weight", (classes, hidden), dtype, last),
        TensorSpec("head.bias", (classes,), dtype, last),
    ]
    params: tuple[tuple[str, int | str], ...] = (
        ("layers", layers), ("hidden", hidden), ("heads", heads), ("image", image),
        ("patch", patch), ("channels", channels), ("classes", classes), ("ffn", f),
        ("swiglu", int(swiglu)), ("dtype", dtype),
    )
    model = ModelSpec("vit", layers, tuple(tensors), (("heads", heads),), (), params)
    return with_optimizer(model, optimizer)


_LLAMA = ("layers", "hidden", "heads", "kv_heads", "vocab", "ffn")
#: Each preset's options: name → "int", "bool" (0 or 1) or the allowed words.
_OPTIONS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "gpt": {**dict.fromkeys(("layers", "hidden", "heads", "vocab", "ffn", "seq"), "int"),
            "swiglu": "bool", "names": GPT_NAMES, "norms": NORMS, "tied": "bool"},
    "vit": {**dict.fromkeys(("layers", "hidden", "heads", "image", "patch", "channels",
                             "classes", "ffn"), "int"), "swiglu": "bool"},
    "llama": {**dict.fromkeys(_LLAMA, "int"), "tied": "bool", "names": NAMES, "norms": NORMS},
    "moe": {**dict.fromkeys(_LLAMA + ("experts", "topk"), "int"), "tied": "bool",
            "names": NAMES, "norms": NORMS},
}
_REQUIRED = {"gpt": ("layers", "hidden", "heads", "vocab"), "vit": ("layers", "hidden", "heads"),
             "llama": _LLAMA, "moe": _LLAMA + ("experts",)}
PRESETS: dict[str, Callable[..., ModelSpec]] = {"gpt": gpt, "vit": vit, "llama": llama,
                                                "moe": moe}


def parse_model(text: str, dtype: str = "fp16", optimizer: str = "none") -> ModelSpec:
    """A model from a preset text, ``"<preset>:key=value,..."``:

    - ``gpt:layers=L,hidden=H,heads=A,vocab=V[,ffn=F][,seq=S][,swiglu=0|1]``
      ``[,names=megatron|mcore][,norms=te|local][,tied=1|0]``
    - ``vit:layers=L,hidden=H,heads=A[,image=I][,patch=P][,channels=C][,classes=K]``
    - ``llama:layers=L,hidden=H,heads=A,kv_heads=G,vocab=V,ffn=F[,tied=0|1][,names=mcore|hf]``
      ``[,norms=te|local]``
    - ``moe:`` llama's options and ``experts=E[,topk=K]``.
    """
    kind, _, rest = text.partition(":")
    if kind not in PRESETS:
        raise InvalidConfig(f"unknown model {kind!r}; known presets: {', '.join(PRESETS)}")
    options = _OPTIONS[kind]
    args: dict[str, int | str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep or key not in options:
            raise InvalidConfig(
                f"bad model option {item!r}; expected key=value with key one of "
                + ", ".join(options))
        if key in args:
            raise InvalidConfig(f"model option {key} is given twice in {text!r}")
        kind_of = options[key]
        if isinstance(kind_of, tuple):
            if val not in kind_of:
                raise InvalidConfig(f"model option {key}={val!r}: use one of {', '.join(kind_of)}")
            args[key] = val
            continue
        try:
            args[key] = int(val)
        except ValueError:
            raise InvalidConfig(f"model option {key}={val!r} is not a whole number") from None
        if kind_of == "bool" and args[key] not in (0, 1):
            raise InvalidConfig(f"model option {key}={val} must be 0 or 1")
    missing = [k for k in _REQUIRED[kind] if k not in args]
    if missing:
        raise InvalidConfig(f"model {text!r} lacks {', '.join(missing)}")
    for key, kind_of in options.items():
        if kind_of == "bool" and key in args:
            args[key] = bool(args[key])
    return PRESETS[kind](**args, dtype=dtype, optimizer=optimizer)
