"""What a ``save_pretrained`` through the mount becomes: checks of its
tensors against the job, and the sub-tensors it puts
(:mod:`ptcfs.fuse.hfwrite` says when and the rules).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidConfig, InvalidRequest
from ptcfs.fuse.formats import Declared
from ptcfs.fuse.hfdir import HF_SAVE
from ptcfs.fuse.spool import Chunks, cut, put_array, put_layout
from ptcfs.fuse.writing import Put
from ptcfs.model.hfmodels import spec_from_config
from ptcfs.sharding import layout_of
from ptcfs.types import ModelSpec, TensorSpec, full_box

__all__ = ["param_specs", "check", "all_there", "describes", "fits", "as_job_holds",
           "put_save", "Read"]

#: ``read(file)``: a file of a version, whole
Read = Callable[[Any], bytes]
_MASTER = "optim/master/"
#: (narrower, wider) dtypes a save may give a tensor the job holds in the
#: other, where its values are the same in both. transformers keeps a few
#: tensors in a dtype of their own whatever ``from_pretrained`` was asked for
#: (Apertus's xIELU ``alpha_p`` in bf16, ERNIE-4.5-MoE's router and GLM-4-MoE's
#: ``e_score_correction_bias`` in fp32), so its ``save_pretrained`` writes them so.
_EXACT = frozenset({("bf16", "fp32"), ("fp16", "fp32")})


def param_specs(model: ModelSpec) -> dict[str, TensorSpec]:
    """The parameters a ``save_pretrained`` holds, by name (not ``pp_only``)."""
    return {t.name: t for t in model.tensors if not t.is_optim}


def check(what: str, d: Declared, params: dict[str, TensorSpec]) -> None:
    """A tensor a file declares is one of ``params``, of its dtype and shape."""
    spec = params.get(d.name)
    if spec is None:
        raise InvalidRequest(f"{what}: {d.name} is not a parameter of the job (a model of "
                             "another architecture?)")
    if tuple(d.shape) != tuple(spec.shape) or (
            d.dtype != spec.dtype and (d.dtype, spec.dtype) not in _EXACT
            and (spec.dtype, d.dtype) not in _EXACT):
        raise InvalidRequest(f"{what}: {d.name} is {d.dtype} {list(d.shape)}; the job holds "
                             f"it as {spec.dtype} {list(spec.shape)}")


def all_there(what: str, params: dict[str, TensorSpec], names: set[str], job: str) -> None:
    """``names`` hold every one of ``params``."""
    missing = sorted(set(params) - names)
    if missing:
        raise InvalidRequest(f"{what}: the save holds no {', '.join(missing[:3])}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                             + f" of job {job!r}")


def describes(what: str, text: str, params: dict[str, TensorSpec],
              recorded: str | None = None) -> None:
    """``config.json`` describes the job's parameters: where ptcfs knows its
    architecture, their every shape; else (the spec was derived through
    transformers at import, which the mount does not load) its
    ``model_type`` and ``architectures`` are those of the job's ``recorded``
    config."""
    dtype = next(iter(params.values())).dtype if params else "fp32"
    config = json.loads(text)
    if not isinstance(config, dict):
        raise InvalidRequest(f"{what}: not a JSON object")
    try:
        spec = spec_from_config(config, dtype)
    except InvalidConfig:
        if recorded is None:
            return  # nothing to hold it to: the tensors were checked
        mine = json.loads(recorded)
        for key in ("model_type", "architectures"):  # where the job's config says them
            if isinstance(mine, dict) and mine.get(key) is not None and \
                    config.get(key) != mine.get(key):
                raise InvalidRequest(f"{what}: describes another model than the job's ({key} "
                                     f"{config.get(key)!r}; the job's is {mine.get(key)!r})"
                                     ) from None
        return
    shapes = {t.name: tuple(t.shape) for t in spec.tensors}
    mine_shapes = {n: tuple(t.shape) for n, t in params.items()}
    if shapes != mine_shapes:
        diff = sorted(set(shapes.items()) ^ set(mine_shapes.items()))
        raise InvalidRequest(f"{what}: describes another model than the job's (first "
                             f"difference: {diff[0][0]})")


def _widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp16/bf16 values as fp32, exactly (a 0-d array stays one)."""
    if dtype == "bf16":
        return np.asarray(a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _narrow(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values as ``dtype`` (bf16 by truncation), to check a round trip."""
    if dtype == "bf16":
        return np.asarray(a.view(np.uint32) >> 16).astype(np.uint16)
    return a.astype(np.float16)


def fits(what: str, d: Declared, spec: TensorSpec, current: Callable[[], np.ndarray]) -> None:
    """A tensor ``d`` declares in a narrower dtype than the job's is taken
    only where the job's ``current()`` values are all of that dtype already
    (a tensor kept so by transformers): a model loaded in a narrower dtype
    than the job's is refused, since its save would drop the job's low bits.
    (One in a wider dtype: :func:`as_job_holds`, once its values are here.)"""
    if (d.dtype, spec.dtype) not in _EXACT:
        return
    now = current()
    if not _exact(now, d.dtype):
        raise InvalidRequest(f"{what}: {d.name} is {d.dtype}; the job holds it as {spec.dtype} "
                             f"with values {d.dtype} cannot hold (load the model with the "
                             f"job's dtype, {spec.dtype}, before saving it)")


def as_job_holds(what: str, d: Declared, saved: np.ndarray, spec: TensorSpec,
                 current: Callable[[], np.ndarray]) -> np.ndarray:
    """``saved`` (of ``d.dtype``) in the job's dtype, exactly: the same
    array; one of a narrower dtype that :func:`fits`, widened; or one of a
    wider dtype whose values all are of the job's dtype, narrowed (else
    refused: the job would not hold what was saved)."""
    if d.dtype == spec.dtype:
        return saved
    if (d.dtype, spec.dtype) in _EXACT:
        fits(what, d, spec, current)
        return _widen(saved, d.dtype)
    if not _exact(saved, spec.dtype):
        raise InvalidRequest(f"{what}: {d.name} is {d.dtype} with values {spec.dtype}, the "
                             f"dtype the job holds it in, cannot hold (cast it to "
                             f"{spec.dtype} before saving)")
    return _narrow(saved, spec.dtype)


def _exact(a: np.ndarray, dtype: str) -> bool:
    """Whether fp32 values ``a`` are all of the narrower ``dtype``."""
    return np.array_equal(_widen(_narrow(a, dtype), dtype).view(np.uint32), a.view(np.uint32))


def put_save(put: Put, read: Read, job: str, uid: int, jv: Any,
             arrays: dict[str, np.ndarray]) -> None:
    """Put the job's every sub-tensor of its current configuration (``jv``:
    its :class:`~ptcfs.fuse.tree.JobView`): the parameters from ``arrays``
    (the saved ones by name, whole), the optimizer state by the rule of
    :mod:`ptcfs.fuse.hfwrite` (``read(file)``: a file of the version, whole)."""
    state = jv.state
    whole = lambda a: [(full_box(a.shape), a)]  # noqa: E731
    for spec in jv.model.tensors_for(state.config.pp):
        if not spec.is_optim:
            source = arrays.get(spec.name)
            if source is None and spec.same_as is not None:
                source = arrays.get(spec.same_as)  # a tied output layer under pp > 1
            if source is None:
                raise InvalidRequest(f"/{job}/{HF_SAVE}: the save holds no {spec.name}")
            put_layout(put, job, spec, state.config, whole(source), uid)
            continue
        param = jv.specs.get(spec.name[len(_MASTER):]) if spec.name.startswith(_MASTER) \
            else None
        bits: tuple[Chunks, Chunks] | None = None
        saved = arrays.get(param.name, arrays.get(param.same_as or "")) if param else None
        if param is not None and saved is not None:
            old = np.frombuffer(read(jv.whole(param, b"")), numpy_dtype(param.dtype))
            bits = whole(saved), whole(old.reshape(param.shape))
        for sl in layout_of(spec, state.config).slices():
            kept = np.frombuffer(read(jv.entry(spec, sl)), numpy_dtype(spec.dtype))
            kept = kept.reshape(sl.local_shape(spec.shape))
            if bits is not None and param is not None:
                as_param = replace(spec, dtype=param.dtype)
                new, old_p = cut(as_param, sl, bits[0]), cut(as_param, sl, bits[1])
                same = new.view(f"u{new.itemsize}") == old_p.view(f"u{new.itemsize}")
                kept = np.where(same, kept, _widen(new, param.dtype))
            put_array(put, job, spec, sl, kept, uid)
