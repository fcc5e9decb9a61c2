"""``ptcctl plan`` run as users run it: a real process, real output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GPT = "gpt:layers=24,hidden=1536,heads=16,vocab=50257"


def ptcctl(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("ptcctl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ptcfs.client.cli"]
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=120)


def test_plan_json_and_shapes():
    r = ptcctl("plan", "--model", GPT, "--from", "tp=2,dp=2", "--from-hosts", "h0:2,h1:2",
               "--to", "tp=4", "--to-hosts", "h1:4", "--shapes", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("bytes_total", "bytes_cross_host", "bytes_min_cross_host",
                "max_host_send_bytes", "transfers", "ranks"):
        assert key in out
    assert out["bytes_cross_host"] == out["bytes_min_cross_host"] == 0  # h1 held a replica
    assert set(out["ranks"]) == {"0", "1", "2", "3"}
    r0 = out["ranks"]["0"]
    assert r0["host"] == "h1"
    assert r0["tensors"]["embedding.word_embeddings.weight"] == [12672, 1536]
    assert r0["tensors"]["encoder.layers.0.self_attention.query_key_value.weight"] == [1152, 1536]
    assert r0["tensors"]["encoder.layers.0.mlp.dense_4h_to_h.weight"] == [1536, 1536]


def test_plan_text_summary_moves_across_hosts():
    r = ptcctl("plan", "--model", GPT, "--optimizer", "adam", "--from", "tp=2,dp=2",
               "--from-hosts", "h0:2,h1:2", "--to", "tp=2,pp=2", "--to-hosts", "h0:2,h2:2")
    assert r.returncode == 0, r.stderr
    assert "bytes per host pair" in r.stdout
    assert "at the lower bound" in r.stdout
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "h1" in lines and "h2" in r.stdout


def test_plan_json_byte_counts_are_consistent():
    r = ptcctl("plan", "--model", "gpt:layers=4,hidden=256,heads=8,vocab=1000", "--from",
               "tp=1,dp=2", "--from-hosts", "a:1,b:1", "--to", "tp=2", "--to-hosts", "c:2",
               "--json")
    out = json.loads(r.stdout)
    assert out["bytes_cross_host"] == sum(p["bytes"] for p in out["pairs"] if p["src"] != p["dst"])
    assert out["max_host_send_bytes"] == max(out["host_send_bytes"].values())
    assert out["bytes_cross_host"] > 0


@pytest.mark.parametrize("args, message", [
    (["--from", "tp=3", "--from-hosts", "h:4", "--to", "tp=1"], "tp=3 does not divide heads=16"),
    (["--from", "tp=2,dp=4", "--from-hosts", "h:4", "--to", "tp=1"], "only 4 GPUs"),
    (["--from", "tp=1", "--from-hosts", "h", "--to", "tp=1"], "expected name:gpus"),
    (["--from", "tp=1,zz=2", "--from-hosts", "h:1", "--to", "tp=1"], "bad degree"),
    (["--from", "tp=2,tp=4", "--from-hosts", "h:8", "--to", "tp=1"], "tp is given twice"),
    (["--from", "fsdp=0", "--from-hosts", "h:8", "--to", "tp=1"], "fsdp=0: every parallel"),
    (["--from", "zero=2", "--from-hosts", "h:8", "--to", "tp=1"], "use zero=0 or zero=1"),
    (["--from", "ep=2,dp=2", "--from-hosts", "h:8", "--to", "tp=1"], "the model has no experts"),
    (["--from", "pp=2,pp_layers=20,3", "--from-hosts", "h:8", "--to", "tp=1"],
     "add up to the model's 24 layers"),
    (["--from", "pp=2,dp=2,fsdp=2,cp=2", "--from-hosts", "h:8", "--to", "tp=1"],
     "pp*dp*fsdp*cp*tp = 2*2*2*2*1 = 16 ranks"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    r = ptcctl("plan", "--model", GPT, *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_bad_model_and_missing_arguments():
    r = ptcctl("plan", "--model", "gpt:layers=2", "--from", "tp=1", "--from-hosts", "h:1",
               "--to", "tp=1")
    assert r.returncode == 2 and "lacks hidden, heads, vocab" in r.stderr
    r = ptcctl("plan", "--model", GPT)
    assert r.returncode == 2 and "required" in r.stderr


MOE = "moe:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,ffn=32,experts=4"


@pytest.mark.parametrize("mesh, message", [
    ("ep=3,dp=3", "ep=3 does not divide the model's 4 experts"),
    ("ep=4,dp=2", "ep=4 must divide dp*fsdp = 2*1 = 2"),
    ("ep=2,dp=2,fsdp=3", "ep=2 must divide fsdp=3 or be a multiple of it"),
    ("tp=4", "tp=4 does not divide kv_heads=2"),
])
def test_bad_expert_and_gqa_meshes(mesh, message):
    r = ptcctl("plan", "--model", MOE, "--from", mesh, "--from-hosts", "h:8", "--to", "tp=1")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_spec_of_a_preset_plans_like_the_preset(tmp_path):
    out = tmp_path / "moe.toml"
    r = ptcctl("spec", "--model", MOE, "--optimizer", "adamw", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "local_experts.3.linear_fc1.weight" in out.read_text()
    args = ["--from", "fsdp=2,ep=2", "--from-hosts", "h0:2", "--to", "tp=2,fsdp=2,ep=2",
            "--to-hosts", "h0:2,h1:2", "--shapes", "--json"]
    by_file = json.loads(ptcctl("plan", "--model-spec", str(out), *args).stdout)
    by_preset = json.loads(ptcctl("plan", "--model", MOE, "--optimizer", "adamw", *args).stdout)
    by_file.pop("plan_seconds")
    by_preset.pop("plan_seconds")
    assert by_file == by_preset
    assert by_file["ranks"]["1"]["tensors"]["optim/exp_avg/decoder.layers.0.mlp.router.weight"] \
        == [2, 64]  # router [4, 64], replicated over tp, fsdp chunk 0 of 2... of rank 1
    r = ptcctl("plan", "--model-spec", str(out), "--optimizer", "adam", *args)
    assert r.returncode == 2 and "lists optimizer state already" in r.stderr
    r = ptcctl("plan", "--model-spec", str(tmp_path / "nope.toml"), *args)
    assert r.returncode == 2 and "nope.toml" in r.stderr and "Traceback" not in r.stderr


def test_global_options_before_the_subcommand(tmp_path):
    """``ptcctl --cluster FILE status`` as kubectl and git users type it."""
    missing = str(tmp_path / "nope.toml")
    for args in (["--cluster", missing, "status"], ["status", "--cluster", missing]):
        r = ptcctl(*args)
        assert r.returncode == 2 and f"cluster file {missing} does not exist" in r.stderr, args
    r = ptcctl("--json", "plan", "--model", GPT, "--from", "tp=2", "--from-hosts", "h:2",
               "--to", "tp=1")
    assert r.returncode == 0 and json.loads(r.stdout)["transfers"] > 0
    r = ptcctl("--cluster", missing, "plan", "--model", GPT, "--from", "tp=2",
               "--from-hosts", "h:2", "--to", "tp=1")
    assert r.returncode == 2 and "ptcctl plan takes no --cluster" in r.stderr
