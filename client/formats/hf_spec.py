"""A job's spec from a Hugging Face ``config.json``, through transformers itself.

:func:`spec_from_hf` builds the config's ``*ForCausalLM`` on the meta
device (no memory, no weights) and reads, in ``state_dict`` order, every
tensor ``save_pretrained`` writes: parameters and persistent buffers, with
their shapes and dtypes, the output layer left out where it is tied to
the embedding (``named_parameters`` lists a shared tensor once). Each
tensor's split under tensor parallelism is the model's own plan
(``model._tp_plan``: the config's ``base_model_tp_plan`` under the model's
prefix, and the class's, e.g. ``lm_head``), read as
:mod:`ptcfs.model.hfplan` says, and, where the plan is not enough,
:data:`ptcfs.model.hfplan.TABLE`'s row. Every other tensor (embeddings, norms,
routers the plan leaves alone, per-head norms) is replicated.

Pipeline stages: ``...layers.<i>...`` (or ``h.<i>``, ``blocks.<i>``) is on
layer ``i``'s stage; what comes
before the first layer (the embedding) on the first, the rest (the final
norm, the output) on the last. Experts: ``experts.<j>`` is expert ``j``,
and the model's expert count is the config's (``num_local_experts``,
``num_experts``, ``n_routed_experts``), which the names must agree with.
Tensor parallelism must divide the query and key/value heads
(``tp_divides``). With tied embeddings, a pipeline of ``pp > 1`` gets the
output layer as its own tensor on the last stage, filled from the
embedding (``pp_only``, ``same_as``).

An architecture transformers does not know, one that is not a causal LM,
or one with no plan and no row in the table is refused in one line that
points to ``--model-spec`` (``ptcctl spec --from-hf DIR`` writes a spec
to start from, replicated where there is no plan).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ptcfs.client.torch.state import DTYPE_NAMES
from ptcfs.errors import InvalidConfig
from ptcfs.model.hfmodels import architecture, with_dtypes
from ptcfs.model.hfplan import TABLE, split_of, style_of, table_split
from ptcfs.types import ModelSpec, ShardRule, Stage, TensorSpec

__all__ = ["EXPERT_KEYS", "build_meta", "has_plan", "spec_from_hf", "spec_of_dir", "tp_plan"]

#: config keys that give a mixture-of-experts layer's expert count, in order
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_REFUSE = ("describe its tensors in a spec file (`ptcctl spec --from-hf DIR` writes one to "
           "start from) and import with --model-spec FILE")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise InvalidConfig("reading a config.json needs transformers (pip install "
                            "transformers), or " + _REFUSE) from None
    return transformers


def build_meta(config: Mapping[str, Any], plan_needed: bool = True) -> tuple[Any, str]:
    """The config's causal LM built on the meta device, and its class name."""
    T = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = architecture(config)
    kind = str(config.get("model_type", ""))
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if kind not in CONFIG_MAPPING:
        raise InvalidConfig(f"architecture {arch} (model_type {kind!r}) is not one transformers "
                            f"{T.__version__} knows; " + _REFUSE)
    if arch not in causal:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind, arch)
    cls = getattr(T, arch, None)
    if arch not in causal or cls is None:
        raise InvalidConfig(f"architecture {arch} is not a causal language model of "
                            f"transformers {T.__version__}; " + _REFUSE)
    try:
        cfg = CONFIG_MAPPING[kind].from_dict(dict(config))
        model = _on_meta(cls, cfg)
    except Exception as e:  # noqa: BLE001 - a model's constructor raises anything
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InvalidConfig(f"config.json: transformers cannot build {arch} from it: "
                            f"{first}") from e
    if plan_needed and not tp_plan(model) and arch not in TABLE:
        raise InvalidConfig(f"architecture {arch} has no tensor-parallel plan in transformers "
                            f"{T.__version__} and no row in ptcfs's table; " + _REFUSE)
    return model, arch


def _on_meta(cls: Any, cfg: Any) -> Any:
    """The model with its parameters on the meta device: all of it, or, for
    a model whose constructor computes with its buffers (Apertus's xIELU),
    its buffers (small) on the CPU."""
    try:
        with torch.device("meta"):
            return cls._from_config(cfg)
    except (NotImplementedError, RuntimeError):
        try:
            from accelerate import init_empty_weights
        except ImportError:
            raise
        with init_empty_weights(include_buffers=False):
            return cls._from_config(cfg)


def tp_plan(model: Any) -> dict[str, str]:
    """The model's whole plan: generic module name → style."""
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan:  # older transformers: the config's plan under the model's prefix
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "model")
        plan = {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(plan)


def has_plan(config: Mapping[str, Any]) -> bool:
    """Whether transformers builds the config's causal LM and it has a plan
    (or a row in ptcfs's table)."""
    try:
        build_meta(config)
    except InvalidConfig:
        return False
    return True


def _tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """What save_pretrained writes: the state dict less the aliases of tied
    parameters, in order."""
    params = dict(model.named_parameters())
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return [(n, t) for n, t in model.state_dict().items() if n in params or n not in every]


def _saved_names(model: Any, names: list[str]) -> dict[str, str]:
    """The names save_pretrained gives tensors that it renames (module name
    → file name): a multimodal family's text model keeps its old names
    (``_checkpoint_conversion_mapping`` reversed, as save_pretrained does)."""
    mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    try:
        from transformers.modeling_utils import VLMS
    except ImportError:
        return {}
    if not mapping or not any(v in c.__name__.lower() for c in type(model).__mro__[:-1]
                              for v in VLMS):
        return {}
    out = {}
    for name in names:
        key = name
        for pattern, replacement in {v: k for k, v in mapping.items()}.items():
            key, n = re.subn(pattern, re.sub(r"\(.*\)", "", replacement.lstrip("^")), key)
            if n:
                break
        if key != name:
            out[name] = key
    return out


def _experts(config: Mapping[str, Any], names: list[str]) -> int:
    found = {int(m.group(1)) for n in names if (m := _EXPERT.search(n))}
    if not found:
        return 0
    count = next((config[k] for k in EXPERT_KEYS if isinstance(config.get(k), int)), None)
    if count is None:
        count = max(found) + 1
    if max(found) >= count:
        raise InvalidConfig(f"config.json: the model has expert {max(found)} but the config "
                            f"gives {count} experts")
    return int(count)


def spec_from_hf(config: Mapping[str, Any], dtype: str | None = None,
                 require_plan: bool = True) -> ModelSpec:
    """The parameters (no optimizer state) of the causal LM ``config``
    describes, from transformers (see the module docstring); every tensor
    of ``dtype`` when given, else as the config builds it. Without
    ``require_plan``, a model with no plan gets every tensor replicated (a
    spec for a person to edit)."""
    model, arch = build_meta(config, require_plan)
    plan = tp_plan(model)
    tensors = _tensors(model)
    names = [n for n, _ in tensors]
    layer_of = {n: int(m.group(1)) for n in names if (m := _LAYER.search(n))}
    if not layer_of and require_plan:
        raise InvalidConfig(f"{arch}: no tensor is named ...layers.<i>... (or h.<i>, "
                            "blocks.<i>); " + _REFUSE)
    layers = max(layer_of.values(), default=0) + 1
    first = next((i for i, n in enumerate(names) if n in layer_of), len(names))
    experts = _experts(config, names)
    saved = _saved_names(model, names)
    out = []
    for i, (name, t) in enumerate(tensors):
        shape = tuple(t.shape)
        split = table_split(arch, name, config) or split_of(name, shape, style_of(name, plan))
        stage: Stage = layer_of.get(name, "first" if i < first else "last")
        m = _EXPERT.search(name)
        rule = ShardRule(split_dim=split[0], groups=split[1], stage=stage,
                         expert=int(m.group(1)) if m and experts else None, parts=split[2])
        out.append(TensorSpec(saved.get(name, name), shape,
                              dtype or DTYPE_NAMES.get(t.dtype, "fp32"), rule))
    pp_only = _tied_head(model, plan, out)
    # heads that tp must divide (where fused parts name their heads, they say it per part)
    divides = () if any(t.rule.parts for t in out) else tuple(
        (k, config[k]) for k in ("num_attention_heads", "num_key_value_heads")
        if isinstance(config.get(k), int) and config[k] > 0)
    params: tuple[tuple[str, int | str], ...] = (("architecture", arch), ("layers", layers),
                                                 ("names", "hf"))
    return ModelSpec(str(config.get("model_type", arch)), layers, tuple(out), divides,
                     pp_only, params, experts)


def _tied_head(model: Any, plan: Mapping[str, str],
               tensors: list[TensorSpec]) -> tuple[TensorSpec, ...]:
    """The output layer where it is tied to the input embedding: its own
    tensor under a pipeline (``pp_only``), filled from the embedding."""
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is None or in_emb is None or out_emb.weight is not in_emb.weight:
        return ()
    names = {id(p): n for n, p in model.named_parameters()}
    head = next((n for n, p in model.named_parameters(remove_duplicate=False)
                 if p is out_emb.weight and n != names[id(p)]), None)
    source = next((t for t in tensors if t.name == names.get(id(in_emb.weight))), None)
    if head is None or source is None:
        return ()
    split = split_of(head, source.shape, style_of(head, plan))
    return (TensorSpec(head, source.shape, source.dtype,
                       ShardRule(split_dim=split[0], groups=split[1], stage="last"),
                       same_as=source.name),)


def spec_of_dir(path: Path, require_plan: bool = True) -> ModelSpec:
    """The spec of a ``save_pretrained`` directory: its config.json through
    :func:`spec_from_hf`, each tensor of the dtype its safetensors files hold
    (the config's where there are none)."""
    import json

    from ptcfs.client.formats.safetensors_io import read_dir

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidConfig(f"{path / 'config.json'}: cannot read it as JSON: {e}") from e
    if not isinstance(config, dict):
        raise InvalidConfig(f"{path / 'config.json'}: not a JSON object")
    model = spec_from_hf(config, require_plan=require_plan)
    found = read_dir(path) if any(path.glob("*.safetensors")) else {}
    return with_dtypes(model, {n: t.dtype for n, t in found.items()})
