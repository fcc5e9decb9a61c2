"""DeepSpeed's own engine on CPU (gloo), run by tests/test_ckpt_deepspeed*.py
under torchrun: ``save`` trains a tiny model one step with ZeRO stage S and
``engine.save_checkpoint``s it; ``load`` builds the same engine at this world
size and ``engine.load_checkpoint``s; ``load_universal`` does so with the
checkpoint config ``{"load_universal": true}`` (a universal checkpoint, its
``latest_universal`` naming the folder). All then write, from rank 0, every
parameter's weight, fp32 master and Adam moments as DeepSpeed's own
accessors give them (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``) to ``DUMP``.

    torchrun --nproc_per_node N tests/deepspeed_engine.py MODE STAGE DTYPE CKPT DUMP [PP]

(``MODE``: save, load or load_universal). With ``PP`` the model is a
:class:`PipelineModule` of the same layers cut (uniformly) into ``PP``
stages, trained by DeepSpeed's ``PipelineEngine`` (``train_batch``) with
ZeRO-1 at ``N / PP`` data-parallel ranks; its parameters are named as the
module names them (``<layer index>.weight``) and each stage's are gathered
to rank 0.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import (  # noqa: E402
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model() -> torch.nn.Module:
    """Sizes that no data-parallel degree up to 4 divides evenly."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5),
                               torch.nn.ReLU(), torch.nn.Linear(5, 3))


def engine(stage: int, dtype: str, universal: bool = False,
           pp: int = 0) -> deepspeed.DeepSpeedEngine:
    m = model()
    if pp:
        m = deepspeed.pipe.PipelineModule(list(m), num_stages=pp, partition_method="uniform",
                                          loss_fn=lambda y, _: y.float().pow(2).sum())
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    eng, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    return eng


def dump(eng: deepspeed.DeepSpeedEngine, path: str, pp: int = 0) -> None:
    out = {}
    if hasattr(eng.optimizer, "_hp_optimizer_states_linked"):
        # ZeRO-1/2 link each parameter to its Adam state before the first
        # step, when the optimizer has none yet: link again now that it has
        eng.optimizer._hp_optimizer_states_linked = False
        eng.optimizer._lazy_init_hp_params_optimizer_state()
    for name, p in eng.module.named_parameters():
        full = safe_get_full_fp32_param(p)  # a collective of the data-parallel ranks
        out[f"master/{name}"] = full.clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"{kind}/{name}"] = safe_get_full_optimizer_state(p, kind).clone()
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
        for name, p in eng.module.named_parameters():
            out[f"weight/{name}"] = p.detach().clone()
    if pp and eng.grid.data_parallel_id != 0:
        out = {}  # the stage's data-parallel rank 0 says what it holds
    if pp:
        steps = {float(s["step"]) for s in eng.optimizer.optimizer.state.values()}
        every: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, (out, steps))
        out = {k: v for o, _ in every for k, v in o.items()}
        out["adam_steps"] = torch.tensor(sorted(set().union(*(s for _, s in every))))
    out["global_steps"] = torch.tensor(eng.global_steps)
    if torch.distributed.get_rank() == 0:
        torch.save(out, path)


def _batches(eng: deepspeed.DeepSpeedEngine, dtype: str):
    """Micro-batches of this data-parallel rank's inputs (the pipeline's first
    stage reads them, its last one the labels, which the loss ignores)."""
    g = torch.Generator().manual_seed(1 + eng.grid.data_parallel_id)
    while True:
        x = torch.randn(2, 9, dtype=DTYPES[dtype], generator=g)
        yield x, torch.zeros(2)


def main() -> None:
    mode, stage, dtype, ckpt, path = sys.argv[1:6]
    pp = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    # gloo does the collectives; DeepSpeed's shared-memory all-reduce (for
    # inference, built with ninja at start) aborted a run here once
    # ("terminate called without an active exception") and is not needed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    eng = engine(int(stage), dtype, mode == "load_universal", pp)
    if mode == "save" and pp:
        eng.train_batch(_batches(eng, dtype))
        eng.train_batch(_batches(eng, dtype))
        eng.save_checkpoint(ckpt)
    elif mode == "save":
        torch.manual_seed(1 + torch.distributed.get_rank())
        for _ in range(2):
            x = torch.randn(2, 9, dtype=DTYPES[dtype])
            eng.backward(eng(x).float().pow(2).sum())
            eng.step()
        eng.save_checkpoint(ckpt)
    else:
        eng.load_checkpoint(ckpt)
    dump(eng, path, pp)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # all is saved and the process group destroyed: leave without the interpreter's
    # teardown, where torch's gloo threads now and then abort the process ("terminate
    # called without an active exception"; seen with DeepSpeed's engine alone too)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
