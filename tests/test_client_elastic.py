"""End to end: the example GPT trained with torchrun (gloo, real processes) on
real daemons, its parallelism changed between runs and by losing an elastic
agent, against an uninterrupted run of the same global batch."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ptcfs.client.torch.elastic import choose_config, hosts_of_ranks, pick_config  # noqa: E402
from ptcfs.errors import InvalidConfig  # noqa: E402
from ptcfs.jobstate import JobState  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from ptcfs.server.testing.localcluster import LocalCluster, free_port  # noqa: E402
from ptcfs.types import Host, ParallelConfig  # noqa: E402
from tests.conftest import _fuse  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_gpt.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS = 30
RUN_TIMEOUT_S = 240


def test_the_rule_from_world_size_to_configuration():
    model = parse_model("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32")
    h = (Host("h0", 4),)
    assert (choose_config(4, h, model, tp=2).tp, choose_config(4, h, model, tp=2).dp) == (2, 2)
    c2 = choose_config(2, (Host("h0", 2),), model, tp=2)
    assert (c2.tp, c2.dp) == (2, 1)
    c3 = choose_config(3, (Host("h0", 3),), model, tp=2, batch=12)
    assert (c3.tp, c3.pp, c3.dp) == (1, 1, 3)
    # tensor parallelism never spans hosts; pp when asked for and possible
    c = choose_config(4, (Host("h0", 1), Host("h1", 3)), model, tp=2, pp=2)
    assert (c.tp, c.pp, c.dp) == (1, 2, 2)
    with pytest.raises(InvalidConfig, match="dp does not divide batch=5"):
        choose_config(2, (Host("h0", 2),), model, tp=1, batch=5)
    # a script of interleaved stages keeps them wherever the mesh has a pipeline that
    # its layers fill (4 layers: pp=2 takes vpp=2, pp=4 cannot), whatever the policy
    deep = parse_model("gpt:layers=4,hidden=64,heads=4,vocab=256,seq=32")
    two = (Host("h0", 1), Host("h1", 1))
    c = choose_config(2, two, deep, pp=2, vpp=2)
    assert (c.pp, c.vpp) == (2, 2)
    assert choose_config(4, (Host("h0", 4),), deep, pp=4, vpp=2).vpp == 1
    assert choose_config(2, two, deep, vpp=2).vpp == 1  # no pipeline: nothing to interleave
    for policy in ("fastest-that-fits", "least-moved"):
        c = pick_config(2, two, deep, policy=policy, pp=2, vpp=2, degrees=("pp",))
        assert (c.pp, c.vpp) == (2, 2), policy
    with pytest.raises(InvalidConfig, match="vpp must be at least 1"):
        pick_config(2, two, deep, vpp=0)
    assert hosts_of_ranks(["h1", "h1", "h0"]) == (Host("h1", 2), Host("h0", 1))
    with pytest.raises(InvalidConfig, match="not contiguous"):
        hosts_of_ranks(["h0", "h1", "h0"])


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun puts its workers in
    sessions of their own, so a process group is not enough)."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(p))
    out = [pid]
    for q in out:
        out.extend(children.get(q, []))
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    for p in descendants(proc.pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Runs:
    """torchrun launches against one cluster; every process is killed at the end."""

    def __init__(self, cluster_file: Path, data: Path, tmp: Path):
        self.cf, self.tmp = cluster_file, tmp
        self.data = ["--data", str(data)]
        self.procs: list[subprocess.Popen] = []

    def start(self, job: str, metrics: Path, host: str, torchrun: list[str],
              *extra: str, policy: str | None = "fixed-rule") -> subprocess.Popen:
        """``policy``: the tests that name configurations use the fixed rule;
        None runs the example with its default."""
        # torchrun's agents otherwise keep one store for the workers across
        # rounds, and a restarted worker may read a dead peer's address from it
        env = dict(os.environ, PTC_CLUSTER=str(self.cf), PTC_HOST=host, OMP_NUM_THREADS="1",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        log = open(self.tmp / f"{job}-{host}-{len(self.procs)}.log", "w")  # noqa: SIM115
        data = self.data if "--data-view" not in extra else []
        pol = ["--policy", policy] if policy else []
        p = subprocess.Popen([TORCHRUN, *torchrun, str(TRAIN), "--job", job, *data,
                              "--steps", str(STEPS), "--metrics", str(metrics), *pol,
                              *extra],
                             env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, job: str, metrics: Path, workers: int, *extra: str,
            policy: str | None = "fixed-rule") -> None:
        p = self.start(job, metrics, "h0", ["--standalone", f"--nproc-per-node={workers}"],
                       *extra, policy=policy)
        code = p.wait(timeout=RUN_TIMEOUT_S)
        assert code == 0, self.tail(job)

    def tail(self, job: str) -> str:
        return "\n".join(f.read_text()[-3000:] for f in sorted(self.tmp.glob(f"{job}-*.log")))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p)


def records(path: Path) -> tuple[dict[int, dict], list[dict]]:
    """The last record of each step, and the events, of a metrics file."""
    steps: dict[int, dict] = {}
    events: list[dict] = []
    if not path.exists():
        return steps, events
    for line in path.read_text().splitlines():
        if not line.endswith("}"):
            continue  # a line still being written
        d = json.loads(line)
        if "event" in d:
            events.append(d)
        else:
            steps[d["step"]] = d
    return steps, events


def same_curve(ref: dict[int, dict], got: dict[int, dict]) -> float:
    """Max relative loss difference; the samples of every step must be equal."""
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        assert got[s]["samples"] == ref[s]["samples"], f"step {s} saw other samples"
    return max(abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in ref)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    data = tmp / "tokens.npy"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tokens.py"), str(data)],
                   check=True)
    lc = LocalCluster(tmp / "cluster")
    runs = Runs(lc.cluster_file, data, tmp)
    try:
        lc.up(2, gpus=4, mount=_fuse() is None)  # a mount per host where FUSE works
        runs.run("ref", tmp / "ref.jsonl", 4)
        ref, _ = records(tmp / "ref.jsonl")
        yield runs, ref, tmp, lc
    finally:
        runs.close()
        lc.down()


pytestmark = [pytest.mark.multihost, pytest.mark.slow]


@pytest.mark.parametrize("data", [pytest.param("file", marks=pytest.mark.extended),
                                  pytest.param("view", marks=pytest.mark.fuse)])
def test_four_workers_then_two_then_three_follow_the_uninterrupted_curve(setup, data):
    """``view``: the workers read their rank's view of the ingested dataset
    through their host's /ptc mount; ``file``: the rows from the file, dealt
    by the dataset library. Either way the samples are those of the
    uninterrupted run."""
    runs, ref, tmp, lc = setup
    job = f"job-{data}"
    m = tmp / f"{job}.jsonl"
    extra: list[str] = []
    if data == "view":
        r = subprocess.run([str(Path(sys.executable).with_name("ptcctl")), "data", "ingest", job,
                            runs.data[1], "--format", "npy", "--global-batch", "12", "--seed",
                            "1", "--dp", "2"], env=dict(os.environ, PTC_CLUSTER=str(runs.cf)),
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        extra = ["--data-view", str(lc.dir / "mnt" / "{host}")]
    runs.run(job, m, 4, "--exit-after", "12", *extra)  # commits 5 and 10, dies after 12
    runs.run(job, m, 2, "--exit-after", "22", *extra)
    runs.run(job, m, 3, *extra)
    got, events = records(m)
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["config"]) for e in resumes] == [
        (0, "tp=2,pp=1,dp=2 on h0:4"), (10, "tp=2,pp=1,dp=1 on h0:2"),
        (20, "tp=1,pp=1,dp=3 on h0:3")]
    assert [e["reconfigured"] for e in resumes] == [False, True, True]
    assert same_curve(ref, got) <= 1e-4


@pytest.mark.extended
def test_the_example_with_its_default_policy_follows_the_uninterrupted_curve(setup):
    """No --policy: the example picks each mesh with the default cost policy
    (fastest-that-fits), on 4 workers, then 2 on the other host, then 3."""
    runs, ref, tmp, _ = setup
    m = tmp / "default.jsonl"
    runs.run("default", m, 4, "--exit-after", "12", policy=None)
    p = runs.start("default", m, "h1", ["--standalone", "--nproc-per-node=2"],
                   "--exit-after", "22", policy=None)
    assert p.wait(timeout=RUN_TIMEOUT_S) == 0, runs.tail("default")
    runs.run("default", m, 3, policy=None)
    spec = importlib.util.spec_from_file_location("train_gpt", TRAIN)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse(["--job", "default", "--data", "x.npy"])
    assert args.policy == "fastest-that-fits"
    got, events = records(m)
    resumes = [e for e in events if e["event"] == "resume"]
    # the job the example makes: fp32 with Adam
    model = JobState("default", 1, args.model, "fp32", "adam",
                     ParallelConfig(1, 1, 1, (Host("h0", 4),)), 0).model_spec()
    want, old = [], None
    for world, host in ((4, "h0"), (2, "h1"), (3, "h0")):
        old = pick_config(world, (Host(host, world),), model, policy=args.policy, tp=args.tp,
                          pp=args.pp, batch=args.batch, device=args.gpu, old=old)
        want.append(f"tp={old.tp},pp={old.pp},dp={old.dp} on {host}:{world}")
    assert [(e["step"], e["config"]) for e in resumes] == list(zip([0, 10, 20], want))
    assert [e["reconfigured"] for e in resumes] == [False, True, True]
    assert same_curve(ref, got) <= 1e-4


def test_losing_an_elastic_agent_continues_on_the_survivor(setup):
    runs, ref, tmp, _ = setup
    m = tmp / "agents.jsonl"
    port = free_port()
    common = ["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=agents", "--max-restarts=3",
              "--monitor-interval=0.2"]
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
    a = runs.start("agents", m, "h0", [*common, f"--rdzv-conf=is_host=1,{conf}"])
    b = runs.start("agents", m, "h1", [*common, f"--rdzv-conf=is_host=0,{conf}"])
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not any(s >= 8 for s in records(m)[0]):  # a commit at 5 is behind us
        assert a.poll() is None and b.poll() is None, runs.tail("agents")
        assert time.monotonic() < deadline, runs.tail("agents")
        time.sleep(0.05)
    kill_tree(b)  # the agent and its workers: the host is gone
    killed_at = time.time()
    assert a.wait(timeout=RUN_TIMEOUT_S) == 0, runs.tail("agents")
    got, events = records(m)
    saves = [e for e in events if e["event"] == "save" and e["time"] < killed_at]
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes[0]["config"] == "tp=2,pp=1,dp=2 on h0:2,h1:2"
    after = [e for e in resumes if e["time"] > killed_at]
    assert after and after[0]["config"] == "tp=2,pp=1,dp=1 on h0:2"
    # only the steps after the last save lost: that save's step, or the one before it
    # when the kill came while its commit was still in the background
    assert after[0]["step"] in (saves[-1]["step"], saves[-1]["committed"])
    assert same_curve(ref, got) <= 1e-4


def test_pipeline_stages_come_and_go_on_the_same_curve(setup):
    """tp=2,pp=2 on 4 workers → tp=1,pp=2 on 2 (other host) → tp=1,pp=1,dp=3:
    the output layer's own copy of the embedding appears and goes, and the
    losses stay on the tp=2,dp=2 curve."""
    runs, ref, tmp, _ = setup
    m = tmp / "pipeline.jsonl"
    runs.run("pipeline", m, 4, "--pp", "2", "--exit-after", "12")
    p = runs.start("pipeline", m, "h1", ["--standalone", "--nproc-per-node=2"], "--tp", "1",
                   "--pp", "2", "--exit-after", "22")
    assert p.wait(timeout=RUN_TIMEOUT_S) == 0, runs.tail("pipeline")
    runs.run("pipeline", m, 3, "--pp", "2")
    got, events = records(m)
    assert [(e["step"], e["config"]) for e in events if e["event"] == "resume"] == [
        (0, "tp=2,pp=2,dp=1 on h0:4"), (10, "tp=1,pp=2,dp=1 on h1:2"),
        (20, "tp=1,pp=1,dp=3 on h0:3")]
    assert same_curve(ref, got) <= 1e-4
