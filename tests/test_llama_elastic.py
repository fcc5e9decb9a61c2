"""End to end: the example LLaMA (FSDP2 + tensor parallelism on a DeviceMesh)
trained with torchrun on real daemons, 4 workers (fsdp=2,tp=2) → 2
(fsdp=2) → 3 (fsdp=3), against an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from tests.test_client_elastic import ROOT, TORCHRUN, kill_tree, records  # noqa: E402

TRAIN = ROOT / "examples" / "train_llama.py"
STEPS = 10
TIMEOUT_S = 240

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_four_then_two_then_three_workers_follow_the_curve(local_cluster, tmp_path):
    lc = local_cluster(2, gpus=4)
    data = tmp_path / "tokens.npy"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tokens.py"), str(data)],
                   check=True)

    def run(job: str, workers: int, host: str, *extra: str) -> None:
        env = dict(os.environ, PTC_CLUSTER=str(lc.cluster_file), PTC_HOST=host,
                   OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        log = tmp_path / f"{job}-{workers}.log"
        with open(log, "w") as out:
            p = subprocess.Popen([TORCHRUN, "--standalone", f"--nproc-per-node={workers}",
                                  str(TRAIN), "--job", job, "--data", str(data), "--steps",
                                  str(STEPS), "--save-every", "3", "--metrics",
                                  str(tmp_path / f"{job}.jsonl"), *extra],
                                 env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                code = p.wait(timeout=TIMEOUT_S)
            finally:
                if p.poll() is None:
                    kill_tree(p)
        assert code == 0, log.read_text()[-3000:]

    run("ref", 4, "h0")
    run("el", 4, "h0", "--exit-after", "4")  # commits 3, dies after 4
    run("el", 2, "h1", "--exit-after", "7")
    run("el", 3, "h0")
    ref, _ = records(tmp_path / "ref.jsonl")
    got, events = records(tmp_path / "el.jsonl")
    assert [(e["step"], e["config"]) for e in events if e["event"] == "resume"] == [
        (0, "tp=2,pp=1,dp=1,fsdp=2 on h0:4"), (3, "tp=1,pp=1,dp=1,fsdp=2 on h1:2"),
        (6, "tp=1,pp=1,dp=1,fsdp=3 on h0:3")]
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        assert got[s]["samples"] == ref[s]["samples"], f"step {s} saw other samples"
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-5 * abs(ref[s]["loss"]), s
    assert ref[STEPS]["loss"] < ref[1]["loss"]
