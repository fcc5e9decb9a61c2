"""Model presets: the tensors of well-known models with Megatron-LM names.

``parse_model("gpt:layers=24,hidden=1536,heads=16,vocab=50257")`` builds a
:class:`~ptcfs.types.ModelSpec`; ``vit:...`` a vision transformer with the
same layers (:func:`vit`). Layer indices are global. Options:

- ``ffn`` (default ``4*hidden``) and ``seq`` (default 2048);
- ``swiglu=1``: the MLP's first matrix is a fused ``[gate; up]`` of
  ``2*ffn`` rows, split per group;
- ``dtype`` (``fp16``, ``bf16``, ``fp32``) and ``optimizer`` (``none``,
  ``adam``) as keyword arguments of :func:`gpt`.
"""

from __future__ import annotations

from collections.abc import Callable

from ptcfs.errors import InvalidConfig
from ptcfs.types import DTYPE_SIZES, ModelSpec, ShardRule, Stage, TensorSpec

__all__ = ["gpt", "vit", "parse_model", "with_optimizer", "PRESETS", "VOCAB_PAD"]

#: Megatron pads the vocabulary to a multiple of this times tp.
VOCAB_PAD = 128
OPTIMIZERS = ("none", "adam")


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
) -> ModelSpec:
    """A GPT (Megatron-LM layout) with global layer indices."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("vocab", vocab), ("seq", seq)):
        if value < 1:
            raise InvalidConfig(f"gpt: {name}={value} must be at least 1")
    if hidden % heads:
        raise InvalidConfig(f"gpt: heads={heads} does not divide hidden={hidden}")
    if dtype not in DTYPE_SIZES:
        raise InvalidConfig(f"gpt: unknown dtype {dtype!r}; use fp16, bf16 or fp32")
    f = ffn if ffn is not None else 4 * hidden
    if f < 1:
        raise InvalidConfig(f"gpt: ffn={f} must be at least 1")
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
    if dtype not in DTYPE_SIZES:
        raise InvalidConfig(f"vit: unknown dtype {dtype!r}; use fp16, bf16 or fp32")
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


def with_optimizer(model: ModelSpec, optimizer: str) -> ModelSpec:
    """Add optimizer state tensors, sharded like their parameters.

    Adam keeps fp32 ``optim/exp_avg/<name>`` and ``optim/exp_avg_sq/<name>``
    and, for fp16/bf16 parameters, an fp32 master copy ``optim/master/<name>``.
    """
    if optimizer not in OPTIMIZERS:
        raise InvalidConfig(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if optimizer == "none":
        return model

    def states(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        out = list(specs)
        for s in specs:
            kinds = ["exp_avg", "exp_avg_sq"]
            if s.dtype in ("fp16", "bf16"):
                kinds.append("master")
            for k in kinds:
                same = f"optim/{k}/{s.same_as}" if s.same_as else None
                out.append(TensorSpec(f"optim/{k}/{s.name}", s.shape, "fp32", s.rule, same))
        return tuple(out)

    return ModelSpec(
        model.name, model.layers, states(model.tensors), model.tp_divides,
        states(model.pp_only), model.params + (("optimizer", optimizer),),
    )


_INT_KEYS = {"gpt": ("layers", "hidden", "heads", "vocab", "ffn", "seq", "swiglu"),
             "vit": ("layers", "hidden", "heads", "image", "patch", "channels", "classes",
                     "ffn", "swiglu")}
_REQUIRED = {"gpt": ("layers", "hidden", "heads", "vocab"), "vit": ("layers", "hidden", "heads")}
PRESETS: dict[str, Callable[..., ModelSpec]] = {"gpt": gpt, "vit": vit}


def parse_model(text: str, dtype: str = "fp16", optimizer: str = "none") -> ModelSpec:
    """A model from ``"gpt:layers=L,hidden=H,heads=A,vocab=V[,ffn=F][,seq=S]"`` or
    ``"vit:layers=L,hidden=H,heads=A[,image=I][,patch=P][,channels=C][,classes=K]"``."""
    kind, _, rest = text.partition(":")
    if kind not in PRESETS:
        raise InvalidConfig(f"unknown model {kind!r}; known presets: {', '.join(PRESETS)}")
    args: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, val = item.partition("=")
        if not sep or key not in _INT_KEYS[kind]:
            raise InvalidConfig(
                f"bad model option {item!r}; expected key=value with key one of "
                + ", ".join(_INT_KEYS[kind])
            )
        try:
            args[key] = int(val)
        except ValueError:
            raise InvalidConfig(f"model option {key}={val!r} is not a whole number") from None
    missing = [k for k in _REQUIRED[kind] if k not in args]
    if missing:
        raise InvalidConfig(f"model {text!r} lacks {', '.join(missing)}")
    swiglu = bool(args.pop("swiglu", 0))
    return PRESETS[kind](**args, swiglu=swiglu, dtype=dtype, optimizer=optimizer)
