"""Model spec files: a model's tensors as a dict, a TOML or JSON file, or a
compact text for a job's version metadata.

A spec is a table (a TOML document, a JSON object, a Python dict)::

    name = "mymodel"            # required
    layers = 2                  # required: the global layer count (>= 1)
    experts = 4                 # experts per mixture-of-experts layer (default 0)
    dtype = "bf16"              # dtype of "names" entries that give none (default fp16)
    tp_divides = {heads = 8}    # what tensor parallelism must divide
    params = {hidden = 64}      # a record for display: whole numbers and strings

    # every tensor spelled out (what spec_to_dict and dump_spec write) ...
    tensors = [
      {name = "emb.weight", shape = [1000, 64], dtype = "bf16", split_dim = 0,
       pad_multiple = 128, stage = "first"},
      {name = "layers.0.fc1.weight", shape = [192, 64], dtype = "bf16", split_dim = 0,
       groups = 2, stage = 0},
      {name = "layers.0.experts.3.w1.weight", shape = [96, 64], dtype = "bf16",
       split_dim = 0, stage = 0, expert = 3},
      {name = "layers.0.qkv.weight", shape = [128, 64], dtype = "bf16", split_dim = 0,
       stage = 0, parts = [{name = "q", size = 64, units = 4, unit = "heads"},
                           {name = "k", size = 32, units = 2, unit = "heads"},
                           {name = "v", size = 32, units = 2, unit = "heads"}]},
    ]
    pp_only = [                 # tensors that exist only when pp > 1
      {name = "head.weight", shape = [1000, 64], dtype = "bf16", split_dim = 0,
       pad_multiple = 128, stage = "last", same_as = "emb.weight"},
    ]

    # ... and/or names with their shapes, and rules that give their sharding:
    names = [["layers.0.norm.weight", [64]], ["layers.1.norm.weight", [64], "fp32"]]
    rules = [
      {match = "*.fc1.weight", split_dim = 0, groups = 2, stage = "layer"},
      {match = "re:.*experts\\.\\d+\\.w[13]\\.weight", split_dim = 0, stage = "layer",
       expert = "index"},
      {match = "*", stage = "layer"},
    ]

    # optimizer state for every parameter: optim/<state>/<name>, fp32, same rule,
    # and with master = true an fp32 optim/master/<name> for fp16/bf16 parameters
    optimizer = {states = ["exp_avg", "exp_avg_sq"], master = true}

Tensor keys: ``name``, ``shape`` and ``dtype`` are required; ``split_dim``
(tensor-parallel dimension, default none: replicated), ``groups``
(default 1), ``pad_multiple`` (default none), ``stage`` (a global layer
index, ``"first"`` or ``"last"``; default ``"first"``), ``expert`` (the
expert's index; default none) and ``same_as`` (a tensor of ``tensors``
that holds the same values) are optional; see :class:`~ptcfs.types.ShardRule`.
``parts`` (default none) lists a fused tensor's parts along ``split_dim``, in
order, of any sizes: each a table of ``name``, ``size``, ``units`` (how many
whole heads or rows; tensor parallelism must divide it) and optionally
``unit`` (what a unit is called, default ``"rows"``); see
:class:`~ptcfs.types.Part`.

``names`` is a list of ``[name, shape]`` or ``[name, shape, dtype]`` (or
tables with those keys), or a table ``name → shape`` or
``name → {shape, dtype}``. Each name takes the first rule whose ``match``
matches it all: a glob (``*`` matches any run of characters, dots
included) or, after ``re:``, a Python regular expression. A rule has the
tensor keys above except ``name``/``shape``/``dtype``/``same_as``, where
``stage = "layer"`` takes the layer from the first dotted part of the name
that is a number (``model.layers.3.mlp``, ``transformer.h.3.attn``,
``blocks.3.norm``) and ``expert = "index"`` the expert from ``experts.<j>`` (or
``local_experts.<j>``). Named tensors follow ``tensors``, and optimizer
state follows both.

:func:`load_spec_file` reads ``.toml`` or ``.json``; :func:`dump_spec`
writes either, and ``load(dump(m)) == m``. :func:`encode_spec` gives a
compact text (base64 of zlib-compressed JSON of :func:`spec_to_dict`) and
:func:`decode_spec` reads it back (cached, so a job's spec is parsed once).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import os
import re
import tomllib
import zlib
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from ptcfs.errors import InvalidConfig
from ptcfs.limits import check_count, check_model
from ptcfs.model.modelkit import add_states
from ptcfs.tomlout import toml_key, toml_value
from ptcfs.types import DTYPE_SIZES, ModelSpec, Part, ShardRule, Stage, TensorSpec

__all__ = [
    "decode_spec",
    "dump_spec",
    "encode_spec",
    "load_spec_file",
    "spec_from_dict",
    "spec_to_dict",
]

_TOP = ("name", "layers", "experts", "dtype", "tp_divides", "params", "tensors", "pp_only",
        "names", "rules", "optimizer")
_RULE_KEYS = ("split_dim", "groups", "pad_multiple", "stage", "expert", "parts")
_PART_KEYS = ("name", "size", "units", "unit")
_TENSOR_KEYS = ("name", "shape", "dtype") + _RULE_KEYS + ("same_as",)
#: the layer index: the first dotted part of a name that is a number
#: (``model.layers.3.mlp``, ``transformer.h.3.attn``, ``blocks.3.norm``)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_EXPERT = re.compile(r"experts\.(\d+)(?:\.|$)")


# --- to a dict -------------------------------------------------------------------


def _tensor_dict(s: TensorSpec) -> dict[str, Any]:
    r = s.rule
    d: dict[str, Any] = {"name": s.name, "shape": list(s.shape), "dtype": s.dtype}
    if r.split_dim is not None:
        d["split_dim"] = r.split_dim
    if r.groups != 1:
        d["groups"] = r.groups
    if r.pad_multiple is not None:
        d["pad_multiple"] = r.pad_multiple
    d["stage"] = r.stage
    if r.expert is not None:
        d["expert"] = r.expert
    if r.parts:
        d["parts"] = [{"name": p.name, "size": p.size, "units": p.units, "unit": p.unit}
                      for p in r.parts]
    if s.same_as is not None:
        d["same_as"] = s.same_as
    return d


def spec_to_dict(model: ModelSpec) -> dict[str, Any]:
    """``model`` as a JSON- and TOML-friendly dict, keys at their defaults left out."""
    d: dict[str, Any] = {"name": model.name, "layers": model.layers}
    if model.experts:
        d["experts"] = model.experts
    if model.tp_divides:
        d["tp_divides"] = dict(model.tp_divides)
    if model.params:
        d["params"] = dict(model.params)
    d["tensors"] = [_tensor_dict(s) for s in model.tensors]
    if model.pp_only:
        d["pp_only"] = [_tensor_dict(s) for s in model.pp_only]
    return d


# --- from a dict -----------------------------------------------------------------


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidConfig(f"{what} must be a whole number of at least {least}, not "
                            f"{_short(value)}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidConfig(f"{what} must be a non-empty string, not {_short(value)}")
    return value


def _table(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidConfig(f"{what} must be a table, not {_short(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidConfig(f"{what} must be a list, not {_short(value)}")
    return value


def _unknown(d: Mapping[str, Any], known: tuple[str, ...], what: str) -> None:
    for key in d:
        if key not in known:
            raise InvalidConfig(f"{what}: unknown key {key!r}; known keys: {', '.join(known)}")


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in value):
        raise InvalidConfig(f"{what}: bad shape {_short(value)}; expected a list of whole "
                            "numbers, e.g. [1024, 512]")
    return tuple(value)


def _dtype(value: Any, what: str) -> str:
    if value not in DTYPE_SIZES:
        raise InvalidConfig(f"{what}: unknown dtype {_short(value)}; use one of "
                            f"{', '.join(DTYPE_SIZES)}")
    return str(value)


def _stage(value: Any, what: str, layers: int) -> Stage:
    if value in ("first", "last"):
        return "first" if value == "first" else "last"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < layers:
        raise InvalidConfig(f"{what}: stage {_short(value)} must be \"first\", \"last\" or a "
                            f"layer index below layers={layers}")
    return value


def _rule(d: Mapping[str, Any], what: str, layers: int, experts: int) -> ShardRule:
    split = d.get("split_dim")
    expert = d.get("expert")
    if expert is not None:
        expert = _int(expert, f"{what}: expert")
        if expert >= experts:
            raise InvalidConfig(f"{what}: expert {expert} needs experts > {expert} at the top "
                                f"of the spec (it has experts={experts})")
    pad = d.get("pad_multiple")
    parts = tuple(_part(p, f"{what}: parts[{i}]")
                  for i, p in enumerate(_list(d.get("parts", []), f"{what}: parts")))
    return ShardRule(
        split_dim=None if split is None else _int(split, f"{what}: split_dim"),
        groups=_int(d.get("groups", 1), f"{what}: groups", 1),
        pad_multiple=None if pad is None else _int(pad, f"{what}: pad_multiple", 1),
        stage=_stage(d.get("stage", "first"), what, layers),
        expert=expert, parts=parts)


def _part(d: Any, what: str) -> Part:
    d = _table(d, what)
    _unknown(d, _PART_KEYS, what)
    for key in ("name", "size", "units"):
        if key not in d:
            raise InvalidConfig(f"{what}: missing key {key!r}")
    return Part(_str(d["name"], f"{what}: name"), _int(d["size"], f"{what}: size", 1),
                _int(d["units"], f"{what}: units", 1), _str(d.get("unit", "rows"),
                                                            f"{what}: unit"))


def _tensor(d: Any, what: str, layers: int, experts: int, label: str = "") -> TensorSpec:
    """The tensor of table ``d``; errors start with ``label``, else ``what (name)``."""
    d = _table(d, what)
    if "name" not in d:
        raise InvalidConfig(f"{what}: missing key 'name'")
    name = _str(d["name"], f"{what}: name")
    what = label or f"{what} ({name!r})"
    _unknown(d, _TENSOR_KEYS, what)
    for key in ("shape", "dtype"):
        if key not in d:
            raise InvalidConfig(f"{what}: missing key {key!r}")
    shape = _shape(d["shape"], what)
    same = d.get("same_as")
    spec = TensorSpec(name, shape, _dtype(d["dtype"], what), _rule(d, what, layers, experts),
                      None if same is None else _str(same, f"{what}: same_as"))
    split = spec.rule.split_dim
    if split is not None and split >= len(shape):
        raise InvalidConfig(f"{what}: split_dim {split} is out of range for shape "
                            f"{list(shape)}")
    return spec


def _name_entries(value: Any, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every entry of ``names``."""
    if isinstance(value, Mapping):
        items: list[Any] = []
        for name, v in value.items():
            items.append({**v, "name": name} if isinstance(v, Mapping) else [name, v])
    else:
        items = _list(value, "names")
    out = []
    for i, item in enumerate(items):
        what = f"names[{i}]"
        if isinstance(item, Mapping):
            _unknown(item, ("name", "shape", "dtype"), what)
            for key in ("name", "shape"):
                if key not in item:
                    raise InvalidConfig(f"{what}: missing key {key!r}")
            item = [item["name"], item["shape"]] + ([item["dtype"]] if "dtype" in item else [])
        if not isinstance(item, list) or len(item) not in (2, 3):
            raise InvalidConfig(f"{what}: expected [name, shape] or [name, shape, dtype], not "
                                f"{_short(item)}")
        name = _str(item[0], f"{what}: name")
        out.append((name, _shape(item[1], f"{what} ({name!r})"),
                    _dtype(item[2] if len(item) == 3 else dtype, f"{what} ({name!r})")))
    return out


def _matcher(pattern: str, what: str) -> Callable[[str], bool]:
    try:
        rx = re.compile(pattern[3:] if pattern.startswith("re:") else fnmatch.translate(pattern))
    except re.error as e:
        raise InvalidConfig(f"{what}: bad regular expression {pattern[3:]!r}: {e}") from e
    return lambda name: rx.fullmatch(name) is not None


def _by_rules(d: Mapping[str, Any], layers: int, experts: int) -> list[TensorSpec]:
    entries = _name_entries(d["names"], _dtype(d.get("dtype", "fp16"), "dtype"))
    rules = []
    for i, r in enumerate(_list(d.get("rules", []), "rules")):
        what = f"rules[{i}]"
        r = _table(r, what)
        _unknown(r, ("match",) + _RULE_KEYS, what)
        rules.append((_matcher(_str(r.get("match"), f"{what}: match"), what), r, what))
    out = []
    for name, shape, dtype in entries:
        hit = next(((r, what) for match, r, what in rules if match(name)), None)
        if hit is None:
            raise InvalidConfig(f"{name!r} matches no rule (a last rule with match = \"*\" "
                                "catches every name)")
        r, what = hit
        fields = dict(r)
        del fields["match"]
        if fields.get("stage") == "layer":
            m = _LAYER.search(name)
            if m is None:
                raise InvalidConfig(f"{what} gives stage \"layer\" but {name!r} has no "
                                    "layer number (a dotted part that is a number)")
            fields["stage"] = int(m.group(1))
        if fields.get("expert") == "index":
            m = _EXPERT.search(name)
            if m is None:
                raise InvalidConfig(f"{what} gives expert \"index\" but {name!r} has no "
                                    "experts.<j>")
            fields["expert"] = int(m.group(1))
        out.append(_tensor({"name": name, "shape": list(shape), "dtype": dtype, **fields},
                           what, layers, experts, f"{what} on {name!r}"))
    return out


def _optimizer(model: ModelSpec, value: Any) -> ModelSpec:
    opt = _table(value, "optimizer")
    _unknown(opt, ("states", "master"), "optimizer")
    states = [_str(s, "optimizer: a state") for s in _list(opt.get("states", []),
                                                            "optimizer: states")]
    master = opt.get("master", False)
    if not isinstance(master, bool):
        raise InvalidConfig(f"optimizer: master must be true or false, not {_short(master)}")
    return add_states(model, states, master)


def spec_from_dict(d: Mapping[str, Any]) -> ModelSpec:
    """The model a spec table describes (see the module's docstring);
    InvalidConfig naming the first problem."""
    d = _table(d, "a model spec")
    _unknown(d, _TOP, "the spec")
    for key in ("name", "layers"):
        if key not in d:
            raise InvalidConfig(f"missing key {key!r} (a spec needs name and layers)")
    if "tensors" not in d and "names" not in d:
        raise InvalidConfig("the spec has no tensors: give 'tensors', or 'names' and 'rules'")
    name = _str(d["name"], "name")
    layers = _int(d["layers"], "layers", 1)
    experts = _int(d.get("experts", 0), "experts")
    divides = tuple((str(k), _int(v, f"tp_divides: {k}", 1))
                    for k, v in _table(d.get("tp_divides", {}), "tp_divides").items())
    params: list[tuple[str, int | str]] = []
    for k, v in _table(d.get("params", {}), "params").items():
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise InvalidConfig(f"params: {k} must be a whole number or a string, not "
                                f"{_short(v)}")
        params.append((str(k), v))
    listed = sum(len(d[k]) for k in ("tensors", "names", "pp_only")
                 if isinstance(d.get(k), list | Mapping))
    opt = d.get("optimizer")
    states = opt.get("states") if isinstance(opt, Mapping) else None
    per = 1 + (len(states) if isinstance(states, list) else 0) + (
        isinstance(opt, Mapping) and opt.get("master") is True)
    check_count(listed * per, f"the spec {name!r}")  # before any tensor is built
    tensors = [_tensor(t, f"tensors[{i}]", layers, experts)
               for i, t in enumerate(_list(d.get("tensors", []), "tensors"))]
    if "names" in d:
        tensors += _by_rules(d, layers, experts)
    pp_only = [_tensor(t, f"pp_only[{i}]", layers, experts)
               for i, t in enumerate(_list(d.get("pp_only", []), "pp_only"))]
    model = ModelSpec(name, layers, tuple(tensors), divides, tuple(pp_only), tuple(params),
                      experts)
    if "optimizer" in d:
        model = _optimizer(model, d["optimizer"])
    _check_names(model)
    return check_model(model)


def _check_names(model: ModelSpec) -> None:
    seen: set[str] = set()
    for s in model.tensors + model.pp_only:
        if s.name in seen:
            raise InvalidConfig(f"duplicate tensor name {s.name!r}")
        seen.add(s.name)
    if not model.tensors:
        raise InvalidConfig("the spec has no tensors")
    present = {s.name for s in model.tensors}
    for s in model.tensors + model.pp_only:
        if s.same_as is not None and (s.same_as not in present or s.same_as == s.name):
            raise InvalidConfig(f"{s.name!r}: same_as {s.same_as!r} is not another tensor "
                                "of 'tensors'")


# --- files -----------------------------------------------------------------------


def load_spec_file(path: str | os.PathLike[str]) -> ModelSpec:
    """The model of a ``.toml`` or ``.json`` spec file; InvalidConfig naming
    the file and the problem."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise InvalidConfig(f"{p}: unknown spec file type {suffix!r}; use .toml or .json")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidConfig(f"{p}: cannot read the spec file: {e}") from e
    try:
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise InvalidConfig(f"{p}: not valid {suffix[1:].upper()}: {e}") from e
    try:
        return spec_from_dict(data)
    except InvalidConfig as e:
        raise InvalidConfig(f"{p}: {e}") from e


def dump_spec(model: ModelSpec, fmt: str = "toml") -> str:
    """``model`` as the text of a ``toml`` or ``json`` spec file, one tensor a line."""
    if fmt not in ("toml", "json"):
        raise InvalidConfig(f"unknown spec format {fmt!r}; use toml or json")
    d = spec_to_dict(model)
    if fmt == "json":
        def line(v: Any) -> str:
            return json.dumps(v, ensure_ascii=False)
        parts = [f"  {line(k)}: " + (
            "[\n" + ",\n".join(f"    {line(t)}" for t in v) + "\n  ]"
            if isinstance(v, list) else line(v)) for k, v in d.items()]
        return "{\n" + ",\n".join(parts) + "\n}\n"
    out = []
    for k, v in d.items():
        if isinstance(v, list):
            out.append(f"{toml_key(k)} = [\n" + "".join(f"  {toml_value(t)},\n" for t in v) + "]")
        else:
            out.append(f"{toml_key(k)} = {toml_value(v)}")
    return "\n".join(out) + "\n"


# --- compact text ------------------------------------------------------------------


def encode_spec(model: ModelSpec) -> str:
    """``model`` as one line of ASCII: base64 of zlib-compressed JSON."""
    raw = json.dumps(spec_to_dict(model), separators=(",", ":"), ensure_ascii=False)
    return base64.b64encode(zlib.compress(raw.encode("utf-8"), 9)).decode("ascii")


@lru_cache(maxsize=64)
def decode_spec(text: str) -> ModelSpec:
    """The model :func:`encode_spec` wrote (cached on the text)."""
    try:
        data = json.loads(zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True)))
    except (binascii.Error, zlib.error, UnicodeError, ValueError) as e:
        raise InvalidConfig(f"not an encoded model spec: {e}") from e
    return spec_from_dict(data)
