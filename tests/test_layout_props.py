"""Property tests of the layout rules and the planner over random meshes.

Random models are built from TensorSpec/ShardRule directly (odd shapes that
FSDP's ``torch.chunk`` leaves short or empty, groups, fused parts of unequal
sizes, vocabulary padding,
pipeline stages, experts, optimizer state under ZeRO-1, small dtypes) and,
when :mod:`ptcfs.model.specfile` exists, through spec files too. Random
configurations cover every mesh degree (pp, dp, fsdp, cp, tp, ep, zero) on
hosts of random sizes, sometimes with an explicit ``pp_layers``, an
interleaved pipeline (``vpp``) or FSDP over ``fsdp * cp`` (``cp_shard``).

For random (model, old, new) the plan must give every destination byte
exactly one source, carry every tensor over bit for bit, cross hosts only
with the bytes the lower bound names, and load no host more than HotSPa's
greedy planner does; with replicas and a lost host too. Each configuration's
slices must tile every tensor, match an independent numpy statement of the
layout rules, and agree with rank_tensors, holders and placement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from ptcfs.boxes import box_index, box_volume
from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import InvalidConfig, StateLost
from ptcfs.model.presets import with_optimizer
from ptcfs.plan.planner import min_cross_host_bytes, plan
from ptcfs.plan.reshard import apply_transfers, cut, empty_subtensor, merge
from ptcfs.sharding import (
    holders,
    layout_of,
    placement,
    rank_coords,
    rank_of,
    rank_tensors,
    slice_for,
    stage_layers,
    validate,
)
from ptcfs.types import Host, ModelSpec, ParallelConfig, Part, ShardRule, TensorSpec

POOL = ("h0", "h1", "h2", "h3")
DTYPES = ("uint8", "int16", "fp16", "bf16", "fp32")
MAX_WORLD = 16


def _spec_from_dict() -> Any:
    """ptcfs.model.specfile.spec_from_dict, or None while that module lacks it."""
    try:
        from ptcfs.model.specfile import spec_from_dict  # type: ignore[attr-defined]
    except ImportError:
        return None
    return spec_from_dict


SPEC_FROM_DICT = _spec_from_dict()

PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                        HealthCheck.filter_too_much])


# --- random models ----------------------------------------------------------


@st.composite
def tensor_dicts(draw: st.DrawFn, i: int, layers: int, experts: int) -> list[dict[str, Any]]:
    """One parameter (and maybe its ``optim/exp_avg`` state) as spec-file dicts."""
    ndim = draw(st.sampled_from([1, 1, 2, 2, 2, 3]))
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
    split_dim = draw(st.none() | st.integers(0, ndim - 1)) if ndim else None
    groups, pad, parts = 1, None, []
    if split_dim is not None:
        if draw(st.integers(0, 3)) == 0:
            pad = draw(st.sampled_from([1, 2, 3]))
        elif draw(st.integers(0, 3)) == 0:  # fused parts of their own sizes (q, k, v)
            for k in range(draw(st.integers(1, 3))):
                units = draw(st.sampled_from([1, 2, 4, 4, 8]))
                parts.append({"name": f"p{k}", "size": units * draw(st.integers(1, 3)),
                              "units": units, "unit": "heads"})
            shape[split_dim] = sum(p["size"] for p in parts)
        else:
            groups = draw(st.sampled_from([1, 1, 2, 3]))
            # mostly a length every tp in (1, 2, 4) divides, sometimes any
            per = draw(st.sampled_from([4, 8, 12])) if draw(st.booleans()) \
                else draw(st.integers(1, 6))
            shape[split_dim] = groups * per
    stage: int | str = draw(st.sampled_from(["first", "last"]) | st.integers(0, layers - 1))
    expert = draw(st.none() | st.integers(0, experts - 1)) if experts else None
    d = {"name": f"layers.{i}.w", "shape": shape, "dtype": draw(st.sampled_from(DTYPES)),
         "split_dim": split_dim, "groups": groups, "pad_multiple": pad, "stage": stage,
         "expert": expert, "parts": parts}
    out = [d]
    if draw(st.booleans()):
        out.append(dict(d, name=f"optim/exp_avg/{d['name']}", dtype="fp32"))
    return out


@st.composite
def model_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A random model as a spec-file dict (see ptcfs.model.specfile)."""
    layers = draw(st.integers(1, 4))
    experts = draw(st.sampled_from([0, 0, 2, 4]))
    n = draw(st.integers(1, 5))
    tensors = [t for i in range(n) for t in draw(tensor_dicts(i, layers, experts))]
    return {"name": "random", "layers": layers, "experts": experts, "tensors": tensors}


def model_from_dict(d: dict[str, Any]) -> ModelSpec:
    """The ModelSpec a spec-file dict describes, built by hand."""
    specs = tuple(
        TensorSpec(t["name"], tuple(t["shape"]), t["dtype"],
                   ShardRule(t["split_dim"], t["groups"], t["pad_multiple"], t["stage"],
                             t["expert"], tuple(Part(**p) for p in t["parts"])))
        for t in d["tensors"])
    return ModelSpec(d["name"], d["layers"], specs, experts=d["experts"])


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    model = model_from_dict(draw(model_dicts()))
    if draw(st.integers(0, 4)) == 0:  # an output layer tied to the first tensor when pp > 1
        first = model.tensors[0]
        tied = TensorSpec("output.weight", first.shape, first.dtype,
                          ShardRule(first.rule.split_dim, first.rule.groups,
                                    first.rule.pad_multiple, "last", parts=first.rule.parts),
                          same_as=first.name)
        model = ModelSpec(model.name, model.layers, model.tensors, pp_only=(tied,),
                          experts=model.experts)
    return model


# --- random configurations ----------------------------------------------------


@st.composite
def configs(draw: st.DrawFn, model: ModelSpec, pool: tuple[str, ...] = POOL) -> ParallelConfig:
    """A configuration ``model`` accepts (others are rejected through assume)."""
    room = MAX_WORLD

    def degree(options: list[int]) -> int:
        nonlocal room
        value = draw(st.sampled_from([v for v in options if v <= room]))
        room //= value
        return value

    tp = degree([1, 2, 4])
    fsdp = degree([1, 1, 2, 3, 4])
    pp = degree(list(range(1, min(3, model.layers) + 1)))
    dp = degree([1, 2, 3])
    cp = degree([1, 1, 2])
    ep = draw(st.sampled_from([e for e in (1, 2, 2, 4) if model.experts % e == 0])) \
        if model.experts else 1
    zero = draw(st.integers(0, 1))
    # cp ranks hold replicas (Megatron-Core) or their own FSDP chunks (torchtitan)
    cp_shard = draw(st.integers(0, 1)) if cp > 1 else 0
    world = pp * dp * fsdp * cp * tp
    pp_layers: tuple[int, ...] = ()
    # an interleaved pipeline: pp*vpp chunks of layers, chunk c on stage c % pp
    vpp = draw(st.sampled_from([1, 1, 2])) if 1 < pp and 2 * pp <= model.layers else 1
    chunks = pp * vpp
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, model.layers - 1), min_size=chunks - 1,
                                    max_size=chunks - 1, unique=True)))
        bounds = [0, *cuts, model.layers]
        pp_layers = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    names = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool), unique=True))
    gpus = [draw(st.integers(1, world)) for _ in names]
    short = world - sum(gpus)
    if short > 0:
        gpus[draw(st.integers(0, len(gpus) - 1))] += short
    cfg = ParallelConfig(tp, pp, dp, tuple(Host(n, g) for n, g in zip(names, gpus)), fsdp=fsdp,
                         cp=cp, ep=ep, zero=zero, pp_layers=pp_layers, vpp=vpp,
                         cp_shard=cp_shard)
    try:
        validate(model, cfg)
    except InvalidConfig:
        assume(False)
    describe(model, cfg)
    return cfg


def describe(model: ModelSpec, cfg: ParallelConfig) -> None:
    """Name what a configuration exercises (``--hypothesis-show-statistics``)."""
    for spec in model.tensors_for(cfg.pp):
        layout = layout_of(spec, cfg)
        n = spec.shape[0] if spec.shape else 0
        if layout.tp_cut is not None and layout.tp_cut.dim == 0:
            n //= cfg.tp
        if layout.shard > 1 and n % layout.shard:
            event("fsdp chunks uneven or empty")
        if layout.zero > 1:
            event("zero-1 shards optimizer state")
        if layout.shard > 1 and layout.zero > 1:
            event("fsdp and zero-1 on one tensor")
        if spec.rule.expert is not None and cfg.ep > 1:
            event("expert parallel")
        if layout.tp_cut is not None and layout.tp_cut.padded is not None and cfg.tp > 1:
            event("padded tp split")
        if layout.tp_cut is not None and layout.tp_cut.groups > 1 and cfg.tp > 1:
            event("grouped tp split")
        if layout.tp_cut is not None and layout.tp_cut.sizes and cfg.tp > 1:
            event("fused parts split")
    if cfg.pp_layers:
        event("pp_layers given")
    if cfg.vpp > 1:
        event("interleaved pipeline")
    if cfg.cp > 1:
        event("cp > 1, FSDP over fsdp x cp" if cfg.cp_shard else "cp > 1, cp replicas")


# --- logical state and what each host stores ------------------------------------


def random_state(model: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """Random bit patterns for every logical tensor (tied ones share theirs)."""
    rng = np.random.default_rng(seed)
    specs = {s.name: s for s in model.tensors + model.pp_only}
    out = {}
    for name, s in specs.items():
        if not s.same_as:
            raw = rng.integers(0, 256, size=s.nbytes, dtype=np.uint8)
            out[name] = raw.view(numpy_dtype(s.dtype)).reshape(s.shape)
    for name, s in specs.items():
        if s.same_as:
            out[name] = out[s.same_as]
    return out


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def host_state(model, cfg, logical, replicas=1, ring=(), lost=frozenset()):
    """What every host stores under cfg: (host, tensor, slice) → array."""
    out = {}
    for spec in model.tensors_for(cfg.pp):
        for sl, hosts in placement(model, cfg, spec, replicas, ring, lost).items():
            for h in hosts:
                out[(h, spec.name, sl)] = cut(spec, sl, logical[spec.name])
    return out


def check_plan_props(model: ModelSpec, old: ParallelConfig, new: ParallelConfig, seed: int,
                     replicas: int = 1, old_ring: tuple[str, ...] = (),
                     new_ring: tuple[str, ...] = (), lost: frozenset[str] = frozenset()) -> None:
    where = dict(replicas=replicas, old_ring=old_ring, new_ring=new_ring, lost=lost)
    p = plan(model, old, new, **where)
    specs = {s.name: s for s in model.tensors_for(new.pp)}
    logical = random_state(model, seed)
    src = host_state(model, old, logical, replicas, old_ring, lost)
    assert not any(h in lost for h, _, _ in src)

    # (a) every destination byte has exactly one source: per destination
    # sub-tensor the dst boxes are disjoint and cover its pieces, not padding
    dests = {(h, spec.name, sl) for spec in specs.values()
             for sl, hosts in placement(model, new, spec, replicas, new_ring).items()
             for h in hosts}
    counts = {k: np.zeros(k[2].local_shape(specs[k[1]].shape), dtype=np.int32) for k in dests}
    for t in p.transfers:
        key = (t.dst.host, t.dst.tensor, t.dst.slice)
        assert key in counts, f"transfer to a sub-tensor the new configuration lacks: {key}"
        assert (t.src.host, t.src.tensor, t.src.slice) in src, f"source lacks {t.src}"
        assert t.src.host not in lost
        counts[key][box_index(t.dst.box)] += 1
        assert t.nbytes == box_volume(t.dst.box) * specs[t.dst.tensor].itemsize
        for end, shape in ((t.src, src[(t.src.host, t.src.tensor, t.src.slice)].shape),
                           (t.dst, counts[key].shape)):
            assert len(end.box) == len(shape)
            assert all(0 <= a < b <= n for (a, b), n in zip(end.box, shape)), end
    fills = set(p.fills)
    for (h, name, sl), c in counts.items():
        state = np.zeros(c.shape, dtype=np.int32)
        for _, local in sl.pieces(specs[name].shape):
            state[box_index(local)] += 1
        assert state.max(initial=0) <= 1, f"pieces of {name} [{sl.key()}] overlap"
        np.testing.assert_array_equal(c, state, err_msg=f"{h} {name} [{sl.key()}]")
        assert ((h, name, sl.key()) in fills) == (int(state.sum()) < state.size)

    # (b) split, move, merge: every tensor comes back bit for bit, every copy
    # of every new sub-tensor equals its cut, padding is zero
    got = {k: empty_subtensor(specs[k[1]], k[2]) for k in dests}
    moved = apply_transfers(p.transfers, lambda h, n, s: src[(h, n, s)],
                            lambda h, n, s: got[(h, n, s)])
    assert moved == sum(t.nbytes for t in p.transfers)
    for name, spec in specs.items():
        parts = [(sl, a) for (_, n, sl), a in got.items() if n == name]
        assert bits(merge(spec, parts)) == bits(logical[name]), name
    for (h, name, sl), a in got.items():
        assert bits(a) == bits(cut(specs[name], sl, logical[name])), (h, name, sl.key())

    # (c) cross-host bytes at the lower bound; (d) no host sends more than greedy's
    assert p.bytes_cross_host == p.bytes_min_cross_host == min_cross_host_bytes(
        model, old, new, **where)
    greedy = plan(model, old, new, strategy="greedy", **where)
    assert greedy.bytes_cross_host == p.bytes_cross_host
    assert p.max_host_send_bytes <= greedy.max_host_send_bytes
    # the plan's own figures say what its transfers do
    sent = dict.fromkeys(dict(p.host_send), 0)
    for t in p.transfers:
        if t.cross_host:
            sent[t.src.host] += t.nbytes
    assert sent == dict(p.host_send)
    assert p.bytes_total == sum(
        box_volume(tuple((0, n) for n in sl.local_shape(s.shape))) * s.itemsize
        for r in range(new.world) for s, sl in rank_tensors(model, new, r))
    if p.bytes_cross_host:
        if currently_in_test_context():
            event("bytes cross hosts")


@settings(PROPS, max_examples=300)
@given(data=st.data())
def test_plans_on_random_meshes(data: st.DataObject) -> None:
    model = data.draw(models(), "model")
    old = data.draw(configs(model), "old")
    new = data.draw(configs(model), "new")
    check_plan_props(model, old, new, seed=data.draw(st.integers(0, 2**16), "seed"))


@settings(PROPS, max_examples=200)
@given(data=st.data())
def test_plans_with_replicas_and_a_lost_host(data: st.DataObject) -> None:
    model = data.draw(models(), "model")
    old = data.draw(configs(model), "old")
    ring = POOL
    lost = frozenset({data.draw(st.sampled_from(ring), "lost")})
    alive = tuple(h for h in ring if h not in lost)
    new = data.draw(configs(model, pool=alive), "new")
    try:
        plan(model, old, new, replicas=2, old_ring=ring, new_ring=alive, lost=lost)
    except StateLost:
        # only when some old slice really had both copies on the lost host
        assert any(not hosts for spec in model.tensors_for(old.pp)
                   for hosts in placement(model, old, spec, 2, ring, lost).values())
        assume(False)
    check_plan_props(model, old, new, seed=1, replicas=2, old_ring=ring, new_ring=alive,
                     lost=lost)


# --- σ, φ, α of one configuration -------------------------------------------------


def _chunk(a: np.ndarray, parts: int, index: int) -> np.ndarray:
    """``torch.chunk(a, parts)[index]`` along dim 0, empty where torch has none."""
    size = -(-a.shape[0] // parts)
    return a[min(index * size, a.shape[0]):min((index + 1) * size, a.shape[0])]


def reference_subtensor(model: ModelSpec, cfg: ParallelConfig, spec: TensorSpec, rank: int,
                        x: np.ndarray) -> np.ndarray:
    """Rank ``rank``'s sub-tensor of ``x``, stated from the rules in the
    sharding module's docstring with numpy only (no Cut, no Slice)."""
    c = rank_coords(cfg)[rank]
    rule = spec.rule
    if rule.split_dim is not None:
        d = rule.split_dim
        if rule.pad_multiple is not None:
            step = rule.pad_multiple * cfg.tp
            pad = [(0, 0)] * x.ndim
            pad[d] = (0, -(-x.shape[d] // step) * step - x.shape[d])
            x = np.pad(x, pad)
        bounds = np.cumsum([p.size for p in rule.parts])[:-1] if rule.parts else rule.groups
        parts = [np.array_split(g, cfg.tp, axis=d)[c.tp_rank]
                 for g in np.split(x, bounds, axis=d)]
        x = np.concatenate(parts, axis=d)
    if x.ndim == 0:
        return x
    # FSDP chunks over fsdp (cp replicas), or with cp_shard=1 over the
    # flattened fsdp x cp mesh (torchtitan's dp_shard_cp)
    shard, zero = cfg.fsdp * (cfg.cp if cfg.cp_shard else 1), cfg.dp
    shard_rank = c.fsdp_rank * cfg.cp + c.cp_rank if cfg.cp_shard else c.fsdp_rank
    zero_rank = c.dp_rank
    if rule.expert is not None and cfg.ep > 1:
        shard = cfg.fsdp // cfg.ep if cfg.fsdp % cfg.ep == 0 else 1
        zero = cfg.data_parallel // (cfg.ep * shard)
        rest = c.data_rank // cfg.ep
        shard_rank, zero_rank = rest % shard, rest // shard
    x = _chunk(x, shard, shard_rank)
    if cfg.zero and spec.is_optim:
        x = _chunk(x, zero, zero_rank)
    return x


def expected_holders(model: ModelSpec, cfg: ParallelConfig, spec: TensorSpec) -> set[int]:
    """The ranks that hold ``spec``: its stage's, and its expert's ep rank's."""
    stage = spec.rule.stage
    if stage == "first":
        s = 0
    elif stage == "last":
        s = cfg.pp - 1
    else:
        s = next(i for i, r in enumerate(stage_layers(model.layers, cfg.pp * cfg.vpp,
                                                      cfg.pp_layers)) if stage in r) % cfg.pp
    out = set()
    for c in rank_coords(cfg):
        e = spec.rule.expert
        if c.pp_rank == s and (e is None or cfg.ep == 1
                               or e // (model.experts // cfg.ep) == c.data_rank % cfg.ep):
            out.add(c.rank)
    return out


def check_layout_props(model: ModelSpec, cfg: ParallelConfig, seed: int) -> None:
    coords = rank_coords(cfg)
    # α: the mesh order and hosts filled in list order
    host_of = [h.name for h in cfg.hosts for _ in range(h.gpus)]
    for c in coords:
        assert rank_of(cfg, c.tp_rank, c.dp_rank, c.pp_rank, c.fsdp_rank, c.cp_rank) == c.rank
        assert c.host == host_of[c.rank]
        assert c.data_rank == c.dp_rank * cfg.fsdp + c.fsdp_rank
    by_rank = {c.rank: {s.name: sl for s, sl in rank_tensors(model, cfg, c.rank)}
               for c in coords}
    logical = random_state(model, seed)
    for spec in model.tensors_for(cfg.pp):
        shape = spec.shape
        slices = layout_of(spec, cfg).slices()
        # σ: the slices are distinct, disjoint and cover the tensor
        assert len(set(slices)) == len(slices)
        cover = np.zeros(shape, dtype=np.int32)
        for sl in slices:
            local = np.zeros(sl.local_shape(shape), dtype=np.int32)
            for lbox, lcl in sl.pieces(shape):
                cover[box_index(lbox)] += 1
                local[box_index(lcl)] += 1
            assert local.max(initial=0) <= 1, f"{spec.name} [{sl.key()}] pieces overlap"
        assert (cover == 1).all(), f"{spec.name}: slices do not tile the tensor exactly"
        # φ: rank_tensors, slice_for, holders, placement and the rules agree
        want = expected_holders(model, cfg, spec)
        assert {r for r, t in by_rank.items() if spec.name in t} == want, spec.name
        held = holders(model, cfg, spec)
        assert placement(model, cfg, spec) == held
        assert set(held) <= set(slices)
        seen = set()
        for sl, hosts in held.items():
            assert hosts and all(hosts.values()), f"{spec.name} [{sl.key()}] has no rank"
            for h, ranks in hosts.items():
                for r in ranks:
                    assert coords[r].host == h and r not in seen
                    seen.add(r)
                    assert by_rank[r][spec.name] == sl == slice_for(spec, cfg, r)
        assert seen == want
        # holders cover the tensor: every piece of state has a rank
        if want:
            assert set(held) == set(slices), spec.name
        # σ against the rules stated with numpy
        x = logical[spec.name]
        for r in want:
            sub = cut(spec, by_rank[r][spec.name], x)
            ref = reference_subtensor(model, cfg, spec, r, x)
            assert sub.shape == ref.shape, (spec.name, r, sub.shape, ref.shape)
            assert bits(sub) == bits(ref), (spec.name, r)


@settings(PROPS, max_examples=400)
@given(data=st.data())
def test_layouts_on_random_meshes(data: st.DataObject) -> None:
    model = data.draw(models(), "model")
    cfg = data.draw(configs(model), "cfg")
    check_layout_props(model, cfg, seed=data.draw(st.integers(0, 2**16), "seed"))


def test_scalar_tensors_survive_a_plan() -> None:
    # a 0-d tensor (Adam's step count) is replicated under every layout
    step = TensorSpec("optim/step/w", (), "fp32")
    w = TensorSpec("w", (8, 4), "fp32", ShardRule(split_dim=0))
    model = ModelSpec("scalar", 1, (w, step))
    old = ParallelConfig(2, 1, 1, (Host("h0", 2),), fsdp=1)
    new = ParallelConfig(1, 1, 1, (Host("h1", 2),), fsdp=2, zero=1)
    check_layout_props(model, new, seed=0)
    check_plan_props(model, old, new, seed=0)


MOE = ModelSpec("moe", 1, tuple(TensorSpec(f"experts.{e}.w", (4, 4), "fp16", ShardRule(expert=e))
                                for e in range(2)), experts=2)


@st.composite
def params_and_config(draw: st.DrawFn) -> tuple[ModelSpec, ParallelConfig]:
    """A random model without optimizer state, and a configuration for it."""
    drawn = draw(models())
    model = dataclasses.replace(drawn, tensors=tuple(t for t in drawn.tensors if not t.is_optim))
    return model, draw(configs(model))


@settings(PROPS, max_examples=100)
@example(case=(MOE, ParallelConfig(1, 1, 2, (Host("h0", 2),), ep=2)))
@given(case=params_and_config())
def test_optimizer_state_sits_beside_its_parameter(
        case: tuple[ModelSpec, ParallelConfig]) -> None:
    model, cfg = case
    adam = with_optimizer(model, "adam")
    assert (adam.layers, adam.experts, adam.tp_divides) == (
        model.layers, model.experts, model.tp_divides)
    validate(adam, cfg)
    ranks = {s.name: {r for hosts in holders(adam, cfg, s).values() for rs in hosts.values()
                      for r in rs} for s in adam.tensors_for(cfg.pp)}
    for s in adam.tensors_for(cfg.pp):
        if s.is_optim:
            assert ranks[s.name] == ranks[s.name.split("/", 2)[2]], s.name


# --- models from spec files --------------------------------------------------------


@pytest.mark.skipif(SPEC_FROM_DICT is None, reason="ptcfs.model.specfile has no spec_from_dict yet")
@settings(PROPS, max_examples=40)
@given(data=st.data())
def test_random_spec_files(data: st.DataObject) -> None:
    d = data.draw(model_dicts(), "spec file")
    model = SPEC_FROM_DICT(d)
    by_hand = model_from_dict(d)
    assert (model.layers, model.experts) == (by_hand.layers, by_hand.experts)
    assert model.tensors == by_hand.tensors
    old = data.draw(configs(model), "old")
    new = data.draw(configs(model), "new")
    check_layout_props(model, new, seed=2)
    check_plan_props(model, old, new, seed=3)


# --- fused tensors of unequal parts ------------------------------------------------


@st.composite
def fused(draw: st.DrawFn) -> tuple[TensorSpec, int]:
    """A fused tensor of 1-4 parts of their own sizes (whole heads of their own
    widths) along a random dimension, and a tp that divides every part's heads."""
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    parts = tuple(Part(f"p{k}", heads * width, heads, "heads")
                  for k, (heads, width) in enumerate(draw(st.lists(
                      st.tuples(st.integers(1, 4).map(lambda n: n * tp), st.integers(1, 3)),
                      min_size=1, max_size=4))))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[dim] = sum(p.size for p in parts)
    return TensorSpec("qkv", tuple(shape), draw(st.sampled_from(DTYPES)),
                      ShardRule(split_dim=dim, parts=parts)), tp


@settings(PROPS, max_examples=200)
@given(case=fused(), seed=st.integers(0, 2**16), fsdp=st.sampled_from([1, 2, 3]))
def test_fused_parts_split_then_merge(case: tuple[TensorSpec, int], seed: int,
                                      fsdp: int) -> None:
    """Each rank's slice is its share of every part, in order; the slices of
    all ranks merge back to the tensor, bit for bit."""
    spec, tp = case
    model = ModelSpec("fused", 1, (spec,))
    cfg = ParallelConfig(tp, 1, 1, (Host("h0", tp * fsdp),), fsdp=fsdp)
    validate(model, cfg)
    x = random_state(model, seed)["qkv"]
    d = spec.rule.split_dim
    assert d is not None
    bounds = np.cumsum([p.size for p in spec.rule.parts])[:-1]
    got = []
    for r in range(cfg.world):
        c = rank_coords(cfg)[r]
        sl = slice_for(spec, cfg, r)
        sub = cut(spec, sl, x)
        own = np.concatenate([np.split(p, tp, axis=d)[c.tp_rank]
                              for p in np.split(x, bounds, axis=d)], axis=d)
        assert bits(sub) == bits(_chunk(own, fsdp, c.fsdp_rank)), (r, sl.key())
        got.append((sl, sub))
    assert bits(merge(spec, got)) == bits(x)


@pytest.mark.parametrize("tp,message", [
    (4, "tp=4 does not divide part k of qkv: its 2 heads"),
    (3, "tp=3 does not divide part q of qkv: its 4 heads"),
])
def test_a_part_tp_does_not_divide_is_named(tp: int, message: str) -> None:
    parts = (Part("q", 64, 4, "heads"), Part("k", 32, 2, "heads"), Part("v", 32, 2, "heads"))
    model = ModelSpec("phi3", 1, (TensorSpec("qkv", (128, 64), "fp32",
                                             ShardRule(split_dim=0, parts=parts)),))
    with pytest.raises(InvalidConfig, match=message):
        validate(model, ParallelConfig(tp, 1, 1, (Host("h0", tp),)))
    wrong = dataclasses.replace(model.tensors[0], shape=(127, 64))
    with pytest.raises(InvalidConfig, match=r"add up to 128, but dimension 0 is 127"):
        validate(dataclasses.replace(model, tensors=(wrong,)),
                 ParallelConfig(2, 1, 1, (Host("h0", 2),)))
