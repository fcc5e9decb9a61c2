"""The distributed optimizer's bucket-space state (``dp_reshardable``,
Megatron-LM's default) in torch_dist checkpoints written by megatron-core's
own DistributedOptimizer on gloo ranks (tests/mcore_distopt.py): imported
per parameter, it is the state the same training saves in the model-space
format (``fully_reshardable``), and a buffer read in the wrong order is
refused."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install 'ptcfs[mcore]')")

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.formats.common import from_numpy  # noqa: E402
from ptcfs.client.formats.dcp_box import read_metadata  # noqa: E402
from ptcfs.client.formats.mcore import (  # noqa: E402
    iteration_dir,
    read_mcore,
    record_args,
    recorded_args,
)
from ptcfs.client.formats.mcore_distopt import bucket_places, read_dp_reshardable  # noqa: E402
from ptcfs.errors import CheckpointError  # noqa: E402
from ptcfs.model.optgroups import recorded  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from tests.daemons import running  # noqa: E402
from tests.dtensor_gang import gang  # noqa: E402
from tests.mcore_distopt import ITERATION, PRESET, load_and_dump, train_and_save  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402


def test_parameters_fill_buckets_from_aligned_starts():
    # starts at multiples of 64 from the bucket's start; a bucket ends with
    # the parameter that reaches its length, and the next starts at 0
    assert bucket_places([10, 100, 5], [228]) is None  # 5 ends at 197, not 228
    assert bucket_places([10, 100, 5], [197]) == [(0, 0), (0, 64), (0, 192)]
    assert bucket_places([10, 100, 5], [164, 5]) == [(0, 0), (0, 64), (1, 0)]
    assert bucket_places([10, 100], [10, 100]) == [(0, 0), (1, 0)]
    assert bucket_places([10, 100], [10, 100, 7]) is None  # a bucket left over
    assert bucket_places([10, 100], [50, 60]) is None  # 100 does not fit in what is left


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One step of the same training on tp=2, dp=2 saved twice by megatron-core:
    bucket space with buckets of 3000 elements, and model space."""
    root = tmp_path_factory.mktemp("mcore-distopt")
    for name, sharding, bucket in (("dpr", "dp_reshardable", 3000),
                                   ("full", "fully_reshardable", None)):
        gang(train_and_save, 4, root, str(root / name), 2, sharding, bucket, daemon=False,
             timeout_s=300)
    return root


@pytest.mark.slow
@pytest.mark.multihost
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bucket_space_state_imports_as_its_model_space_twin(saved, tmp_path):
    md = read_metadata(iteration_dir(saved / "dpr")).state_dict_metadata
    assert sum(1 for k in md if k.endswith(".param")) > 2 * 2  # several buckets per rank
    with running(tmp_path, 2) as lc:
        c = Cluster.load(lc.cluster_file)
        try:
            co = Coordinator(c)
            out = {}
            for name in ("dpr", "full"):
                out[name] = json.loads(ptcctl(lc.cluster_file, "import", name, str(saved / name),
                                              "--format", "mcore", "--hosts", "h0:1,h1:1",
                                              "--json").stdout)
            assert out["dpr"]["notes"] == [] and out["dpr"]["optimizer"] == "adam"
            assert out["dpr"]["config"].startswith("tp=2,pp=1")
            dpr, full = co.state("dpr"), co.state("full")
            names = [t.name for t in dpr.model_spec().tensors]
            assert sum(n.startswith("optim/master/") for n in names) == 15  # bf16: masters
            assert co.checksums(dpr) == co.checksums(full)
            # and it moves like any job
            ptcctl(lc.cluster_file, "reconfigure", "dpr", "--to", "tp=1,dp=2")
            assert co.checksums(co.state("dpr")) == co.checksums(full)
        finally:
            c.close()


def _imported_twins(tmp_path, tp, *more):
    """One step of the same training on four ranks (tensor parallel ``tp``,
    ``more``: ``train_and_save``'s arguments after the bucket size) saved by
    megatron-core in bucket space (buckets of 3000 elements) and in model
    space, each imported: the bucket space's metadata and both imports,
    which hold the same tensors, every parameter's moments and master (an
    fp32 parameter is its own) among them."""
    for name, sharding, bucket in (("dpr", "dp_reshardable", 3000),
                                   ("full", "fully_reshardable", None)):
        gang(train_and_save, 4, tmp_path, str(tmp_path / name), tp, sharding, bucket, *more,
             daemon=False, timeout_s=300)
    md = read_metadata(iteration_dir(tmp_path / "dpr")).state_dict_metadata
    dpr, full = read_mcore(tmp_path / "dpr"), read_mcore(tmp_path / "full")
    assert dpr.notes == [] and full.notes == []
    optim = [n for n in full.tensors if n.startswith("optim/")]
    # moments of each parameter, and masters of those not in fp32 (their own masters)
    assert len(optim) == sum(2 + (e.dtype != torch.float32) for n, e in full.tensors.items()
                             if not n.startswith("optim/"))
    assert sorted(dpr.tensors) == sorted(full.tensors)
    for n in optim:
        assert torch.equal(dpr.tensors[n].get(), full.tensors[n].get()), n
    return md, dpr, full


@pytest.mark.slow
@pytest.mark.extended  # the chained-optimizer MoE case below reads a buffer per chunk too
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_interleaved_stages_import_from_a_buffer_per_chunk(tmp_path):
    """An interleaved pipeline (pp=2, two virtual stages each, dp=2) gives
    each rank a gradient buffer per model chunk: the bucket-space import
    reads each chunk's parameters from its own buffer and equals the same
    training saved in model space (it was reported and left at zero)."""
    md, dpr, _ = _imported_twins(tmp_path, 1, 0, 1, 2, 2)
    assert any(".gbuf_idx_1." in k for k in md)  # a second chunk's buffer
    assert dpr.native == "tp=1,pp=2"


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_parameters_of_two_dtypes_import_from_a_buffer_each(tmp_path):
    """With its norms kept in fp32 (the rest bf16) megatron-core's DDP gives
    each model chunk a gradient buffer per parameter dtype, in the order the
    chunk registers their first parameters, chunk after chunk: the
    bucket-space import reads each buffer's parameters from it and equals the
    same training saved in model space (pp=2 of two virtual stages, dp=2;
    it was reported and left at zero)."""
    md, dpr, full = _imported_twins(tmp_path, 1, 0, 1, 2, 2, True)
    bf16, fp32 = "(torch.bfloat16, torch.float32)", "(torch.float32, torch.float32)"
    found = {m.group(1, 2, 3) for k in md
             if (m := re.search(r"dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket", k))}
    # stage 0: the embedding and layer 0, then layer 2; stage 1: layer 1, then layer 3,
    # the final norm and the output layer; a layer registers its input norm first
    assert sorted(found) == [("0", "0", bf16), ("0", "1", fp32), ("0", "2", fp32),
                             ("0", "3", bf16), ("1", "0", fp32), ("1", "1", bf16),
                             ("1", "2", fp32), ("1", "3", bf16)]
    norms = [n for n in full.tensors if not n.startswith("optim/") and "layernorm" in n]
    assert len(norms) == 2 * 4 + 1
    for name, e in full.tensors.items():
        if not name.startswith("optim/"):
            assert e.dtype == (torch.float32 if name in norms else torch.bfloat16), name
    for n in norms:  # an fp32 parameter is its own master; its moments are the step's
        assert f"optim/master/{n}" not in full.tensors
        assert full.tensors[f"optim/exp_avg_sq/{n}"].get().min() > 0, n
    # a job keeps each parameter's dtype (the import cast the norms to the embedding's
    # bf16 before), and so does its export
    with running(tmp_path / "cluster", 1) as lc:
        ptcctl(lc.cluster_file, "import", "mixed", str(tmp_path / "full"), "--format", "mcore",
               "--config", "tp=1", "--hosts", "h0:1")
        ptcctl(lc.cluster_file, "export", "mixed", str(tmp_path / "out"), "--format", "mcore")
    back = read_mcore(tmp_path / "out")
    for name, e in full.tensors.items():
        assert back.tensors[name].dtype == e.dtype, name
        assert torch.equal(back.tensors[name].get(), e.get()), name
    # weights whose dtypes do not make these buffers (fp8 ones have a torch.uint8
    # buffer): reported, not read
    model = parse_model(dpr.model, dtype="bf16", optimizer="adam")
    params = {n: dataclasses.replace(e, dtype=torch.bfloat16) for n, e in dpr.tensors.items()
              if not n.startswith("optim/")}
    notes: list[str] = []
    assert read_dp_reshardable(iteration_dir(tmp_path / "dpr"), md, model, 1, 2, 1, 2, params,
                               notes) == {}
    assert "in its group 0 it has a buffer of torch.float32 parameters as buffer 1" in notes[0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_buckets_read_in_another_order_are_refused(saved):
    it = iteration_dir(saved / "dpr")
    src = read_mcore(saved / "dpr")
    md = read_metadata(it).state_dict_metadata
    model = parse_model(PRESET + ",names=mcore", dtype="bf16", optimizer="adam")
    params = {n: e for n, e in src.tensors.items() if not n.startswith("optim/")}
    # the two norms of a layer have the same size: swapped, every bucket still fits
    tensors = list(model.tensors)
    a, b = (next(i for i, t in enumerate(tensors) if t.name == f"decoder.layers.1.{n}.weight")
            for n in ("input_layernorm", "pre_mlp_layernorm"))
    tensors[a], tensors[b] = tensors[b], tensors[a]
    swapped = dataclasses.replace(model, tensors=tuple(tensors))
    notes: list[str] = []
    got = read_dp_reshardable(it, md, swapped, 2, 1, 1, 1, params, notes)
    with pytest.raises(CheckpointError, match="master of .*input_layernorm.* is not its weight"):
        got["optim/exp_avg/decoder.layers.1.input_layernorm.weight"].get()
    # the right order reads
    got = read_dp_reshardable(it, md, model, 2, 1, 1, 1, params, notes)
    assert torch.equal(got["optim/master/decoder.layers.1.input_layernorm.weight"].get()
                       .to(torch.bfloat16),
                       params["decoder.layers.1.input_layernorm.weight"].get())
    assert notes == []



@pytest.mark.slow
@pytest.mark.multihost
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("distributed", [pytest.param(False, marks=pytest.mark.extended), True],
                         ids=["optimizer", "distributed-optimizer"])
def test_an_export_resumes_in_megatron_cores_optimizer(saved, tmp_path, distributed):
    """The bucket-space job, moved to tp=1 and exported, is loaded by a job
    with megatron-core's own mixed-precision optimizer (one rank) or its
    DistributedOptimizer (two data-parallel ranks, what Megatron-LM's
    --use-distributed-optimizer runs) and schedule as Megatron-LM loads a
    checkpoint: every weight, fp32 master and moment is the job's, and its
    groups and schedule are the saved run's, not the loading job's (the
    export had no groups before: megatron-core refused it; it had no step in
    its groups and no content metadata: the DistributedOptimizer refused it)."""
    out = tmp_path / "export"
    world = 2 if distributed else 1
    with running(tmp_path / "cluster", 2) as lc:
        c = Cluster.load(lc.cluster_file)
        try:
            co = Coordinator(c)
            ptcctl(lc.cluster_file, "import", "dpr", str(saved / "dpr"), "--format", "mcore",
                   "--hosts", "h0:1,h1:1")
            ptcctl(lc.cluster_file, "reconfigure", "dpr", "--to", "tp=1,dp=2")
            ptcctl(lc.cluster_file, "export", "dpr", str(out), "--format", "mcore")
            gang(load_and_dump, world, tmp_path, str(out), str(tmp_path), 1, distributed,
                 daemon=False, timeout_s=300)
            dumps = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(world)]
            args = torch.load(iteration_dir(out) / "common.pt", weights_only=False)["args"]
            # the run's args with the job's mesh: Megatron-LM goes on from the saved
            # run's data position, with its tokenizer and positions, and starts its
            # random generators from the seed (no RNG state is saved)
            assert (args.consumed_train_samples, args.tokenizer_type, args.seed,
                    args.max_position_embeddings) == (8 * ITERATION, "NullTokenizer", 1234, 32)
            assert (args.tensor_model_parallel_size, args.data_parallel_size, args.world_size,
                    args.no_save_rng) == (1, 2, 2, True)
            st = co.state("dpr")
            names = [n for n in dumps[0] if n not in ("groups", "scheduler", "steps")]
            assert len(names) == 15
            for name in names:
                _held_everywhere(co, st, name, [d[name] for d in dumps])
        finally:
            c.close()
    # the groups' settings and the schedule as the saved run had them, not the
    # loading job's (max_lr 1e-3, min_lr 0): the schedule sets each group's lr
    # from the group's max_lr; megatron-core sets the weight decay at the next step
    for dump in dumps:
        assert dump["steps"] == [float(ITERATION)]  # the job's step, every parameter's
        assert sorted((g["wd_mult"], g["lr"], g["max_lr"], g["min_lr"])
                      for g in dump["groups"]) == [(0.0, 1e-2, 1e-2, 1e-3), (1.0, 1e-2, 1e-2, 1e-3)]
    saved_sched = torch.load(iteration_dir(saved / "dpr") / "common.pt",
                             weights_only=False)["opt_param_scheduler"]
    assert dumps[0]["scheduler"] == saved_sched and saved_sched["num_steps"] == 8


@pytest.mark.slow
@pytest.mark.multihost
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_mixture_of_experts_resumes_in_megatron_cores_chained_optimizers(tmp_path):
    """megatron-core puts experts in optimizer groups of their own, and a
    second optimizer chained to the dense one, only with expert parallelism.
    A job it saved at ep=1 (tp=1, dp=2, model space: the experts in the
    dense groups) is imported with its groups, moved to ep=2 and exported;
    a job of two data-parallel ranks at ep=2 with megatron-core's chained
    DistributedOptimizers loads every weight, master and moment of the
    experts and the rest, and each optimizer's groups with the saved
    settings. Before, the import dropped the groups (it looked for expert
    groups at ep=1) and the export wrote one optimizer, which the chain
    refused. A job saved at ep=2 imports with its chain's groups, and its
    bucket-space twin (the chain's expert optimizer holds each ep rank's
    experts) imports the same state."""
    saved, out = tmp_path / "moe", tmp_path / "export"
    gang(train_and_save, 2, tmp_path, str(saved), 1, "fully_reshardable", None, 4,
         daemon=False, timeout_s=300)
    for name, sharding, bucket in (("ep2", "fully_reshardable", None),
                                   ("ep2-dpr", "dp_reshardable", 3000)):
        gang(train_and_save, 2, tmp_path, str(tmp_path / name), 1, sharding, bucket, 4, 2,
             daemon=False, timeout_s=300)
    with running(tmp_path / "cluster", 2) as lc:
        c = Cluster.load(lc.cluster_file)
        try:
            co = Coordinator(c)
            got = json.loads(ptcctl(lc.cluster_file, "import", "moe", str(saved), "--format",
                                    "mcore", "--hosts", "h0:1,h1:1", "--json").stdout)
            assert got["notes"] == []
            ptcctl(lc.cluster_file, "reconfigure", "moe", "--to", "dp=2,ep=2")
            ptcctl(lc.cluster_file, "export", "moe", str(out), "--format", "mcore")
            gang(load_and_dump, 2, tmp_path, str(out), str(tmp_path), 1, True, 4, 2,
                 daemon=False, timeout_s=300)
            dumps = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
            st = co.state("moe")
            names = {n for d in dumps for n in d if n not in ("groups", "scheduler", "steps")}
            # each rank builds two experts of each layer's four, fc1 and fc2: all of them
            assert sum(".experts." in n for n in names) == 2 * 4 * 2
            for name in names:
                _held_everywhere(co, st, name, [d.get(name) for d in dumps])
            # the ep=2 job's chain: its expert optimizer's group is read too
            got = json.loads(ptcctl(lc.cluster_file, "import", "ep2", str(tmp_path / "ep2"),
                                    "--format", "mcore", "--hosts", "h0:1,h1:1",
                                    "--json").stdout)
            assert got["notes"] == []
            got = json.loads(ptcctl(lc.cluster_file, "import", "ep2-dpr",
                                    str(tmp_path / "ep2-dpr"), "--format", "mcore", "--hosts",
                                    "h0:1,h1:1", "--json").stdout)
            assert got["notes"] == []
            for job in ("ep2", "ep2-dpr"):
                groups = recorded(co.state(job).model_spec())
                assert sorted((g.settings["wd_mult"], g.settings["is_expert_parallel"],
                               sum(".experts." in n for n in g.names)) for g in groups) \
                    == [(0.0, False, 0), (1.0, False, 0), (1.0, True, 2 * 4 * 2)]
            assert co.checksums(co.state("ep2-dpr")) == co.checksums(co.state("ep2"))
        finally:
            c.close()
    for dump in dumps:
        assert dump["steps"] == [float(ITERATION)]
        # dense: weight decay and none; experts: weight decay, in the second optimizer
        assert [(g["wd_mult"], g["is_expert_parallel"], g["lr"], g["min_lr"])
                for g in dump["groups"]][-1] == (1.0, True, 1e-2, 1e-3)
        assert sorted((g["wd_mult"], g["is_expert_parallel"], g["lr"], g["min_lr"])
                      for g in dump["groups"]) == [(0.0, False, 1e-2, 1e-3),
                                                   (1.0, False, 1e-2, 1e-3),
                                                   (1.0, True, 1e-2, 1e-3)]


def _held_everywhere(co, st, name, held):
    """The ranks' stretches ``held`` ((start, [weight, master, exp_avg,
    exp_avg_sq]) or None) of tensor ``name`` are the job's and cover it."""
    wants = [from_numpy(co.fetch_tensor(st, kind + name), "fp32" if kind else "bf16").flatten()
             for kind in ("", "optim/master/", "optim/exp_avg/", "optim/exp_avg_sq/")]
    count = 0
    for h in held:
        if h is None:
            continue
        start, got = h
        for kind, have, want in zip("wmas", got, wants, strict=True):
            # the vocabulary's padding rows are past the job's elements
            end = min(start + have.numel(), want.numel())
            assert torch.equal(have[:end - start].to(want.dtype), want[start:end]), (kind, name)
        count += got[0].numel()
    assert count >= wants[0].numel(), name  # every element is held by a rank


def test_a_run_position_is_kept_only_at_its_step():
    """The saving run's data position goes with its step: a job that moved on
    exports the rest of the run's args without it, and says so."""
    model = parse_model(PRESET + ",names=mcore", dtype="bf16", optimizer="adam")
    run = argparse.Namespace(consumed_train_samples=40, tokenizer_type="NullTokenizer",
                             tensor_model_parallel_size=2, world_size=4,
                             params_dtype=torch.bfloat16)
    spec = record_args(model, run, 5)
    notes: list[str] = []
    assert recorded_args(spec, 5, notes) == {"consumed_train_samples": 40,
                                              "tokenizer_type": "NullTokenizer"}
    assert notes == []
    assert recorded_args(spec, 6, notes) == {"tokenizer_type": "NullTokenizer"}
    assert "consumed_train_samples" in notes[0] and "step 5 to 6" in notes[0]
    assert recorded_args(model, 5, notes) == {} and "no Megatron run" in notes[1]
