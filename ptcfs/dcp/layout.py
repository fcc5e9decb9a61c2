"""What a job version is as a DCP checkpoint: its keys, chunks and small entries.

The one description of the ``torch-dcp`` format, shared by ``ptcctl export
--format torch-dcp`` (:mod:`ptcfs.client.formats.dcp_layout`, which writes it
with DCP's own writer) and by the mount's ``/ptc/<job>/dcp/step-<N>/``
(:mod:`ptcfs.dcp.view`, which serves it as files over the store's bytes).

Keys, those of torch's recipe
``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``
flattened as DCP flattens them: ``model.<name>`` (for a job that keeps fp32
masters: the master; ``ptcfs_param.<name>`` the parameter in its dtype),
``optim.state.<name>.<kind>`` and ``optim.state.<name>.step``,
``optim.param_groups.<i>.<setting>``, and ``step``, ``ptcfs_model``,
``ptcfs_spec``, ``ptcfs_config``. A version written by ``dcp.save`` through
the mount keeps the keys it was saved with (:data:`KEYS_META`).

Chunks: every distinct sub-tensor of the job's configuration is one chunk
(a fused or padded slice: one per piece), as ``dcp.save`` of the ranks'
DTensors stores them; ``max_bytes`` also cuts a chunk into blocks of rows,
so that a reader on another mesh reads little more than its own bytes.
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

from ptcfs.jobstate import JobState
from ptcfs.model.optgroups import named_groups
from ptcfs.model.specfile import encode_spec
from ptcfs.sharding import layout_of
from ptcfs.types import Box, ModelSpec, Slice, TensorSpec

__all__ = ["PARAM_KEY", "Chunk", "Saved", "saved", "dcp_keys", "chunks", "small_entries",
           "ADAM_DEFAULTS", "job_name"]

#: Top-level key of the job-dtype parameters whose fp32 masters are ``model.<name>``.
PARAM_KEY = "ptcfs_param"
#: torch's Adam / AdamW group settings (torch 2.x), for jobs that recorded none
ADAM_DEFAULTS: dict[str, dict[str, Any]] = {
    opt: {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08,
          "weight_decay": 0.01 if opt == "adamw" else 0, "amsgrad": False,
          "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
          "fused": None, "decoupled_weight_decay": opt == "adamw"}
    for opt in ("adam", "adamw")}


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of key ``fqn``: ``sizes`` at ``offsets`` of the
    logical tensor, the box ``local`` of the sub-tensor ``slice`` of ``spec``;
    ``whole``: the key's shape when it is not ``spec``'s (a key made of rows
    of several job tensors, :class:`ptcfs.dcp.titan.Composite`)."""

    fqn: str
    spec: TensorSpec
    slice: Slice
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: Box
    whole: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Saved:
    """What a ``dcp.save`` through the mount saved besides the job's tensors:
    ``keys`` (its DCP key → job tensor name), ``blobs`` (key → the stored
    item's bytes: a ``torch.save`` archive) and ``tensors`` (of those, the
    ones that are small tensors: key → ``(dtype, shape)``).

    The record keeps the blobs one after the other, compressed
    (``zbytes``, their lengths in ``sizes``): a trainer keeps a dozen
    settings per parameter (torchtitan's optimizer groups), each a
    ``torch.save`` archive of about a kilobyte that differs from the others
    in a few bytes, and every version's record travels in one reply."""

    keys: dict[str, str] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def packed(self) -> bytes:
        """The blobs as the record keeps them: concatenated, compressed."""
        return zlib.compress(b"".join(self.blobs.values()), 6)

    def encode(self) -> str:
        return json.dumps({"keys": self.keys,
                           "sizes": [[k, len(v)] for k, v in self.blobs.items()],
                           "zbytes": base64.b64encode(self.packed()).decode(),
                           "tensors": {k: [d, list(s)] for k, (d, s) in self.tensors.items()}},
                          separators=(",", ":"))


def saved(state: JobState) -> Saved | None:
    """The record's :class:`Saved` (None: the version never came from dcp.save)."""
    if not state.dcp:
        return None
    doc = json.loads(state.dcp)
    blobs = {k: base64.b64decode(v) for k, v in doc.get("bytes", {}).items()}  # older records
    packed = zlib.decompress(base64.b64decode(doc["zbytes"])) if "zbytes" in doc else b""
    at = 0
    for k, n in doc.get("sizes", []):
        blobs[k], at = packed[at:at + n], at + n
    return Saved(dict(doc.get("keys", {})), blobs,
                 {k: (str(d), tuple(int(n) for n in s))
                  for k, (d, s) in doc.get("tensors", {}).items()})


def job_name(key: str, names: set[str]) -> str | None:
    """The job tensor a DCP key holds: ``model.<name>`` or ``<name>`` (a
    flattened model, torchtitan's), ``optim.state.<name>.<kind>`` or
    ``optimizer.state.<name>.<kind>``; None when it names none of ``names``."""
    for prefix in ("optim.state.", "optimizer.state."):
        if key.startswith(prefix):
            rest, _, kind = key[len(prefix):].rpartition(".")
            name = f"optim/{kind}/{rest}"
            return name if name in names else None
    for name in (key.removeprefix("model."), key):
        if name in names:
            return name
    return None


def dcp_keys(state: JobState, saved: dict[str, str] | None = None
             ) -> dict[tuple[str, ...], TensorSpec]:
    """Every tensor's path in the nested state dict (``("model", name)``,
    ``("optim", "state", name, kind)``, ``(PARAM_KEY, name)``) → the job
    tensor whose values it holds. ``saved``: the keys a version saved by
    ``dcp.save`` through the mount was saved with (its record's
    :data:`KEYS_META`), each one path element."""
    model = state.model_spec()
    specs = {s.name: s for s in model.tensors}
    if saved:
        return {(k,): specs[n] for k, n in saved.items() if n in specs}
    out: dict[tuple[str, ...], TensorSpec] = {}
    for s in model.tensors:
        if s.is_optim:
            _, kind, name = s.name.split("/", 2)
            if kind != "master":
                out[("optim", "state", name, kind)] = s
            continue
        master = specs.get(f"optim/master/{s.name}")
        out[("model", s.name)] = master or s
        if master is not None:
            out[(PARAM_KEY, s.name)] = s
    return out


def chunks(state: JobState, keys: dict[tuple[str, ...], TensorSpec],
           max_bytes: int | None = None) -> list[Chunk]:
    """The chunks of every key under the job's configuration, each at most
    ``max_bytes`` (cut into blocks of rows; a row is never cut)."""
    out = []
    for path, spec in keys.items():
        fqn = ".".join(path)
        for sl in layout_of(spec, state.config).slices():
            for lbox, local in sl.pieces(spec.shape):
                if not lbox:  # a scalar
                    out.append(Chunk(fqn, spec, sl, (), (), local))
                    continue
                rows = _rows(lbox, spec.itemsize, max_bytes)
                (a0, a1), (l0, _) = lbox[0], local[0]
                for r0 in range(a0, a1, rows):
                    r1 = min(r0 + rows, a1)
                    sub = ((r0, r1), *lbox[1:])
                    loc = ((l0 + r0 - a0, l0 + r1 - a0), *local[1:])
                    out.append(Chunk(fqn, spec, sl, tuple(a for a, _ in sub),
                                     tuple(b - a for a, b in sub), loc))
    return out


def _rows(box: Box, itemsize: int, max_bytes: int | None) -> int:
    if not box:
        return 1
    if max_bytes is None:
        return max(1, box[0][1] - box[0][0])
    row = itemsize * math.prod(b - a for a, b in box[1:])
    return max(1, max_bytes // max(row, 1))


def small_entries(state: JobState, keys: dict[tuple[str, ...], TensorSpec],
                  defaults: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The non-tensor entries (nested, as the state dict holds them), and
    ``optim.state.<name>.step`` as floats (tensors in the checkpoint)."""
    small: dict[str, Any] = {"step": state.step, "ptcfs_model": state.model,
                             "ptcfs_spec": state.spec or encode_spec(state.model_spec()),
                             "ptcfs_config": state.config.degrees_text()}
    params = [p[1] for p in keys if p[0] == "model" and len(p) == 2]
    if state.optimizer in ("adam", "adamw") and params:
        small["optim"] = {
            "state": {n: {"step": float(state.step)} for n in params},
            "param_groups": groups((defaults or ADAM_DEFAULTS)[state.optimizer],
                                   state.model_spec(), params)}
    return small


def groups(default: dict[str, Any], model: ModelSpec, names: list[str]) -> list[dict[str, Any]]:
    """The param groups over ``names``: the groups the job recorded, with
    their settings, then ``default`` over the names none of them covers."""
    return [{**default, **(settings or {}), "params": list(members)}
            for settings, members in named_groups(model, names)]
