"""Which mesh a sharded checkpoint was saved under, from the chunks each
tensor was cut into and the ranks that wrote them: a pure function of the
model and the chunks, apart from the format that read them (``ptcctl import``
infers the mesh of a DCP checkpoint with it)."""

from __future__ import annotations

from typing import Any

from ptcfs.errors import InvalidConfig, PtcError
from ptcfs.sharding import layout_of, parse_config, pipeline_split, validate
from ptcfs.types import Host, ModelSpec, TensorSpec

__all__ = ["infer_mesh"]


def infer_mesh(model: ModelSpec, chunks: dict[str, frozenset[tuple[tuple[int, ...],
                                                                    tuple[int, ...]]]],
               ranks: int, writers: dict[str, frozenset[int]] | None = None) -> str | None:
    """The mesh of ``ranks`` ranks under which every tensor of ``model`` the
    checkpoint has is cut into exactly its chunks (None: no such mesh).
    Pipeline meshes come first, most stages first: one fits where the
    ranks that wrote each tensor (``writers``) lie in one stage, each stage
    holding the next layers, which give its ``pp_layers`` (or chunks of
    them going round the stages: an interleaved pipeline, its ``vpp``); then the
    data/fully-sharded/tensor-parallel meshes without stages."""
    specs = {s.name: s for s in model.tensors}
    known = [(specs[n], want) for n, want in chunks.items() if n in specs]
    if ranks < 1 or not known:
        return None
    for pp in sorted((d for d in range(2, ranks + 1) if ranks % d == 0), reverse=True):
        split = _stage_split(known, writers or {}, pp, ranks // pp, model.layers)
        if split is not None:
            found = _inner_mesh(model, known, ranks, pp, split)
            if found is not None:
                return found
    return _inner_mesh(model, known, ranks, 1, (1, ()))


def _stage_split(known: list[tuple[TensorSpec, Any]], writers: dict[str, frozenset[int]],
                 pp: int, inner: int, layers: int) -> tuple[int, tuple[int, ...]] | None:
    """``(vpp, pp_layers)`` where the ranks that wrote each tensor lie in
    one stage of ``pp`` (``inner`` ranks each) as its rule says, each stage
    holding the next layers or chunks of them going round the stages
    (interleaved); else None."""
    held: list[set[int]] = [set() for _ in range(pp)]
    for spec, _ in known:
        stages = {r // inner for r in writers.get(spec.name, ())}
        if len(stages) != 1:
            return None
        (s,) = stages
        where = spec.rule.stage
        if where == "first" and s != 0 or where == "last" and s != pp - 1:
            return None
        if isinstance(where, int):
            held[s].add(where)
    try:
        vpp, counts = pipeline_split(held)
    except InvalidConfig:
        return None
    return (vpp, counts) if sum(counts) == layers else None


def _inner_mesh(model: ModelSpec, known: list[tuple[TensorSpec, Any]], ranks: int, pp: int,
                split: tuple[int, tuple[int, ...]]) -> str | None:
    """The first data/fully-sharded/tensor-parallel mesh within ``pp``
    stages split as ``split`` (``(vpp, pp_layers)``) under which every
    tensor is cut into its chunks."""
    inner = ranks // pp
    vpp, counts = split
    stages = (f"pp={pp},{f'vpp={vpp},' if vpp > 1 else ''}"
              f"pp_layers={':'.join(map(str, counts))},") if pp > 1 else ""
    for tp in (d for d in range(1, inner + 1) if inner % d == 0):
        for fsdp in (d for d in range(1, inner // tp + 1) if inner // tp % d == 0):
            text = f"{stages}dp={inner // (tp * fsdp)},fsdp={fsdp},tp={tp}"
            try:
                cfg = parse_config(text, (Host("any", ranks),))
                validate(model, cfg)
            except PtcError:
                continue
            if all(frozenset((tuple(a for a, _ in box), tuple(b - a for a, b in box))
                             for sl in layout_of(spec, cfg).slices()
                             for box, _ in sl.pieces(spec.shape)) == want
                   for spec, want in known):
                return text
    return None
