"""Megatron-LM's own ``load_checkpoint`` (``megatron.training``, which is
not on PyPI) resumes a ptcfs export: the job megatron-core saved at tp=2
(tests/mcore_distopt.py), imported, moved to tp=1, dp=2 and exported, is
loaded by two data-parallel gloo ranks that set Megatron-LM's global args
with its own ``parse_args``, ``validate_args`` and
``set_global_variables`` and build the optimizer and schedule with its own
``get_megatron_optimizer_config`` and ``get_optimizer_param_scheduler``.

It needs a Megatron-LM source tree of the installed megatron-core's
release, named by ``PTC_MEGATRON_LM`` (skipped without one), e.g.::

    git clone --depth 1 --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /opt/mlm
    PTC_MEGATRON_LM=/opt/mlm pytest tests/test_megatron_lm.py

(from a mirror without a work tree: ``mkdir /opt/mlm && git
--git-dir=MIRROR archive core_v0.16.1 megatron | tar -x -C /opt/mlm``),
and what ``megatron.training`` imports beyond megatron-core: ``pip install
six pydantic triton`` (triton is about 1 GB: ``megatron.training.initialize``
imports megatron-core's batch-invariant kernels, which import it; nothing
here runs them). The tree goes after the installed packages on
``sys.path``: ``megatron`` is a namespace package of both, and its
``core`` stays the installed one.

The ranks run on the CPU as tests/mcore_distopt.py's do (``_CpuAsCuda``,
and ``_first_state`` for PyTorch's Adam). Megatron-LM's ``get_model`` is
not used (it needs CUDA streams): the model and its DDP wrapper are the
harness's, of the sizes ``FLAGS`` give.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install 'ptcfs[mcore]')")

from ptcfs.client.control.conn import Cluster  # noqa: E402
from ptcfs.client.control.coordinator import Coordinator  # noqa: E402
from ptcfs.client.formats.mcore import _args, iteration_dir, record_args  # noqa: E402
from ptcfs.jobstate import JobState  # noqa: E402
from ptcfs.model.presets import parse_model  # noqa: E402
from ptcfs.model.specfile import encode_spec  # noqa: E402
from ptcfs.sharding import parse_config  # noqa: E402
from tests.daemons import running  # noqa: E402
from tests.dtensor_gang import gang  # noqa: E402
from tests.mcore_distopt import (  # noqa: E402
    FFN,
    HEADS,
    HIDDEN,
    ITERATION,
    KV_HEADS,
    LAYERS,
    PRESET,
    SEQ,
    VOCAB,
    _CpuAsCuda,
    _first_state,
    _model,
    cpu_stubs,
    dump_state,
    train_and_save,
)
from tests.test_cluster import ptcctl  # noqa: E402
from tests.test_mcore_distopt import _held_everywhere  # noqa: E402

#: the flags of the resuming run (pretrain_gpt.py's): the test model's sizes,
#: a global batch of 8 samples (as the saved run's), its optimizer and schedule
FLAGS = (f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads {HEADS} "
         f"--group-query-attention --num-query-groups {KV_HEADS} --ffn-hidden-size {FFN} "
         f"--seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size {VOCAB} "
         "--position-embedding-type rope --normalization RMSNorm --swiglu "
         "--disable-bias-linear --untie-embeddings-and-output-weights --transformer-impl local "
         "--no-gradient-accumulation-fusion --use-cpu-initialization --bf16 "
         "--accumulate-allreduce-grads-in-fp32 --tokenizer-type NullTokenizer "
         "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
         "--micro-batch-size 4 --global-batch-size 8 --train-iters 100 --optimizer adam "
         "--lr 1e-3 --min-lr 0 --lr-decay-style linear --weight-decay 0 "
         "--use-checkpoint-opt_param-scheduler --use-distributed-optimizer "
         "--ckpt-format torch_dist").split()


def import_training(tree: str) -> None:
    """``megatron.training`` of the Megatron-LM checkout ``tree`` imported
    beside the installed megatron-core (ImportError: it does not import)."""
    import megatron.core  # noqa: F401 - the installed one, first

    if not (Path(tree) / "megatron" / "training" / "__init__.py").is_file():
        raise ImportError(f"{tree} has no megatron/training: not a Megatron-LM checkout")
    if tree not in sys.path:
        sys.path.append(tree)  # after site-packages: megatron.core stays the installed one
    import megatron.training.checkpointing  # noqa: F401


@pytest.fixture(scope="module")
def tree():
    """The Megatron-LM checkout of ``PTC_MEGATRON_LM``: the installed
    megatron-core's release, its ``megatron.training`` importable."""
    from megatron.core.package_info import __version__ as installed

    path = os.environ.get("PTC_MEGATRON_LM")
    if not path:
        pytest.skip("PTC_MEGATRON_LM (a Megatron-LM checkout of the installed megatron-core's "
                    f"release, core_v{installed}) is not set")
    path = str(Path(path).resolve())
    info = Path(path) / "megatron" / "core" / "package_info.py"
    text = info.read_text() if info.is_file() else ""
    version = ".".join(re.findall(r"^(?:MAJOR|MINOR|PATCH) = (\d+)", text, re.M))
    if version != installed:
        pytest.skip(f"PTC_MEGATRON_LM={path} is Megatron-LM {version or '(no version)'}, the "
                    f"installed megatron-core {installed}: check out core_v{installed}")
    try:
        import_training(path)
    except ImportError as e:
        pytest.skip(f"megatron.training of PTC_MEGATRON_LM={path} does not import: {e}")
    return path


def resume_in_megatron_lm(rank: int, world: int, tree: str, ckpt: str, out: str) -> None:
    """Rank ``rank`` of a Megatron-LM run (``FLAGS``, loading ``ckpt``)
    resumes with Megatron-LM's ``load_checkpoint`` and writes to
    ``out/<rank>.pt`` what :func:`~tests.mcore_distopt.dump_state` holds,
    the iteration, the args it read back and where its modules came from."""
    cpu_stubs()
    import_training(tree)
    import megatron.core
    import megatron.training
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    sys.argv = ["pretrain_gpt.py", *FLAGS, "--load", ckpt]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size,
                                             args.pipeline_model_parallel_size)
    try:
        with _CpuAsCuda():
            dump = _resume(args)
        dump["modules"] = (megatron.core.__file__, megatron.training.__file__)
        torch.save(dump, Path(out) / f"{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


def _resume(args: Any) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import (
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    model = _model(args.tensor_model_parallel_size)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32), model)
    config, overrides = get_megatron_optimizer_config(args)
    opt = get_megatron_optimizer(config, [ddp], config_overrides=overrides,
                                 use_gloo_process_groups=args.enable_gloo_process_groups)
    sched = get_optimizer_param_scheduler(opt)
    _first_state(opt)
    iteration, _ = load_checkpoint([ddp], opt, sched)
    dump = dump_state(ddp, opt, sched, args.use_distributed_optimizer)
    dump["iteration"] = iteration
    dump["args"] = {k: getattr(args, k) for k in (
        "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")}
    return dump


@pytest.mark.slow
@pytest.mark.multihost
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_export_resumes_in_megatron_lms_load_checkpoint(tree, tmp_path):
    """Every weight, fp32 master and Adam moment each of the two ranks
    holds after Megatron-LM's ``load_checkpoint`` is the job's; it returns
    the job's step, goes on from the saved run's data position and takes
    the saved run's groups and schedule (--use-checkpoint-opt_param-scheduler)."""
    saved, out = tmp_path / "saved", tmp_path / "export"
    gang(train_and_save, 4, tmp_path, str(saved), 2, "dp_reshardable", 3000, daemon=False,
         timeout_s=300)
    with running(tmp_path / "cluster", 2) as lc:
        c = Cluster.load(lc.cluster_file)
        try:
            co = Coordinator(c)
            ptcctl(lc.cluster_file, "import", "dpr", str(saved), "--format", "mcore",
                   "--hosts", "h0:1,h1:1")
            ptcctl(lc.cluster_file, "reconfigure", "dpr", "--to", "tp=1,dp=2")
            ptcctl(lc.cluster_file, "export", "dpr", str(out), "--format", "mcore")
            gang(resume_in_megatron_lm, 2, tmp_path, tree, str(out), str(tmp_path),
                 daemon=False, timeout_s=300)
            dumps = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
            st = co.state("dpr")
            names = [n for n in dumps[0] if n.startswith(("embedding.", "decoder.", "output_"))]
            assert len(names) == 15
            for name in names:
                _held_everywhere(co, st, name, [d[name] for d in dumps])
        finally:
            c.close()
    saved_sched = torch.load(iteration_dir(saved) / "common.pt",
                             weights_only=False)["opt_param_scheduler"]
    for dump in dumps:
        core, training = dump["modules"]
        assert Path(tree) in Path(training).parents and Path(tree) not in Path(core).parents
        assert dump["iteration"] == ITERATION
        assert dump["args"] == {"consumed_train_samples": 8 * ITERATION,
                                "skipped_train_samples": 0, "consumed_valid_samples": 0}
        assert dump["steps"] == [float(ITERATION)]
        assert sorted((g["wd_mult"], g["lr"], g["max_lr"], g["min_lr"])
                      for g in dump["groups"]) == [(0.0, 1e-2, 1e-2, 1e-3), (1.0, 1e-2, 1e-2, 1e-3)]
        assert dump["scheduler"] == saved_sched


@pytest.mark.parametrize("preset, run, want", [
    (PRESET, None, True),  # no Megatron run: the flag's default
    (PRESET, {}, True),  # a run that did not record it
    (PRESET, {"add_position_embedding": False}, False),  # --no-position-embedding
    (PRESET, {"add_position_embedding": True}, True),
    ("gpt:layers=2,hidden=64,heads=4,vocab=300,ffn=96,seq=32", None, True),  # learned
], ids=["no-run", "not-recorded", "no-position-embedding", "recorded", "gpt"])
def test_exported_position_embedding_flag_is_the_one_megatron_lm_compares(preset, run, want):
    """Megatron-LM's ``load_checkpoint`` asserts that the checkpoint's
    ``add_position_embedding`` is the loading run's; with rope it means
    nothing else, and Megatron-LM's default is True. The export wrote False
    for every rope model, which a run without --no-position-embedding
    refused (AssertionError: add_position_embedding value from checkpoint
    (False) is not equal to the input argument value (True))."""
    spec = parse_model(preset + ",names=mcore", dtype="bf16", optimizer="adam")
    if run is not None:
        spec = record_args(spec, argparse.Namespace(**run), ITERATION)
    state = JobState("j", 1, "module", "bf16", "adam", parse_config("dp=2", "h0:2"), ITERATION,
                     spec=encode_spec(spec))
    assert _args(state, dict(spec.params), []).add_position_embedding is want
