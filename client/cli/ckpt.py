"""``ptcctl import`` and ``ptcctl export``: jobs from and to real checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path

from ptcfs.client.cli.access import access_from, add_access_args
from ptcfs.client.cli.app import emit_json, register
from ptcfs.client.cli.args import MESH_METAVAR, job_name, whole
from ptcfs.client.control.conn import Cluster
from ptcfs.client.control.coordinator import Coordinator
from ptcfs.client.formats import FORMATS
from ptcfs.errors import TorchMissing
from ptcfs.units import fmt_bytes

__all__: list[str] = []





def _io():  # type: ignore[no-untyped-def]
    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissing("import and export need torch: pip install 'ptcfs[torch]'") from None
    from ptcfs.client.formats import io as ckpt_io

    return ckpt_io


@register("import")
def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import", help="create a job from a Megatron-LM, Megatron-Core, DCP, torchtitan, "
        "torch.save, Hugging Face or DeepSpeed ZeRO or universal checkpoint",
        description="Create job JOB (version 1) from the checkpoint at SRC. megatron: a "
                    "directory with latest_checkpointed_iteration.txt and "
                    "iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt; mcore: a Megatron-Core "
                    "torch_dist checkpoint (iter_N/ with .metadata, *.distcp, common.pt); "
                    "torch-dcp: a "
                    "torch.distributed.checkpoint directory of {'model': ..., 'optim': ...}; "
                    "torchtitan: a step-N folder of torchtitan's CheckpointManager (llama3 "
                    "or dense qwen3 recognised from its names; llama3 needs --heads N to "
                    "split its fused query/key/value moments, qwen3's shapes give them; its "
                    "trainer entries come back on export); "
                    "torch: a torch.save file (or a directory with one) of a state dict or "
                    "{'model': ..., 'optimizer': ..., 'step': N}. Tensor names are Megatron-LM's "
                    "with global layer indices (see docs/training.md, 'Import and export'). hf: a "
                    "save_pretrained directory (config.json, safetensors) of LLaMA, Mistral, "
                    "Qwen2, Mixtral or GPT-2, with HF's names and the config's sizes; "
                    "--model-spec FILE for any other model. deepspeed: a DeepSpeed ZeRO-1/2/3 "
                    "checkpoint (latest, global_stepN/*model_states.pt and one "
                    "*optim_states.pt per data-parallel rank), with the module's names; "
                    "deepspeed-universal: the folder DeepSpeed's ds_to_universal writes "
                    "(latest_universal, zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt).")
    p.add_argument("job", type=job_name)
    p.add_argument("src", type=Path)
    p.add_argument("--format", required=True, choices=list(FORMATS))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="PRESET",
                   help="model preset (default: from the checkpoint, its names and --heads)")
    g.add_argument("--model-spec", metavar="FILE", type=Path,
                   help="a model spec file (TOML or JSON) instead of a preset; for hf, an "
                        "architecture ptcfs does not know (tensor names as in the files)")
    p.add_argument("--heads", type=whole(1), help="attention heads, when the checkpoint does not "
                   "record them")
    p.add_argument("--qkv-order", choices=("per-head", "grouped"),
                   help="fused query/key/value rows of a torch or torch-dcp checkpoint that "
                        "ptcfs did not write: per-head "
                        "(Megatron's) or grouped (all q, then k, then v: GPT-2, HF; reordered)")
    p.add_argument("--optimizer", choices=("none", "adam"),
                   help="optimizer state of the job (default: adam when the checkpoint has "
                        "Adam state; without it adam starts from zero moments)")
    p.add_argument("--config", metavar=MESH_METAVAR,
                   help="the mesh (default: the checkpoint's tp and pp)")
    p.add_argument("--hosts", help="name:gpus,... (default: the first hosts of the cluster)")
    add_access_args(p)
    p.add_argument("--trust-pickle", action="store_true",
                   help="let torch.load unpickle any object (only for files you trust)")
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_import)


def _run_import(args: argparse.Namespace) -> int:
    io = _io()
    cluster = Cluster.load(args.cluster)
    try:
        r = io.import_checkpoint(
            Coordinator(cluster), args.job, args.src, args.format,
            model=args.model, model_spec=args.model_spec,
            heads=args.heads, optimizer=args.optimizer, degrees=args.config, hosts=args.hosts,
            trust=args.trust_pickle, progress=None if not args.json else False,
            access=access_from(args), qkv_order=args.qkv_order)
    finally:
        cluster.close()
    st = r.state
    if args.json:
        emit_json({"job": st.job, "version": st.version, "step": st.step, "model": st.model,
                   "dtype": st.dtype, "optimizer": st.optimizer, "config": st.describe(),
                   "tensors_read": r.tensors, "bytes": r.nbytes, "notes": r.notes})
    else:
        print(f"imported {st.job} from {args.src} ({args.format}, step {st.step}): {st.model} "
              f"{st.dtype} optimizer={st.optimizer}, {st.describe()}, {fmt_bytes(r.nbytes)}")
        for note in r.notes:
            print(f"note: {note}")
    return 0


@register("export")
def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a job's state as a Megatron-LM, Megatron-Core, DCP, torchtitan, "
        "torch.save, Hugging Face or DeepSpeed ZeRO or universal checkpoint",
        description="Write the job's current committed version (or --version V) to DIR in "
                    "the format's layout; megatron writes one file per (tp, pp) rank of the "
                    "job's current configuration; hf a directory from_pretrained loads, with "
                    "optimizer.pt and master/ (fp32 masters) when the job keeps them; deepspeed "
                    "the ZeRO files of the job's dp x fsdp ranks (tp=pp=1), which DeepSpeed's "
                    "ds_to_universal converts; deepspeed-universal a universal checkpoint "
                    "(latest_universal, global_stepN_universal/) that loads at any dp.")
    p.add_argument("job", type=job_name)
    p.add_argument("dir", type=Path)
    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--version", type=whole(1), help="a committed version (default: the current)")
    p.add_argument("--cluster", help="cluster file (default: $PTC_CLUSTER)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    io = _io()
    cluster = Cluster.load(args.cluster)
    try:
        notes: list[str] = []
        st = io.export_checkpoint(Coordinator(cluster), args.job, args.dir, args.format,
                                  args.version, progress=None if not args.json else False,
                                  notes=notes)
    finally:
        cluster.close()
    if args.json:
        emit_json({"job": st.job, "version": st.version, "step": st.step, "format": args.format,
                   "dir": str(args.dir), "config": st.describe(), "notes": notes})
    else:
        print(f"exported {st.job} version {st.version} (step {st.step}, {st.describe()}) to "
              f"{args.dir} as {args.format}")
        for note in notes:
            print(f"note: {note}")
    return 0
