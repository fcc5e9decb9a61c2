"""One mesh per sequence-length group (:mod:`ptcfs.suggest.lengths`) and
``ptcctl suggest --seq-lengths``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ptcfs.errors import InvalidConfig
from ptcfs.model.presets import parse_model
from ptcfs.suggest import PROFILES, Query
from ptcfs.suggest.lengths import length_groups, plan_groups, routing, switch_seconds
from ptcfs.suggest.memory import StateClasses
from ptcfs.suggest.search import estimate
from ptcfs.types import Host, ParallelConfig
from tests.test_suggest import _ptcctl

LLAMA2_7B = "llama:layers=32,hidden=4096,heads=32,kv_heads=32,vocab=32000,ffn=11008"
HOSTS = (Host("h0", 8),)


def _model():
    return parse_model(LLAMA2_7B, dtype="bf16", optimizer="adam")


def _skewed(n: int = 2000) -> list[int]:
    """Most sequences short, a few long (log-normal, as in HotSPa's datasets)."""
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(7, 1.2, n).astype(int), 64, 32768).tolist()


def _query() -> Query:
    return Query(_model(), HOSTS, 512, 1024, PROFILES["a100-80gb"], recompute="selective")


def test_skewed_lengths_get_wider_tensor_parallelism_as_they_grow():
    """Longer groups split each sequence over more GPUs: tensor parallelism
    never narrows, and tensor times context parallelism widens (context
    parallelism shards the state too, so it may be the cheaper widening)."""
    p = plan_groups(_query(), _skewed())
    assert len(p.groups) > 1
    tps = [g.estimate.config.tp for g in p.groups]
    widths = [g.estimate.config.tp * g.estimate.config.cp for g in p.groups]
    assert tps == sorted(tps) and widths == sorted(widths) and widths[0] < widths[-1]
    assert [g.bound for g in p.groups] == sorted(g.bound for g in p.groups)
    assert all(g.estimate.fits for g in p.groups)
    assert p.switch_seconds >= 0 and (p.switch_bytes > 0) == (tps[0] < tps[-1])
    assert p.speedup >= 1.0
    assert sum(g.count for g in p.groups) == 2000


def test_uniform_lengths_are_one_group():
    p = plan_groups(_query(), [4096] * 300)
    assert len(p.groups) == 1 and p.switch_seconds == 0 and p.speedup == 1.0
    assert p.groups[0].estimate.config == p.single


def test_buckets_are_powers_of_two():
    assert [(b, len(ls)) for b, ls in length_groups([1, 256, 257, 4000, 4096])] == \
        [(256, 2), (512, 1), (4096, 2)]
    # a model whose sequences are all short (the hot-switch example's) buckets lower
    assert [b for b, _ in length_groups([16, 17, 32], min_bound=1)] == [16, 32]
    with pytest.raises(InvalidConfig):
        length_groups([16], min_bound=0)


def test_cli_uniform_lengths_are_one_group(tmp_path):
    """``ptcctl suggest --seq-lengths`` on one length: a single group, its
    mesh the single-mesh baseline, no switch and a gain of 1."""
    f = tmp_path / "uniform.txt"
    f.write_text("\n".join(["4096"] * 300))
    r = _ptcctl("suggest", "--model", LLAMA2_7B, "--optimizer", "adam", "--hosts", "h0:8",
                "--global-batch", "512", "--seq", "1024", "--device", "a100-80gb",
                "--recompute", "selective", "--seq-lengths", str(f), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["groups"]) == 1 and out["speedup_vs_single_mesh"] == 1.0


def test_a_switch_costs_what_the_planner_moves_between_gpus():
    q = _query()
    wide, narrow = ParallelConfig(4, 1, 2, HOSTS), ParallelConfig(1, 1, 8, HOSTS)
    secs, moved = switch_seconds(q, wide, narrow)
    # every GPU gathers the 3/4 of the weights (and gradients) it lacks
    weights = sum(t.nbytes for t in q.model.tensors if not t.is_optim)
    assert moved >= 2 * 8 * weights * 3 // 4 * 0.99
    assert secs > 0 and switch_seconds(q, narrow, narrow) == (0.0, 0)
    # FSDP over fsdp x cp (cp_shard=1): trading fsdp for cp keeps every chunk
    # where it is; with cp replicas each GPU needs twice its chunk
    fsdp8 = ParallelConfig(1, 1, 1, HOSTS, 8)
    assert switch_seconds(q, fsdp8, ParallelConfig(1, 1, 1, HOSTS, 4, 2, cp_shard=1)) == (0.0, 0)
    assert switch_seconds(q, fsdp8, ParallelConfig(1, 1, 1, HOSTS, 4, 2))[1] > 0
    # splitting needs nothing new: every GPU holds all of it already
    assert switch_seconds(q, narrow, wide)[1] == 0


def test_hotspa_measurement_within_the_stated_error():
    """HotSPa (SOSP'24): LLaMA-2-7B on 8 GPUs, the same tokens per step of
    1K sequences, tp=8 took 1.40x as long as tp=1. Stated error: 15%."""
    model = _model()
    q = Query(model, HOSTS, 512, 1024, PROFILES["a100-80gb"])
    classes = StateClasses(model)
    tp1 = estimate(q, ParallelConfig(1, 1, 8, HOSTS, zero=1), classes)
    tp8 = estimate(q, ParallelConfig(8, 1, 1, HOSTS), classes)
    assert abs(tp8.step / tp1.step / 1.40 - 1) <= 0.15, tp8.step / tp1.step


def test_cli_json_and_text(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(map(str, _skewed())))
    base = ["suggest", "--model", LLAMA2_7B, "--optimizer", "adam", "--hosts", "h0:8",
            "--global-batch", "512", "--seq", "1024", "--device", "a100-80gb",
            "--recompute", "selective", "--seq-lengths", str(f)]
    r = _ptcctl(*base, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["speedup_vs_single_mesh"] >= 1.0
    g = out["groups"]
    assert len(g) > 1 and {"bound", "config", "degrees", "seconds"} <= set(g[0])
    assert [x["degrees"]["tp"] for x in g] == sorted(x["degrees"]["tp"] for x in g)
    text = _ptcctl(*base)
    assert text.returncode == 0 and "predicted gain" in text.stdout
    assert "switches:" in text.stdout
    bad = tmp_path / "bad.txt"
    bad.write_text("12 x 7")
    r = _ptcctl(*base[:-1], str(bad))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    r = _ptcctl(*base[:-1], str(tmp_path / "missing.txt"))
    assert r.returncode != 0 and "no such file" in r.stderr


def test_the_routing_gives_each_length_its_groups_mesh():
    p = plan_groups(_query(), _skewed())
    r = routing(p)
    assert set(r.configs.values()) == {g.estimate.config for g in p.groups}
    assert r.home in r.configs
    for g in p.groups:
        assert r.configs[r.mesh_for(g.bound)] == g.estimate.config
    assert r.mesh_for(10 ** 6) == r.bounds[-1][1]  # longer than all: the widest mesh
    lengths = _skewed(50)
    routed = r.route(lengths)
    assert sorted(i for ids in routed.values() for i in ids) == list(range(50))


def test_the_hot_switch_takes_its_meshes_from_the_chooser():
    """The live hot switch built from ``ptcctl suggest --seq-lengths``'s
    groups: one mesh per group, no process group needed to build it."""
    pytest.importorskip("torch")
    from ptcfs.client.live.hotswitch import MeshSwitch

    q = _query()
    params = parse_model(LLAMA2_7B, dtype="bf16", optimizer="none")
    sw, r = MeshSwitch.for_lengths(params, q, _skewed(), rank=3)
    assert set(sw.configs) == set(r.configs) and len(sw.workers) == 8 and sw.me == "r3"
    assert {c.tp for c in r.configs.values()} == \
        {g.estimate.config.tp for g in plan_groups(q, _skewed()).groups}
