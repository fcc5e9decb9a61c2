"""torchtitan's checkpoint keys: what each one holds of a job.

torchtitan's ``CheckpointManager`` saves with ``dcp.save`` a state dict whose
model entries are at the top level (``tok_embeddings.weight``,
``layers.0.attention.qkv_linear.wq.weight``, ...), whose optimizer is its
``OptimizersContainer`` flattened per parameter name
(``optimizer.state.<param>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` and
``optimizer.param_groups.<param>.<setting>``; the same keys without the
``optimizer.`` prefix are accepted), and ``train_state.*``,
``lr_scheduler.*`` and ``dataloader.*`` entries of its trainer.

The optimizer is keyed by *parameter* names while the model entries are
the module's state dict: torchtitan's fused query/key/value projection
(``attention.qkv_linear.wqkv.weight``, rows per key/value group: each
group's query heads, then its key head, then its value head) is saved as
``wq``/``wk``/``wv`` by a state-dict hook, but its Adam moments stay fused.
A job keeps the three parts and their moments; :data:`FUSED` names the
fused parameter of the three.

torchtitan's mixture-of-experts layer (its common ``MoE``, every MoE
model's) keeps each projection of its routed experts in one tensor, the
experts stacked on dimension 0 (``moe.routed_experts.inner_experts.w1_EFD``
of shape ``[experts, hidden, dim]``, ``w2_EDF``, ``w3_EFD``), and so do
their moments. A job keeps one tensor per expert, ``<stacked>.<j>``
(:func:`expert_name`), each with its expert's rule, as it keeps the
experts of Megatron-Core and Hugging Face models.
"""

from __future__ import annotations

__all__ = ["ENTRIES", "FUSED", "GROUPED", "PARTS", "expert_name", "expert_of", "fused_of",
           "is_stacked", "is_titan", "moment_of", "parts_of"]

#: top-level entries of torchtitan's trainer kept as they are (bytes)
ENTRIES = ("train_state", "lr_scheduler", "dataloader")
#: the fused query/key/value parameter's suffix and its parts' suffixes
FUSED = "qkv_linear.wqkv.weight"
PARTS = ("qkv_linear.wq.weight", "qkv_linear.wk.weight", "qkv_linear.wv.weight")
_KINDS = ("exp_avg", "exp_avg_sq")
#: the module of torchtitan's grouped experts, whose tensors stack the experts
GROUPED = ".moe.routed_experts.inner_experts."


def is_titan(keys: list[str]) -> bool:
    """Keys of a torchtitan checkpoint: trainer entries, or optimizer groups
    keyed by parameter name (torch's recipe numbers them)."""
    for k in keys:
        head, _, rest = k.partition(".")
        if head in ENTRIES and rest:
            return True
        if k.startswith(("optimizer.param_groups.", "param_groups.")):
            after = k.split("param_groups.", 1)[1]
            if not after.split(".", 1)[0].isdigit():
                return True
    return False


def moment_of(key: str) -> tuple[str, str] | None:
    """``(kind, parameter)`` of an optimizer moment key
    (``optimizer.state.<param>.exp_avg``), else None."""
    for prefix in ("optimizer.state.", "state."):
        if key.startswith(prefix):
            param, _, kind = key[len(prefix):].rpartition(".")
            return (kind, param) if kind in _KINDS and param else None
    return None


def parts_of(param: str) -> tuple[str, str, str] | None:
    """The ``wq``/``wk``/``wv`` names of a fused ``wqkv`` parameter, else None."""
    if not param.endswith(FUSED):
        return None
    base = param[: -len(FUSED)]
    q, k, v = (base + p for p in PARTS)
    return q, k, v


def fused_of(name: str) -> str | None:
    """The fused parameter a ``qkv_linear.wq|wk|wv.weight`` tensor is part of."""
    for p in PARTS:
        if name.endswith(p):
            return name[: -len(p)] + FUSED
    return None


def is_stacked(param: str) -> bool:
    """A tensor of torchtitan's grouped experts (experts stacked on dimension 0)."""
    return GROUPED in param and not param.rpartition(".")[2].isdigit()


def expert_name(stacked: str, j: int) -> str:
    """The job's name of expert ``j`` of a stacked tensor (or of its moment,
    ``optim/<kind>/<stacked>``)."""
    return f"{stacked}.{j}"


def expert_of(name: str) -> tuple[str, int] | None:
    """``(stacked tensor, expert)`` of a job's expert tensor name, else None."""
    base, _, j = name.rpartition(".")
    return (base, int(j)) if j.isdigit() and is_stacked(base) else None
