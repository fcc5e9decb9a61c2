"""Bounds on what a model may ask for, checked before anything is allocated.

A preset's options and a spec file's lists are counted before their tensors
are built, and a built model's shapes and bytes are checked before anything
plans, stores or fills them, so that ``gpt:layers=1000000000`` or a shape of
``[10**12, 10**12]`` is one line (InvalidConfig, exit 2) instead of minutes of
growing memory or a traceback. The limits are settings whose defaults hold
the largest real models with room to spare:

- ``PTC_SPEC_MAX_TENSORS``: tensors of one model, optimizer state included;
- ``PTC_SPEC_MAX_TENSOR_BYTES``: bytes of one tensor (and at most
  :data:`MAX_DIMS` dimensions, numpy's own limit);
- ``PTC_SPEC_MAX_BYTES``: bytes of all of a model's tensors.

Tensor names follow one rule everywhere (:func:`check_tensor_name`): the
parts between ``/`` are folders and a file of the mount, so none is empty,
``.`` or ``..``, and no control character (NUL included) appears.
"""

from __future__ import annotations

import math
import re

from ptcfs import settings
from ptcfs.errors import InvalidConfig
from ptcfs.types import DTYPE_SIZES, ModelSpec

__all__ = ["MAX_DIMS", "MAX_NAME", "check_count", "check_model", "check_tensor_name"]

#: Dimensions of one tensor (numpy's limit).
MAX_DIMS = 32
#: Characters of one tensor name.
MAX_NAME = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _n(n: int) -> str:
    return f"{n:,}".replace(",", "_") if n < 10**30 else f"about {float(n):.1e}"


def check_count(count: int, what: str) -> None:
    """InvalidConfig unless ``count`` tensors (of ``what``) are within
    ``PTC_SPEC_MAX_TENSORS``; called before they are built."""
    limit = int(settings.get("PTC_SPEC_MAX_TENSORS"))
    if count > limit:
        raise InvalidConfig(f"{what} has {_n(count)} tensors, more than "
                            f"PTC_SPEC_MAX_TENSORS={_n(limit)} (raise it for a bigger model)")


def check_tensor_name(name: object) -> str:
    """``name`` if it can name a tensor, else InvalidConfig with the rule."""
    bad = ""
    if not isinstance(name, str) or not name:
        bad = "it is empty" if name == "" else "it is not text"
    elif len(name) > MAX_NAME:
        bad = f"it is longer than {MAX_NAME} characters"
    elif _CONTROL.search(name):
        bad = "it holds a control character"
    elif name.startswith("/"):
        bad = "it starts with '/'"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        bad = "a part between '/' is empty, '.' or '..'"
    if bad:
        raise InvalidConfig(f"bad tensor name {name!r:.80}: {bad} (the parts of a name between "
                            "'/' are folders of the mount)")
    return str(name)


def check_model(model: ModelSpec) -> ModelSpec:
    """``model`` if its count, names, shapes and bytes are within the
    limits above, else InvalidConfig naming the first that is not."""
    specs = model.tensors + model.pp_only
    check_count(len(specs), f"model {model.name!r}")
    each = int(settings.get("PTC_SPEC_MAX_TENSOR_BYTES"))
    limit = int(settings.get("PTC_SPEC_MAX_BYTES"))
    total = 0
    for s in specs:
        check_tensor_name(s.name)
        if len(s.shape) > MAX_DIMS:
            raise InvalidConfig(f"tensor {s.name!r} has {len(s.shape)} dimensions, more than "
                                f"{MAX_DIMS}")
        nbytes = math.prod(s.shape) * DTYPE_SIZES.get(s.dtype, 1)
        if nbytes > each:
            raise InvalidConfig(f"tensor {s.name!r} of shape {list(s.shape)} is {_n(nbytes)} "
                                f"bytes, more than PTC_SPEC_MAX_TENSOR_BYTES={_n(each)}")
        total += nbytes
    if total > limit:
        raise InvalidConfig(f"model {model.name!r} is {_n(total)} bytes, more than "
                            f"PTC_SPEC_MAX_BYTES={_n(limit)} (raise it for a bigger model)")
    return model
