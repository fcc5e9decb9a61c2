"""Any model on any mesh, on real daemons and mounts: LLaMA with Adam through
FSDP, TP, PP with ZeRO-1 and a lost host; a mixture of experts through expert
parallelism; a model of the user's own from a spec file."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.plan.reshard import cut
from ptcfs.server.testing.localcluster import LocalCluster
from ptcfs.sharding import rank_tensors
from tests.test_cluster import checksums, ptcctl

pytestmark = [pytest.mark.multihost, pytest.mark.fuse, pytest.mark.slow]

#: Sizes that FSDP's chunks do not divide evenly (short and empty last chunks).
LLAMA = "llama:layers=4,hidden=48,heads=4,kv_heads=2,vocab=100,ffn=88,names=hf"
MOE = "moe:layers=2,hidden=48,heads=4,kv_heads=2,vocab=100,ffn=40,experts=4,names=mcore"

SPEC = """\
name = "mine"
layers = 2
names = [
  ["tok.weight", [50, 16], "bf16"],
  ["blocks.0.attn.weight", [48, 16], "bf16"],
  ["blocks.0.out.weight", [16, 16], "bf16"],
  ["blocks.0.scale", [16], "fp32"],
  ["blocks.1.attn.weight", [48, 16], "bf16"],
  ["blocks.1.out.weight", [16, 16], "bf16"],
  ["blocks.1.scale", [16], "fp32"],
  ["head.weight", [50, 16], "bf16"],
]

[[rules]]
match = "tok.weight"
split_dim = 0
stage = "first"

[[rules]]
match = "blocks.*.attn.weight"
split_dim = 0
groups = 3
stage = "layer"

[[rules]]
match = "blocks.*.out.weight"
split_dim = 1
stage = "layer"

[[rules]]
match = "blocks.*.scale"
stage = "layer"

[[rules]]
match = "head.weight"
split_dim = 0
stage = "last"
"""


def check_everywhere(lc: LocalCluster, co: Coordinator, job: str, before: dict[str, str],
                     mounts: list[str]) -> None:
    """Checksums unchanged, every copy present and equal, and every rank's
    files on the mounts equal to its slices of the logical tensors."""
    cf = lc.cluster_file
    after = checksums(cf, job)
    assert {k: after[k] for k in before if k in after} == {k: before[k] for k in after}
    v = json.loads(ptcctl(cf, "verify", job, "--json").stdout)
    assert v["ok"], v["problems"]
    state = co.state(job)
    model = state.model_spec()
    whole = {s.name: co.fetch_tensor(state, s.name) for s in model.tensors_for(state.config.pp)}
    for i, rank in enumerate(range(state.config.world)):
        rdir = lc.mount_dir(mounts[i % len(mounts)]) / job / "ranks" / str(rank)
        for spec, sl in rank_tensors(model, state.config, rank):
            got = np.load(rdir / f"{spec.name}.npy")
            assert got.shape == sl.local_shape(spec.shape), (rank, spec.name)
            np.testing.assert_array_equal(got.view(np.uint8),
                                          cut(spec, sl, whole[spec.name]).view(np.uint8))
    # and the same bytes as ptcctl tensor get, for a sharded tensor and a slice of it
    name = next(s.name for s in model.tensors if s.rule.split_dim == 1)
    out = lc.dir / "get.npy"
    ptcctl(cf, "tensor", "get", job, name, "--slice", "1:7,:", "--out", str(out))
    np.testing.assert_array_equal(np.load(out).view(np.uint8),
                                  whole[name][1:7].view(np.uint8))
    np.testing.assert_array_equal(
        np.load(lc.mount_dir(mounts[0]) / job / "tensors" / f"{name}.npy[1:7,:]").view(np.uint8),
        whole[name][1:7].view(np.uint8))


def created(lc: LocalCluster, job: str, model: str, config: str, hosts: str,
            seed: int) -> tuple[Path, dict[str, str], Coordinator]:
    """Job ``job`` with Adam created on ``lc``: the cluster file, the job's
    checksums and a coordinator."""
    cf = lc.cluster_file
    ptcctl(cf, "job", "create", job, "--model", model, "--optimizer", "adam",
           "--config", config, "--hosts", hosts, "--seed", str(seed))
    return cf, checksums(cf, job), Coordinator(Cluster.load(cf))


def reconfigure(cf: Path, job: str, to: str, hosts: str) -> dict:
    out = json.loads(ptcctl(cf, "reconfigure", job, "--to", to, "--hosts", hosts,
                            "--json").stdout)
    assert out["bytes_cross_host_measured"] == out["bytes_cross_host"]
    return out


def test_llama_with_adam_through_fsdp_tp_pp_zero_and_a_lost_host(local_cluster):
    lc = local_cluster(3, gpus=2, mount=True)
    cf, before, co = created(lc, "l", LLAMA, "fsdp=4", "h0:2,h1:2", 11)
    try:
        check_everywhere(lc, co, "l", before, ["h0", "h2"])
        reconfigure(cf, "l", "tp=2,fsdp=2", "h0:2,h1:2")
        check_everywhere(lc, co, "l", before, ["h1", "h2"])
        reconfigure(cf, "l", "pp=2,dp=2,zero=1", "h0:2,h1:1,h2:1")
        state = co.state("l")
        assert (state.config.pp, state.config.dp, state.config.zero) == (2, 2, 1)
        check_everywhere(lc, co, "l", before, ["h0", "h1", "h2"])
        lc.kill("h1", signal.SIGKILL)
        out = ptcctl(cf, "reconfigure", "l", "--to", "tp=2", "--hosts", "h2:2")
        assert "gave up on lost host(s): h1" in out.stdout
        after = checksums(cf, "l")
        assert after == before
        state = co.state("l")
        whole = {n: co.fetch_tensor(state, n) for n in ("lm_head.weight",
                                                        "optim/exp_avg/lm_head.weight")}
        rdir = lc.mount_dir("h0") / "l" / "ranks" / "1"
        model = state.model_spec()
        for spec, sl in rank_tensors(model, state.config, 1):
            if spec.name in whole:
                np.testing.assert_array_equal(np.load(rdir / f"{spec.name}.npy"),
                                              cut(spec, sl, whole[spec.name]))
    finally:
        co.cluster.close()


def test_llama_into_and_out_of_an_interleaved_pipeline(local_cluster):
    """pp=2 -> pp=2,vpp=2 (stage 0 holds layers 0 and 2, stage 1 layers 1 and
    3) -> the same chunks on one GPU per host -> tp=2: every rank's files
    are its slices of the same tensors."""
    lc = local_cluster(2, gpus=2, mount=True)
    cf, before, co = created(lc, "v", LLAMA, "pp=2,dp=2", "h0:2,h1:2", 5)
    try:
        reconfigure(cf, "v", "pp=2,vpp=2,dp=2", "h0:2,h1:2")
        for rank, held, not_held in ((0, 2, 1), (3, 1, 2)):  # layers 1 and 2 changed stages
            files = {p.name for p in (lc.mount_dir("h0") / "v" / "ranks" / str(rank)).iterdir()}
            assert f"model.layers.{held}.mlp.up_proj.weight.npy" in files
            assert f"model.layers.{not_held}.mlp.up_proj.weight.npy" not in files
        state = co.state("v")
        assert (state.config.pp, state.config.vpp) == (2, 2)
        assert "vpp=2" in ptcctl(cf, "status").stdout
        check_everywhere(lc, co, "v", before, ["h0", "h1"])
        reconfigure(cf, "v", "pp=2,vpp=2,pp_layers=1:1:1:1,dp=1", "h0:1,h1:1")
        check_everywhere(lc, co, "v", before, ["h1", "h0"])
        reconfigure(cf, "v", "tp=2", "h0:1,h1:1")
        check_everywhere(lc, co, "v", before, ["h0", "h1"])
    finally:
        co.cluster.close()


def test_moe_through_expert_parallel_meshes(local_cluster):
    lc = local_cluster(2, gpus=4, mount=True)
    cf, before, co = created(lc, "m", MOE, "fsdp=2,ep=2", "h0:2", 12)
    try:
        check_everywhere(lc, co, "m", before, ["h1"])
        reconfigure(cf, "m", "fsdp=4,ep=4", "h0:2,h1:2")
        check_everywhere(lc, co, "m", before, ["h0", "h1"])
        reconfigure(cf, "m", "tp=2,fsdp=2,ep=2", "h1:4")
        check_everywhere(lc, co, "m", before, ["h0"])
        # expert 3's tensors sit only on the ranks of expert-parallel rank 1
        state = co.state("m")
        held = {r for r in range(state.config.world)
                if any(".local_experts.3." in s.name
                       for s, _ in rank_tensors(state.model_spec(), state.config, r))}
        assert held == {2, 3}  # data ranks 1 (ep_rank 1): ranks 2 and 3 (tp 0 and 1)
    finally:
        co.cluster.close()


def test_a_model_from_a_spec_file(local_cluster, tmp_path):
    lc = local_cluster(2, gpus=2, mount=True)
    cf = lc.cluster_file
    spec = tmp_path / "mine.toml"
    spec.write_text(SPEC)
    ptcctl(cf, "job", "create", "s", "--model-spec", str(spec), "--optimizer", "adam",
           "--config", "fsdp=2", "--hosts", "h0:2", "--seed", "13")
    before = checksums(cf, "s")
    assert "optim/exp_avg/blocks.1.attn.weight" in before
    co = Coordinator(Cluster.load(cf))
    try:
        reconfigure(cf, "s", "tp=2,pp=2", "h0:2,h1:2")
        check_everywhere(lc, co, "s", before, ["h0", "h1"])
        reconfigure(cf, "s", "dp=2,zero=1,fsdp=2", "h1:2,h0:2")
        check_everywhere(lc, co, "s", before, ["h1"])
        # the job carries its whole spec: the mount and status know it without the file
        spec.unlink()
        status = json.loads(ptcctl(cf, "status", "--json").stdout)
        assert "s" in status["jobs"]
    finally:
        co.cluster.close()
