"""A tiny torchtitan job on CPU gloo ranks, started by torchrun.

``titan_job.py save BASE OUT [MODEL]``: torchtitan's own model (``llama3``,
its ``Llama3Model``, or ``qwen3``, its dense ``Qwen3Model`` with per-head
query/key norms and a head size other than ``DIM // HEADS``; both with the
fused query/key/value projection as their flavors have it; ``qwen3_moe``,
that qwen3 with a mixture of experts in every layer; ``deepseek_v3``, its
``DeepSeekV3Model`` with low-rank attention, a dense first layer and a
mixture of experts with a shared expert after it: the MoE layers' experts
stacked in one tensor per projection, their load-balancing bias a
buffer), its parameters and saved buffers drawn at random, sharded with FSDP2
(``fully_shard``) over the ranks, its ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer`` take two steps on fixed gradients (torchtitan's
flex attention has no backward on CPU), its ``ParallelAwareDataloader``
yields two batches, and its ``CheckpointManager`` saves step 2 under
``BASE/checkpoint/step-2``. ``titan_job.py load BASE OUT [MODEL]``: the same job
built from another seed loads ``BASE/checkpoint/step-2`` with its
``CheckpointManager``. Both write every rank's whole state
(model, flattened optimizer, lr scheduler, the dataloader's next batch and
train state)
to ``OUT/<save|load>-<rank>.pt`` for the test to compare.

``titan_job.py resume BASE OUT MODEL FOLDER N``: a job built from another
seed whose ``CheckpointManager`` folder is ``BASE/FOLDER`` (FOLDER a job's
``/ptc/<job>/dcp`` on a mount: absolute, so BASE is not prefixed) loads step N (its state to
``OUT/load-N-<rank>.pt``), trains one step on the batch it yields next and
saves step N+1 there (its state to ``OUT/save-<N+1>-<rank>.pt``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import IterableDataset

DIM, HEADS, KV_HEADS, VOCAB, LAYERS, FFN = 64, 4, 2, 256, 2, 128
#: the MoE models' experts, each expert's hidden size, deepseek_v3's low ranks
EXPERTS, MOE_FFN, Q_LORA, KV_LORA = 4, 32, 16, 32
#: qwen3's head size (its query rows are HEADS * QWEN3_HEAD_DIM, not DIM)
QWEN3_HEAD_DIM = 32
STEP = 2
#: the optimizer's settings (not torch's defaults)
SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def model_config(model: str = "llama3") -> Any:
    if model in ("qwen3", "qwen3_moe"):
        return _qwen3_config(model == "qwen3_moe")
    if model == "deepseek_v3":
        return _deepseek_config()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
            fuse_qkv=True, rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64,
                                                   theta=10000.0),
            attn_backend="flex"))


def _qwen3_config(moe: bool = False) -> Any:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    rope = CosSinRoPE.Config(dim=QWEN3_HEAD_DIM, max_seq_len=64, theta=1000000.0)
    common = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                  head_dim=QWEN3_HEAD_DIM, fuse_qkv=True, attn_backend="flex", rope=rope)
    layers = (_build_qwen3_moe_layers(**common, moe_hidden_dim=MOE_FFN, num_experts=EXPERTS,
                                      top_k=2, moe_comm_backend="standard") if moe
              else _build_qwen3_layers(**common, hidden_dim=FFN))
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, norm=_qwen3_norm(DIM), enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)


def _deepseek_config(q_lora: int = Q_LORA) -> Any:
    """torchtitan's deepseek_v3 (``q_lora`` 0: a plain query projection ``wq``)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    return DeepSeekV3Model.Config(
        dim=DIM, vocab_size=VOCAB, norm=RMSNorm.Config(normalized_shape=DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), mtp_layers=[],
        layers=_build_dsv3_layers(
            n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=q_lora,
            kv_lora_rank=KV_LORA, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            mscale=1.0, dense_hidden_dim=FFN, moe_hidden_dim=MOE_FFN, num_experts=EXPERTS,
            num_shared_experts=1, router_top_k=2, router_score_func="softmax",
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0)))


class _Tokens(IterableDataset, Stateful):
    """Token rows, with their read position as state, as torchtitan's
    datasets keep it (a StatefulDataLoader over a dataset without state
    counts the samples it skips on resume twice in the state it saves next)."""

    def __init__(self) -> None:
        self.at = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while self.at < 1000:
            self.at += 1
            yield torch.arange(self.at - 1, self.at + 7) % VOCAB

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.at = state_dict["at"]


class _TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state`` (its own state_dict)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def _whole(v: Any) -> Any:
    if isinstance(v, DTensor):
        return v.full_tensor().clone()
    if isinstance(v, torch.Tensor):
        return v.clone()
    return v


def job(base: str, seed: int, model: str, folder: str = "checkpoint") -> tuple[Any, ...]:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    torch.manual_seed(seed)
    m = model_config(model).build()
    saved = m.state_dict()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape))
        for name, b in m.named_buffers():  # the MoE's load-balancing bias
            if name in saved:
                b.copy_(torch.randn(b.shape))
    for layer in m.layers.values() if isinstance(m.layers, torch.nn.ModuleDict) else m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opts = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs=dict(SETTINGS))],
        implementation="for-loop").build(model_parts=[m])
    lrs = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=opts, training_steps=10)
    data = ParallelAwareDataloader(_Tokens(), dp_rank=rank, dp_world_size=world, batch_size=2)
    state = _TrainState()
    ckpt = CheckpointManager.Config(enable=True, folder=folder, interval=1).build(
        dataloader=data, model_parts=[m], optimizers=opts, lr_schedulers=lrs,
        states={"train_state": state}, sd_adapter=None, base_folder=base)
    return m, opts, lrs, data, state, ckpt


def dump(path: str, m: Any, opts: Any, lrs: Any, batch: torch.Tensor,
         state: _TrainState) -> None:
    """The job's state; for the dataloader, the batch it yields next (a
    StatefulDataLoader that loaded a state and has not iterated reports
    another state than the one it loaded, but resumes where it was)."""
    from torchtitan.components.checkpoint import ModelWrapper

    torch.save({"model": {k: _whole(v) for k, v in ModelWrapper(m).state_dict().items()},
                "optimizer": {k: _whole(v) for k, v in opts.state_dict().items()},
                "lr_scheduler": lrs.state_dict(), "next_batch": batch,
                "train_state": state.state_dict()}, path)


def train(m: Any, opts: Any, lrs: Any, state: _TrainState, step: int) -> None:
    """Step ``step`` on fixed gradients (flex attention has no backward on CPU)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in m.parameters():
        full = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
    opts.step()
    lrs.step()
    opts.zero_grad()
    state.step, state.ntokens_seen = step, step * 16


def save(base: str, out: str, model: str) -> None:
    m, opts, lrs, data, state, ckpt = job(base, seed=0, model=model)
    batches = iter(data)
    for step in range(1, STEP + 1):
        next(batches)
        train(m, opts, lrs, state, step)
    ckpt.save(curr_step=STEP)
    dump(os.path.join(out, f"save-{dist.get_rank()}.pt"), m, opts, lrs, next(batches), state)
    ckpt.close()


def load(base: str, out: str, model: str) -> None:
    m, opts, lrs, data, state, ckpt = job(base, seed=7, model=model)
    if not ckpt.load(step=STEP):
        raise SystemExit(f"torchtitan found no checkpoint under {base}")
    dump(os.path.join(out, f"load-{dist.get_rank()}.pt"), m, opts, lrs, next(iter(data)),
         state)
    ckpt.close()


def resume(base: str, out: str, model: str, folder: str, step: int) -> None:
    m, opts, lrs, data, state, ckpt = job(base, seed=7, model=model, folder=folder)
    if not ckpt.load(step=step):
        raise SystemExit(f"torchtitan found no checkpoint under {base}/{folder}")
    rank = dist.get_rank()
    batches = iter(data)
    dump(os.path.join(out, f"load-{step}-{rank}.pt"), m, opts, lrs, next(batches), state)
    train(m, opts, lrs, state, step + 1)
    ckpt.save(curr_step=step + 1)
    dump(os.path.join(out, f"save-{step + 1}-{rank}.pt"), m, opts, lrs, next(batches), state)
    ckpt.close()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        model = sys.argv[4] if len(sys.argv) > 4 else "llama3"
        if sys.argv[1] == "resume":
            resume(sys.argv[2], sys.argv[3], model, sys.argv[5], int(sys.argv[6]))
        else:
            {"save": save, "load": load}[sys.argv[1]](sys.argv[2], sys.argv[3], model)
    finally:
        dist.destroy_process_group()
    # all is saved and the process group destroyed: leave without the interpreter's
    # teardown, where torch's gloo threads now and then abort the process ("terminate
    # called without an active exception"; seen with DeepSpeed's engine alone too)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
