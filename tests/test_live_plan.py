"""The device plan a live change moves on, and where the survivors of a
failed step go on (ptcfs.client.live.mover, ptcfs.client.live.heal): pure
functions of the layouts and the workers' reports."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from ptcfs.client.live.heal import Report, Settle, settle  # noqa: E402
from ptcfs.client.live.mover import device_plan, planned_bytes_in, worker_config  # noqa: E402
from ptcfs.errors import LiveError  # noqa: E402
from ptcfs.model.modelkit import with_optimizer  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from ptcfs.sharding import rank_tensors  # noqa: E402
from ptcfs.types import Host, ParallelConfig  # noqa: E402


def _cfg(tp: int, dp: int, fsdp: int, workers: tuple[str, ...]) -> ParallelConfig:
    return worker_config(ParallelConfig(tp, 1, dp, (Host("any", len(workers)),), fsdp=fsdp),
                         workers)


@pytest.mark.parametrize("old,new,lost", [
    ((2, 1, 2, ("a", "b", "c", "d")), (1, 1, 2, ("a", "b")), ()),          # shrink
    ((1, 1, 2, ("a", "b")), (1, 1, 3, ("a", "b", "e")), ()),               # grow
    ((1, 3, 1, ("a", "b", "e")), (1, 2, 1, ("a", "b")), ("e",)),           # lose, replicas
    ((1, 4, 1, ("a", "b", "c", "d")), (2, 1, 2, ("a", "b", "c", "d")), ()),  # hot switch
])
def test_the_device_plan_gives_each_worker_what_it_lacks_once(old, new, lost):
    model = with_optimizer(parse_model("gpt:layers=2,hidden=64,heads=4,vocab=256"), "adam")
    o, n = _cfg(*old), _cfg(*new)
    p = device_plan(model, o, n, frozenset(lost))
    assert device_plan(model, o, n, frozenset(lost)) is p  # cached: a switch plans once
    specs = {s.name: s for s in model.tensors}
    for w in n.hosts:
        rank = [h.name for h in n.hosts].index(w.name)
        need = sum(specs[s.name].itemsize * _volume(sl.local_shape(s.shape))
                   for s, sl in rank_tensors(model, n, rank))
        into = [t for t in p.transfers if t.dst.host == w.name]
        assert sum(t.nbytes for t in into) == need  # every byte once (no padding here)
        assert all(t.src.host not in lost for t in into)
        if w.name not in [h.name for h in o.hosts]:  # a joiner keeps nothing
            assert planned_bytes_in(p, w.name) == need


F = frozenset


@pytest.mark.parametrize("reports,ways", [
    # nobody got past step 5's agreement: every state is at 4, as it was
    ([("a", 4, "train"), ("b", 4, "agree")], [Settle(4)]),
    ([("a", 4, "report"), ("b", 4, "train")], [Settle(4)]),
    # a got past it and stepped; b's agreement failed with its gradients complete: b steps too
    ([("a", 5, "report"), ("b", 4, "agree")],
     [Settle(5, F({"b"})), Settle(4, no_copy=F({"a"}), steps_lost=1)]),
    # b's optimizer step failed partway: no copy at any step; a's memory is the copy
    ([("a", 5, "train"), ("b", 4, "optimizer")], [Settle(5, no_copy=F({"b"}))]),
    ([("a", 4, "optimizer"), ("b", 4, "agree"), ("c", 5, "report")],
     [Settle(5, F({"b"}), F({"a"})), Settle(4, no_copy=F({"a", "c"}), steps_lost=1)]),
])
def test_the_survivors_settle_where_their_memories_hold_one_step(reports, ways):
    assert settle([Report(*r) for r in reports]) == ways


def test_survivors_two_steps_apart_is_an_error():
    with pytest.raises(LiveError, match="more than one step apart"):
        settle([Report("a", 3), Report("b", 5)])


def _volume(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
