"""What every model preset and spec file shares: vocabulary padding, the
checks of a preset's options, optimizer state, and the row order of fused
query/key/value weights (:func:`fused_qkv`).

Optimizer state is one tensor per parameter and state kind, named
``optim/<state>/<parameter>``, fp32, with the parameter's shape and rule
(its expert included), so it is cut exactly like the parameter. The known
optimizers (:data:`OPTIMIZER_STATES`) keep:

- ``adam``, ``adamw``: ``exp_avg`` and ``exp_avg_sq``;
- ``sgd``: ``momentum_buffer``;
- ``none``: nothing;

and, except ``none``, an fp32 ``master`` copy of every fp16/bf16 parameter
(mixed-precision training). :func:`add_states` adds any other list of states.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ptcfs.errors import InvalidConfig
from ptcfs.types import DTYPE_SIZES, ModelSpec, TensorSpec

__all__ = [
    "HALF_DTYPES",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "VOCAB_PAD",
    "add_states",
    "check_dtype",
    "check_positive",
    "fused_qkv",
    "qkv_rows_per_group",
    "with_optimizer",
]

#: Megatron pads the vocabulary to a multiple of this times tp.
VOCAB_PAD = 128

#: The state kinds each optimizer keeps per parameter (besides ``master``).
OPTIMIZER_STATES: dict[str, tuple[str, ...]] = {
    "none": (),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
}
OPTIMIZERS = tuple(OPTIMIZER_STATES)

#: Parameters of these dtypes get an fp32 master copy.
HALF_DTYPES = ("fp16", "bf16")


def check_positive(preset: str, **values: int) -> None:
    """InvalidConfig naming the first of ``values`` below 1."""
    for name, value in values.items():
        if value < 1:
            raise InvalidConfig(f"{preset}: {name}={value} must be at least 1")


def check_dtype(preset: str, dtype: str) -> None:
    if dtype not in DTYPE_SIZES:
        raise InvalidConfig(f"{preset}: unknown dtype {dtype!r}; use fp16, bf16 or fp32")


def add_states(model: ModelSpec, states: Sequence[str], master: bool) -> ModelSpec:
    """``model`` with ``optim/<state>/<name>`` added for every parameter and
    state, and ``optim/master/<name>`` for every fp16/bf16 parameter when
    ``master``; each parameter's states follow all the parameters, in
    parameter order, ``master`` last."""
    kinds = list(states)
    for k in kinds:
        if not k or "/" in k or k == "master":
            raise InvalidConfig(
                f"bad optimizer state {k!r}: a state is a non-empty name without '/' "
                "('master' is asked for on its own)")
    if len(set(kinds)) != len(kinds):
        raise InvalidConfig(f"optimizer states {', '.join(kinds)} name one state twice")

    def grow(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        out = list(specs)
        for s in specs:
            if s.is_optim:
                continue
            for k in kinds + (["master"] if master and s.dtype in HALF_DTYPES else []):
                same = f"optim/{k}/{s.same_as}" if s.same_as else None
                out.append(TensorSpec(f"optim/{k}/{s.name}", s.shape, "fp32", s.rule, same))
        return tuple(out)

    return replace(model, tensors=grow(model.tensors), pp_only=grow(model.pp_only))


def with_optimizer(model: ModelSpec, optimizer: str) -> ModelSpec:
    """Add the state of ``optimizer`` (one of :data:`OPTIMIZERS`), sharded like
    the parameters, and record it in ``params``."""
    if optimizer not in OPTIMIZER_STATES:
        raise InvalidConfig(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if optimizer == "none":
        return model
    out = add_states(model, OPTIMIZER_STATES[optimizer], master=True)
    return replace(out, params=model.params + (("optimizer", optimizer),))


#: Megatron's fused query/key/value projections (weights and biases).
_FUSED_QKV = re.compile(r"\.(?:query_key_value|linear_qkv)\.(?:weight|bias)$")


def fused_qkv(model: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """The model's fused query/key/value tensors whose rows go per query
    group, as Megatron stores them: for each of the ``kv_heads`` groups, the
    query rows of its heads, then its key rows, then its value rows (per
    head when there is no GQA); name → ``(heads, kv_heads, head_dim)``. A
    split of these rows in ``tp`` parts gives each rank whole groups."""
    p = dict(model.params)
    if "heads" not in p or "hidden" not in p:
        return {}
    heads = int(p["heads"])
    kv = int(p.get("kv_heads") or heads)
    hd = int(p.get("head_dim") or int(p["hidden"]) // heads)
    return {t.name: (heads, kv, hd) for t in model.tensors
            if not t.is_optim and _FUSED_QKV.search(t.name) and t.rule.groups == 1
            and t.shape[0] == (heads + 2 * kv) * hd}


def qkv_rows_per_group(heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """The rows, in the order :func:`fused_qkv` describes, of a fused
    query/key/value weight stacked by kind instead: all query rows, then all
    key rows, then all value rows (GPT-2's ``c_attn`` transposed, or HF's
    ``q_proj``/``k_proj``/``v_proj`` one above the other)."""
    per, q, k = heads // kv_heads, heads * head_dim, (heads + kv_heads) * head_dim
    rows: list[int] = []
    for g in range(kv_heads):
        rows += range(g * per * head_dim, (g + 1) * per * head_dim)
        rows += range(q + g * head_dim, q + (g + 1) * head_dim)
        rows += range(k + g * head_dim, k + (g + 1) * head_dim)
    return np.asarray(rows, dtype=np.int64)
