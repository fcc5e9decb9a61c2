"""Live changes: real worker processes on gloo change their mesh without
restarting (ptcfs.client.live), against uninterrupted runs of the same
script; and the device plan they move on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from ptcfs.client.live.mover import device_plan, planned_bytes_in, worker_config  # noqa: E402
from ptcfs.model.modelkit import with_optimizer  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from ptcfs.sharding import rank_tensors  # noqa: E402
from ptcfs.types import Host, ParallelConfig  # noqa: E402
from tests.test_client_elastic import ROOT, TORCHRUN, kill_tree, records  # noqa: E402

LIVE = ROOT / "examples" / "live_llama.py"
HOT = ROOT / "examples" / "hotswitch_llama.py"
TIMEOUT_S = 300


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


def _volume(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _launch(tmp, name: str, *args: str, live: tuple[str, ...] = ()) -> dict:
    metrics = tmp / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "ptcfs.client.live", "--json", "--logs", str(tmp / name),
           *live, "--", sys.executable, str(LIVE), "--data", str(tmp / "tokens.npy"),
           "--metrics", str(metrics), *args]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    finally:
        if p.poll() is None:
            kill_tree(p)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out)


@pytest.fixture
def tokens(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tokens.py"),
                    str(tmp_path / "tokens.npy")], check=True)
    return tmp_path


@pytest.mark.slow
def test_live_changes_keep_the_workers_and_follow_the_curve(tokens):
    tmp = tokens
    steps = ("--steps", "11", "--hsdp")
    _launch(tmp, "ref", *steps, live=("--workers", "4"))
    out = _launch(tmp, "live", *steps, "--die-at", "s0:9",
                  live=("--workers", "4", "--standby", "1", "--change", "3:2",
                        "--change", "6:3"))
    ref, _ = records(tmp / "ref.jsonl")
    got, events = records(tmp / "live.jsonl")
    # 4 -> 2 -> 3 workers, then s0 dies at the start of step 9 -> 2
    gens = out["generations"]
    assert [(g["workers"], g["lost"]) for g in gens] == [
        (["w0", "w1", "w2", "w3"], []), (["w0", "w1"], []), (["w0", "w1", "s0"], []),
        (["w0", "w1"], ["s0"])]
    assert out["lost"] == ["s0"] and out["restarted"] == 0
    assert sorted(got) == sorted(ref) == list(range(1, 12))
    for s in ref:
        assert got[s]["samples"] == ref[s]["samples"], f"step {s} saw other samples"
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-4 * abs(ref[s]["loss"]), s
    assert [got[s]["world"] for s in (3, 4, 7, 8, 9)] == [4, 2, 3, 3, 2]
    # survivors kept their process; each received exactly what the plan gave it
    pids: dict[str, set[int]] = {}
    for e in events:
        pids.setdefault(e["worker"], set()).add(e["pid"])
        assert e["bytes_received"] == e["bytes_planned_in"], e
    assert all(len(v) == 1 for v in pids.values()), pids
    joined = [e for e in events if e["worker"] == "s0" and e["event"] == "change"]
    assert joined and joined[0]["bytes_received"] > 0 and joined[0]["bytes_kept"] == 0
    # the loss: the survivors go on from the step they were at (0 steps lost)
    loss = [e for e in events if e["event"] == "loss"]
    assert {e["worker"] for e in loss} == {"w0", "w1"} and {e["step"] for e in loss} == {8}


@pytest.mark.slow
def test_a_hot_switch_every_step_follows_a_single_mesh(tokens):
    tmp = tokens

    def run(name: str, *extra: str) -> dict[int, dict]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        p = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=4", str(HOT),
                              "--data", str(tmp / "tokens.npy"), "--steps", "5",
                              "--metrics", str(tmp / f"{name}.jsonl"), *extra],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        finally:
            if p.poll() is None:
                kill_tree(p)
        assert p.returncode == 0, out[-3000:]
        return records(tmp / f"{name}.jsonl")[0]

    single, hot = run("single", "--single"), run("hot")
    assert sorted(hot) == sorted(single) == [1, 2, 3, 4, 5]
    for s in single:
        assert abs(hot[s]["loss"] - single[s]["loss"]) <= 1e-4 * abs(single[s]["loss"]), s
        assert hot[s]["switch_s"] > 0 and single[s]["switch_s"] == 0
    assert single[5]["loss"] < single[1]["loss"]
