"""Where a job tensor lives in a Megatron-Core ``torch_dist`` checkpoint.

Megatron-Core saves each tensor under a *sharded key* and stacks repeated
modules along leading axes (checked against megatron-core 0.16.1):

- ``decoder.layers.<i>.<rest>`` is row ``i`` of key ``decoder.layers.<rest>``
  (global layer index, whatever the pipeline split);
- ``decoder.layers.<i>.mlp.experts.local_experts.<j>.<r>`` is ``[i, j]`` of
  ``decoder.layers.mlp.experts.experts.<r>`` (every expert implementation,
  ``SequentialMLP``, ``TEGroupedMLP`` and ``GroupedMLP``, saves these keys);
- the norms take their fused names whatever the layer spec:
  ``input_layernorm.*`` is ``self_attention.linear_qkv.layer_norm_*`` and
  ``pre_mlp_layernorm.*`` is ``mlp.linear_fc1.layer_norm_*``, except in a
  mixture-of-experts layer of the Transformer-Engine spec, which keeps
  ``pre_mlp_layernorm.*``;
- optimizer state is ``optimizer.state.<kind>.<key>`` with the parameter's
  key and shape: ``exp_avg``, ``exp_avg_sq`` and ``fp32_param`` (the fp32
  master; the distributed optimizer's ``fully_reshardable`` format calls it
  ``param``).

Tensors outside layers keep their names (``embedding.word_embeddings.weight``,
``decoder.final_layernorm.weight``, ``output_layer.weight``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Place", "place_of", "candidates", "LAYER_KEY", "EXPERT_KEY", "OPTIM_KINDS",
           "extra_state_modules"]

LAYER_KEY = "decoder.layers."
EXPERT_KEY = "decoder.layers.mlp.experts.experts."
#: ptcfs optimizer state kind → Megatron-Core's names for it, the first one written.
OPTIM_KINDS = {"exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",),
               "master": ("fp32_param", "param")}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Place:
    """A tensor's sharded key and its index along the key's leading axes."""

    key: str
    index: tuple[int, ...] = ()


def _layer_rests(rest: str, moe: bool, norms: str) -> list[str]:
    """The key tails of a layer tensor, the one Megatron-Core writes first."""
    if rest.startswith("input_layernorm."):
        return ["self_attention.linear_qkv.layer_norm_" + rest.split(".", 1)[1]]
    if rest.startswith("pre_mlp_layernorm."):
        fused = "mlp.linear_fc1.layer_norm_" + rest.split(".", 1)[1]
        return [rest, fused] if moe and norms == "te" else [fused, rest]
    return [rest]


def candidates(name: str, moe: bool = False, norms: str = "te") -> list[Place]:
    """Where ``name`` may be, best first (a reader takes the first present).
    ``moe``: the model has experts; ``norms``: its layer spec (``te``/``local``)."""
    if name.startswith("optim/"):
        _, kind, base = name.split("/", 2)
        return [Place(f"optimizer.state.{k}.{p.key}", p.index)
                for k in OPTIM_KINDS.get(kind, (kind,)) for p in candidates(base, moe, norms)]
    m = _LAYER.match(name)
    if m is None:
        return [Place(name)]
    i, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        return [Place(EXPERT_KEY + e.group(2), (i, int(e.group(1))))]
    return [Place(LAYER_KEY + r, (i,)) for r in _layer_rests(rest, moe, norms)]


def place_of(name: str, moe: bool = False, norms: str = "te") -> Place:
    """Where Megatron-Core puts ``name``."""
    return candidates(name, moe, norms)[0]


def extra_state_modules(moe: bool, norms: str) -> tuple[tuple[str, bool], ...]:
    """The modules of a layer whose ``_extra_state`` Megatron-Core saves (as
    ``<key>._extra_state/shard_<i>[.<j>]_<L>[.<E>]`` objects), with whether
    they are per expert: the linear layers (checked with the local spec),
    and with Transformer Engine its attention too (from the source)."""
    mods = [("self_attention.linear_proj", False), ("self_attention.linear_qkv", False)]
    if norms == "te":
        mods.append(("self_attention.core_attention", False))
    if moe:
        mods += [("mlp.experts.experts.linear_fc1", True), ("mlp.experts.experts.linear_fc2", True)]
    else:
        mods += [("mlp.linear_fc1", False), ("mlp.linear_fc2", False)]
    return tuple(mods)
