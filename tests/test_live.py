"""Live changes: real worker processes on gloo change their mesh without
restarting (ptcfs.client.live), against uninterrupted runs of the same
script (the device plan they move on: test_live_plan.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import closing

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests.test_client_elastic import ROOT, TORCHRUN, kill_tree, records  # noqa: E402

LIVE = ROOT / "examples" / "live_llama.py"
HOT = ROOT / "examples" / "hotswitch_llama.py"
TIMEOUT_S = 300


def _launch(tmp, name: str, *args: str, live: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> dict:
    metrics = tmp / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
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


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tokens.py"),
                    str(tmp / "tokens.npy")], check=True)
    return tmp


@pytest.fixture(scope="module")
def reference(tokens):
    """The uninterrupted run: 4 workers, 13 steps; its step records."""
    _launch(tokens, "ref", "--steps", "13", "--hsdp", live=("--workers", "4"))
    return records(tokens / "ref.jsonl")[0]


def _follows(got: dict[int, dict], ref: dict[int, dict], steps: int, first: int = 1) -> None:
    assert sorted(got) == list(range(first, steps + 1)), sorted(got)
    for s in got:
        assert got[s]["samples"] == ref[s]["samples"], f"step {s} saw other samples"
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-4 * abs(ref[s]["loss"]), s


@pytest.mark.slow
def test_live_changes_keep_the_workers_and_follow_the_curve(tokens, reference):
    tmp, ref = tokens, reference
    steps = ("--steps", "11", "--hsdp")
    out = _launch(tmp, "live", *steps, "--die-at", "s0:9",
                  live=("--workers", "4", "--standby", "1", "--change", "3:2",
                        "--change", "6:3"))
    got, events = records(tmp / "live.jsonl")
    # 4 -> 2 -> 3 workers, then s0 dies at the start of step 9 -> 2
    gens = out["generations"]
    assert [(g["workers"], g["lost"]) for g in gens] == [
        (["w0", "w1", "w2", "w3"], []), (["w0", "w1"], []), (["w0", "w1", "s0"], []),
        (["w0", "w1"], ["s0"])]
    assert out["lost"] == ["s0"] and out["restarted"] == 0
    _follows(got, ref, 11)
    assert [got[s]["world"] for s in (3, 4, 7, 8, 9)] == [4, 2, 3, 3, 2]
    # survivors kept their process; each received exactly what the plan gave it
    pids: dict[str, set[int]] = {}
    for e in events:
        pids.setdefault(e["worker"], set()).add(e["pid"])
        assert e["bytes_received"] == e["bytes_planned_in"], e
    assert all(len(v) == 1 for v in pids.values()), pids
    joined = [e for e in events if e["worker"] == "s0" and e["event"] == "change"]
    assert joined and joined[0]["bytes_received"] > 0 and joined[0]["bytes_kept"] == 0
    # the standby built the module (on a mesh of itself) while it waited; w0 never waited
    assert joined[0]["prebuilt_s"] > 0
    assert {e["prebuilt_s"] for e in events if e["worker"] == "w0"} == {0}
    # the loss: the survivors go on from the step they were at (0 steps lost)
    loss = [e for e in events if e["event"] == "loss"]
    assert {e["worker"] for e in loss} == {"w0", "w1"} and {e["step"] for e in loss} == {8}
    assert {e["steps_lost"] for e in loss} == {0}


@pytest.mark.slow
def test_a_death_after_the_agreement_is_healed_from_the_replicas(tokens, reference):
    """w2 dies after step 4's agreement, as its optimizer step starts; w1's
    optimizer step of step 4 fails (as one whose own collective met the dead
    peer), leaving w1 between steps 3 and 4; w0 took step 4. The survivors
    go on at step 4 from w0's replica, w1 rebuilt from it, no step lost."""
    tmp = tokens
    out = _launch(tmp, "heal", "--steps", "6", "--hsdp", "--die-at", "w2:4:optimizer",
                  "--fail-optimizer", "w1:4", live=("--workers", "3"))
    got, events = records(tmp / "heal.jsonl")
    assert [(g["workers"], g["lost"]) for g in out["generations"]] == [
        (["w0", "w1", "w2"], []), (["w0", "w1"], ["w2"])]
    assert out["lost"] == ["w2"] and out["restarted"] == 0
    _follows(got, reference, 6)
    pids: dict[str, set[int]] = {}
    for e in events:
        pids.setdefault(e["worker"], set()).add(e["pid"])
        assert e["bytes_received"] == e["bytes_planned_in"], e
    assert all(len(v) == 1 for v in pids.values()) and set(pids) >= {"w0", "w1"}, pids
    loss = {e["worker"]: e for e in events if e["event"] == "loss"}
    assert sorted(loss) == ["w0", "w1"]
    assert {e["step"] for e in loss.values()} == {4}
    assert {e["steps_lost"] for e in loss.values()} == {0}
    assert loss["w0"]["bytes_received"] == 0 and loss["w1"]["bytes_received"] > 0


@pytest.mark.slow
def test_a_survivor_still_at_the_agreement_rolls_forward(tokens, reference):
    """w2 dies after step 4's agreement, as its optimizer step starts; w1's
    agreement fails once it returned (as one whose all-reduce met the dead
    peer), leaving w1 at the agreement with its gradients complete; w0 got
    past it and took step 4. The heal's roll-forward case: w1 takes step 4's
    optimizer step at the change, the job goes on at step 4 from both
    memories, no step lost, no byte moved."""
    tmp = tokens
    out = _launch(tmp, "roll", "--steps", "6", "--hsdp", "--die-at", "w2:4:optimizer",
                  "--fail-agreement", "w1:4", live=("--workers", "3"))
    got, events = records(tmp / "roll.jsonl")
    assert [(g["workers"], g["lost"]) for g in out["generations"]] == [
        (["w0", "w1", "w2"], []), (["w0", "w1"], ["w2"])]
    assert out["lost"] == ["w2"] and out["restarted"] == 0
    _follows(got, reference, 6)
    loss = {e["worker"]: e for e in events if e["event"] == "loss"}
    assert sorted(loss) == ["w0", "w1"]
    assert {e["step"] for e in loss.values()} == {4}
    assert {e["steps_lost"] for e in loss.values()} == {0}
    assert [e["rolled_forward"] for e in loss.values()] == [["w1"], ["w1"]]
    assert all(e["bytes_received"] == e["bytes_planned_in"] == 0 for e in loss.values())


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
    # the meshes are the chooser's: short sequences on tp=1, long ones (home) on tp=2
    meshes, routes, home = hot[1]["meshes"], hot[1]["routes"], hot[1]["home"]
    assert routes[1] == home and routes[0] != home
    assert meshes[routes[0]].startswith("tp=1,") and meshes[home].startswith("tp=2,")
    for s in single:
        assert abs(hot[s]["loss"] - single[s]["loss"]) <= 1e-4 * abs(single[s]["loss"]), s
        assert hot[s]["switch_s"] > 0 and single[s]["switch_s"] == 0
    assert single[5]["loss"] < single[1]["loss"]


def _committed(cluster_file, job: str = "live") -> dict[int, tuple[int, str, dict[str, str]]]:
    """Every committed version of ``job``: (step, configuration, checksums);
    a version still open for saving (a save neither committed nor dropped)
    fails the test."""
    from ptcfs.client.control.conn import Cluster
    from ptcfs.client.control.coordinator import Coordinator
    from ptcfs.jobstate import JobState

    with closing(Cluster.load(cluster_file)) as c:
        co = Coordinator(c)
        answers, _ = c.call_all("versions", job=job)
        versions = [v for vs in answers.values() for v in vs]
        assert all(v["state"] == "committed" for v in versions), versions
        states = {v["version"]: JobState.from_meta(v["meta"]) for v in versions}
        return {n: (st.step, st.describe(), co.checksums(st)) for n, st in states.items()}


def _sums(path) -> dict[int, dict[str, str]]:
    """The checksums the workers wrote, by step (the last line of a step wins)."""
    return {r["step"]: r["sums"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_a_live_job_kept_in_the_stores_commits_each_change_behind_it(tokens, reference):
    """A live job with ``--job``: 4 -> 2 -> 3 workers, a worker lost, saves
    every 2 steps; every version the stores committed holds what the workers
    held at its step, each change's copy began only after the first step on
    the new mesh, and a new launch on another mesh (4 workers, tp=2) resumes
    the job from the stores and follows the uninterrupted run."""
    from tests.daemons import running

    tmp = tokens
    with running(tmp / "cluster", 1, gpus=4) as lc:
        env = {"PTC_CLUSTER": str(lc.cluster_file), "PTC_KEEP_VERSIONS": "50"}
        out = _launch(tmp, "kept", "--steps", "11", "--hsdp", "--die-at", "s0:9",
                      "--save-every", "2", "--checksums", str(tmp / "kept-sums.jsonl"),
                      live=("--workers", "4", "--standby", "1", "--change", "3:2",
                            "--change", "6:3", "--job", "live"), env=env)
        got, events = records(tmp / "kept.jsonl")
        _follows(got, reference, 11)
        assert out["restarted"] == 0 and out["lost"] == ["s0"]
        assert out["job"] == {"name": "live", "version": out["job"]["version"], "step": 11,
                              "config": "tp=1,pp=1,dp=2 on h0:2"}
        sums = _sums(tmp / "kept-sums.jsonl")
        checksum = subprocess.run([sys.executable, "-m", "ptcfs.client.cli", "--cluster",
                                   str(lc.cluster_file), "checksum", "live", "--json"],
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True,
                                  capture_output=True, text=True)
        assert json.loads(checksum.stdout) == sums[11]  # ptcctl's view: the workers' last step
        versions = _committed(lc.cluster_file)
        assert versions[out["job"]["version"]][2] == sums[11]
        # every version committed holds what the workers held at its step
        for n, (step, _, digests) in versions.items():
            if step:
                assert digests == sums[step], f"version {n} (step {step})"
        # each change (shrink, grow, loss) was committed as the step after it, on its mesh,
        # its copy begun after the first step on the new mesh had ended
        changes = [e for e in events if e["event"] in ("change", "loss")]
        assert {(e["step"], e["world"]) for e in changes} == {(3, 2), (6, 3), (8, 2)}
        for e in changes:
            assert e["commit_step"] == e["step"] + 1, e
            assert 0 < e["first_step_at"] <= e["commit_began"], e
        by_step = {step: cfg for step, cfg, _ in versions.values()}
        assert by_step[4] == "tp=1,pp=1,dp=2 on h0:2" and by_step[7] == "tp=1,pp=1,dp=3 on h0:3"
        assert by_step[9] == "tp=1,pp=1,dp=2 on h0:2"

        # every worker gone: a new launch on another mesh (4 workers, tp=2, from dp=2 on
        # 2) resumes the job at step 11: its state (the losses after it), and the samples
        again = _launch(tmp, "again", "--steps", "13", "--hsdp", "--checksums",
                        str(tmp / "again-sums.jsonl"),
                        live=("--workers", "4", "--job", "live"), env=env)
        assert again["generations"][0]["step"] == 11
        _follows(records(tmp / "again.jsonl")[0], reference, 13, first=12)
        assert again["job"]["step"] == 13 and again["job"]["config"] == \
            "tp=2,pp=1,dp=2 on h0:4"
        assert _committed(lc.cluster_file)[again["job"]["version"]][2] == \
            _sums(tmp / "again-sums.jsonl")[13]


@pytest.mark.slow
def test_a_change_goes_on_while_a_save_is_in_flight(tokens, reference):
    """w1's copy of the save of step 4 is held until it trains on a later
    generation; the change to 2 workers at step 4 comes with that save in
    flight. The change does not wait for it (were it to, the hold would
    never be released and the save of step 4 would fail): step 4 is
    committed under the 4 workers' layout while the 2 go on, then each
    change's own copy under its layout; a worker that joins at the next
    change begins nothing before the save in flight has ended. No version
    is torn or lost."""
    from tests.daemons import running

    tmp = tokens
    with running(tmp / "cluster-held", 1, gpus=4) as lc:
        env = {"PTC_CLUSTER": str(lc.cluster_file), "PTC_KEEP_VERSIONS": "50"}
        out = _launch(tmp, "held", "--steps", "7", "--hsdp", "--save-every", "2",
                      "--hold-save", "w1:4", "--checksums", str(tmp / "held-sums.jsonl"),
                      live=("--workers", "4", "--standby", "1", "--change", "4:2",
                            "--change", "5:3", "--job", "held"), env=env)
        got, events = records(tmp / "held.jsonl")
        _follows(got, reference, 7)
        assert out["restarted"] == 0 and out["job"]["step"] == 7
        sums = _sums(tmp / "held-sums.jsonl")
        versions = _committed(lc.cluster_file, "held")
        for n, (step, _, digests) in versions.items():
            if step:
                assert digests == sums[step], f"version {n} (step {step})"
        by_step = {step: cfg for step, cfg, _ in versions.values()}
        changes = sorted((e["step"], e["world"], e["commit_step"]) for e in events
                         if e["event"] == "change")
        assert changes[0] == (4, 2, 5) and changes[-1][1:] == (3, changes[-1][0] + 1)
        assert by_step[4] == "tp=2,pp=1,dp=2 on h0:4"  # the held save, on its own layout
        assert by_step[5] == "tp=1,pp=1,dp=2 on h0:2"
        assert by_step[changes[-1][2]] == "tp=1,pp=1,dp=3 on h0:3"
        assert by_step[7] == "tp=1,pp=1,dp=3 on h0:3"


@pytest.mark.slow
def test_a_worker_lost_during_a_save_costs_no_step_and_no_version(tokens, reference):
    """w0 dies as the save of step 4 begins, the others' saves of it begun
    and its part never put: w0 is the save's committer and the only worker
    that puts (the others hold replicas), so the save is in flight when the
    worker is lost and can never commit. The survivors give it up and go on
    at step 4 with no step lost, the last committed version (step 2) stays
    whole, the loss's copy (step 5) and the later saves commit, and no
    version is left open."""
    from tests.daemons import running

    tmp = tokens
    with running(tmp / "cluster-dies", 1, gpus=4) as lc:
        env = {"PTC_CLUSTER": str(lc.cluster_file), "PTC_KEEP_VERSIONS": "50"}
        out = _launch(tmp, "dies", "--steps", "7", "--hsdp", "--save-every", "2",
                      "--die-at", "w0:4:save", "--checksums", str(tmp / "dies-sums.jsonl"),
                      live=("--workers", "3", "--job", "dies"), env=env)
        got, events = records(tmp / "dies.jsonl")
        _follows(got, reference, 7)
        assert out["lost"] == ["w0"] and out["restarted"] == 0
        loss = [e for e in events if e["event"] == "loss"]
        assert sorted(e["worker"] for e in loss) == ["w1", "w2"]
        assert {(e["step"], e["steps_lost"], e["commit_step"]) for e in loss} == {(4, 0, 5)}
        sums = _sums(tmp / "dies-sums.jsonl")
        versions = _committed(lc.cluster_file, "dies")
        for n, (step, _, digests) in versions.items():
            if step:
                assert digests == sums[step], f"version {n} (step {step})"
        by_step = {step: cfg for step, cfg, _ in versions.values()}
        assert sorted(by_step) == [0, 2, 5, 6, 7]  # step 4's save given up, none torn
        assert by_step[2] == "tp=1,pp=1,dp=3 on h0:3" and by_step[5] == "tp=1,pp=1,dp=2 on h0:2"
        assert out["job"]["step"] == 7
