"""A rank's sub-tensors into a ``torch.nn.Module`` and an Adam optimizer, and back.

Parameters are matched by name: a module parameter ``p`` named ``n`` (by
``module.named_parameters()``, with a leading ``module.`` of DDP wrappers
dropped, then passed through ``names`` when given) takes the job's tensor
``n``; the optimizer's ``exp_avg`` and ``exp_avg_sq`` of ``p`` come from
``optim/exp_avg/n`` and ``optim/exp_avg_sq/n``, and Adam's ``step`` is the
job's training step (one optimizer step per training step). When the job
keeps fp32 master weights (fp16/bf16 jobs) and the module's parameter is
fp32, the parameter takes the master copy.

:func:`module_for` builds a plain module whose parameters are exactly one
rank's sub-tensors, named as in the job: handy for tools and tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ptcfs.client.torch.state import TORCH_DTYPES, RankState
from ptcfs.errors import InvalidRequest
from ptcfs.jobstate import JobState
from ptcfs.sharding import rank_tensors
from ptcfs.types import ModelSpec

__all__ = ["load_into", "state_of", "module_for", "logical_module", "named_parameters",
           "OPTIM_KINDS"]

#: Optimizer state kinds ptcfs keeps per parameter, as in the Adam preset.
OPTIM_KINDS = ("exp_avg", "exp_avg_sq", "master")

Names = Callable[[str], str] | None


def named_parameters(module: torch.nn.Module, names: Names = None) -> dict[str, torch.nn.Parameter]:
    """The module's parameters by job tensor name."""
    out: dict[str, torch.nn.Parameter] = {}
    for n, p in module.named_parameters():
        n = n.removeprefix("module.")
        out[names(n) if names is not None else n] = p
    return out


def check_adam(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose state ptcfs does not keep (not Adam or
    AdamW, or with amsgrad)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise InvalidRequest(f"ptcfs keeps Adam state; {type(optimizer).__name__} is not "
                             "torch.optim.Adam or AdamW")
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise InvalidRequest("ptcfs keeps no amsgrad state (max_exp_avg_sq); use amsgrad=False")


def _as_param(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t if (t.dtype == p.dtype and t.device == p.device) else \
        t.to(device=p.device, dtype=p.dtype)


def load_adam(rs: RankState, optimizer: torch.optim.Optimizer,
              params: Mapping[str, torch.nn.Parameter],
              place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _as_param) -> None:
    """Set the optimizer's Adam state of every parameter from the rank's
    ``optim/exp_avg/<name>`` and ``optim/exp_avg_sq/<name>`` and its step;
    ``place(param, tensor)`` makes each moment what the optimizer expects of
    that parameter (its dtype and device; a DTensor for a DTensor)."""
    check_adam(optimizer)
    if rs.state.optimizer not in ("adam", "adamw"):
        raise InvalidRequest(f"job {rs.state.job!r} keeps no Adam state; create or import "
                             "it with --optimizer adam (or adamw)")
    by_id = {id(p): n for n, p in params.items()}
    for g in optimizer.param_groups:
        on_device = bool(g.get("capturable") or g.get("fused"))
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise InvalidRequest("the optimizer holds a parameter the module does not have")
            st = optimizer.state[p]
            st.clear()
            st["step"] = torch.tensor(float(rs.step), dtype=torch.float32,
                                      device=p.device if on_device else "cpu")
            for kind in ("exp_avg", "exp_avg_sq"):
                st[kind] = place(p, rs.tensors[f"optim/{kind}/{name}"])


def load_into(rs: RankState, module: torch.nn.Module,
              optimizer: torch.optim.Optimizer | None = None, names: Names = None) -> None:
    """Hand the rank's tensors to ``module`` (and ``optimizer``). A tensor on
    the parameter's device with its dtype becomes the parameter's storage
    (no copy); otherwise it is copied into it. Every parameter must have a
    tensor and every model tensor of the rank a parameter."""
    params = named_parameters(module, names)
    model_names = {n for n in rs.tensors if not n.startswith("optim/")}
    missing = sorted(set(params) - model_names)
    unused = sorted(model_names - set(params))
    if missing or unused:
        raise InvalidRequest(
            f"module and rank {rank_text(rs)} do not match: "
            + (f"parameters without a tensor: {', '.join(missing[:4])}; " if missing else "")
            + (f"tensors without a parameter: {', '.join(unused[:4])}" if unused else ""))
    for name, p in params.items():
        src = rs.tensors[name]
        master = rs.tensors.get(f"optim/master/{name}")
        if master is not None and p.dtype == torch.float32:
            src = master
        if tuple(src.shape) != tuple(p.shape):
            raise InvalidRequest(f"{name}: the module's parameter is {tuple(p.shape)}, the "
                                 f"rank's sub-tensor {tuple(src.shape)} ({rank_text(rs)})")
        if src.dtype == p.dtype and src.device == p.device:
            p.data = src
        else:
            with torch.no_grad():
                p.copy_(src)
    if optimizer is not None:
        load_adam(rs, optimizer, params)


def rank_text(rs: RankState) -> str:
    return f"rank {rs.rank} of job {rs.state.job!r} ({rs.state.describe()})"


def state_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             state: JobState, rank: int, names: Names = None) -> dict[str, torch.Tensor]:
    """The sub-tensors of ``rank`` under ``state``'s configuration, taken
    from ``module`` and ``optimizer``: the live tensors where dtypes agree
    (no copy), converted copies where they do not. Moments of a parameter
    the optimizer has not stepped yet are zeros."""
    return rank_state(named_parameters(module, names), optimizer, state, rank)


def rank_state(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
               state: JobState, rank: int,
               local: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach,
               check_shape: bool = False) -> dict[str, torch.Tensor]:
    """:func:`state_of` from ``params`` (job name → parameter) and the
    optimizer, each tensor taken through ``local`` (a DTensor's local shard
    for DTensor modules); with ``check_shape`` a local shape other than the
    sub-tensor's is refused (the module's mesh is not the job's)."""
    if optimizer is not None:
        check_adam(optimizer)
    out: dict[str, torch.Tensor] = {}
    for spec, sl in rank_tensors(state.model_spec(), state.config, rank):
        want = TORCH_DTYPES[spec.dtype]
        kind, pname = _split(spec.name)
        p = params.get(pname)
        if p is None:
            raise InvalidRequest(f"the module has no parameter {pname!r} (rank {rank} of job "
                                 f"{state.job!r} holds {spec.name})")
        t: torch.Tensor
        if kind is None or kind == "master":
            t = local(p)
        elif optimizer is None:
            raise InvalidRequest(f"job {state.job!r} keeps optimizer state: pass the optimizer")
        else:
            st: Mapping[str, torch.Tensor] = optimizer.state.get(p, {})
            t = local(st[kind]) if kind in st else torch.zeros_like(local(p), dtype=want)
        shape = sl.local_shape(spec.shape)
        if check_shape and tuple(t.shape) != shape:
            raise InvalidRequest(f"{spec.name}: the module's local shard is {tuple(t.shape)}, "
                                 f"rank {rank} of job {state.job!r} ({state.describe()}) holds "
                                 f"{shape}: the mesh is not the job's")
        out[spec.name] = t if t.dtype == want else t.to(want)
    return out


def _split(name: str) -> tuple[str | None, str]:
    """``optim/exp_avg/x`` → ``("exp_avg", "x")``; ``x`` → ``(None, "x")``."""
    if name.startswith("optim/"):
        kind, _, rest = name[len("optim/"):].partition("/")
        if kind in OPTIM_KINDS:
            return kind, rest
    return None, name


def module_for(state: JobState, rank: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A module whose parameters are the (uninitialised) model sub-tensors of
    ``rank``, named like the job's tensors."""
    return _build([(spec.name, sl.local_shape(spec.shape), spec.dtype)
                   for spec, sl in rank_tensors(state.model_spec(), state.config, rank)], device)


def logical_module(model: ModelSpec, pp: int = 1, device: torch.device | str = "cpu"
                   ) -> torch.nn.Module:
    """A module whose parameters are the model's whole (unpadded) logical
    tensors, named like the job's tensors: one rank's view of a job with
    tp = pp = dp = 1 (uninitialised)."""
    return _build([(s.name, s.shape, s.dtype) for s in model.tensors_for(pp)], device)


def _build(items: list[tuple[str, tuple[int, ...], str]], device: torch.device | str
           ) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, shape, dtype in items:
        if name.startswith("optim/"):
            continue
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(
            shape, dtype=TORCH_DTYPES[dtype], device=device)))
    return root
