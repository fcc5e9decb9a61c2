"""A real Megatron-Core ``DistributedOptimizer`` on CPU: gloo ranks train a
tiny LLaMA-like ``GPTModel`` (local layer spec, bf16) one step and save a
``torch_dist`` checkpoint with megatron-core's own ``sharded_state_dict``
and ``dist_checkpointing.save``, in the distributed optimizer's format
of choice (``dp_reshardable``, what Megatron-LM saves by default, or
``fully_reshardable``).

megatron-core 0.16.1 assumes CUDA in a few places that do not change what
it computes or writes: its gradient buffers and optimizers allocate on
``torch.cuda.current_device()`` or ``device="cuda"``, check
``param.type()`` for ``torch.cuda.*``, and its writer calls
``torch.cuda.synchronize``. :class:`_CpuAsCuda` and two stubs send those to
the CPU. The gradients are made up (deterministic per parameter and
tensor-parallel rank, the same on every data-parallel rank): the forward
pass needs CUDA's RNG tracker.
"""

from __future__ import annotations

import argparse
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN, SEQ = 2, 64, 4, 2, 300, 96, 32
PRESET = (f"llama:layers={LAYERS},hidden={HIDDEN},heads={HEADS},kv_heads={KV_HEADS},"
          f"vocab={VOCAB},ffn={FFN},tied=0,norms=local")
ITERATION = 5


class _CpuAsCuda(TorchFunctionMode):
    """``device="cuda"`` is the CPU, ``Tensor.type()`` says ``torch.cuda.*``
    and ``.cuda()`` stays where it is."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def cpu_stubs() -> None:
    """In a rank process: ``torch.cuda.current_device()`` is the CPU and
    ``torch.cuda.synchronize`` does nothing (the module docstring)."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def train_and_save(rank: int, world: int, root: str, tp: int, sharding: str,
                   bucket: int | None, experts: int = 0, ep: int = 1, pp: int = 1,
                   vpp: int = 1, fp32_norms: bool = False) -> None:
    """One optimizer step of the model (with ``experts`` experts per layer
    over ``ep`` expert-parallel ranks: megatron-core chains a dense and an
    expert optimizer where ``ep > 1``; with ``fp32_norms`` its norms' weights
    in fp32: megatron-core's DDP gives each model chunk a gradient buffer
    per parameter dtype) on ``world`` ranks (tensor parallel ``tp``, ``pp``
    stages of ``vpp`` virtual stages each, with a layer per chunk where there
    are more chunks than layers; data parallel the rest) with buckets of
    ``bucket`` elements (None: one bucket), saved under ``root`` as
    Megatron-LM lays out a checkpoint."""
    cpu_stubs()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep)
    try:
        with _CpuAsCuda():
            _train_and_save(Path(root), tp, sharding, bucket, experts, ep, pp, vpp,
                            fp32_norms)
        torch.distributed.barrier()
    finally:
        parallel_state.destroy_model_parallel()


def _model(tp: int, experts: int = 0, ep: int = 1, pp: int = 1, vpp: int = 1,
           v: int = 0, fp32_norms: bool = False) -> Any:
    """Chunk ``v`` (virtual stage) of this rank's stage of the bf16 GPTModel
    (local spec, LLaMA-like, ``experts`` experts per layer, top 2) of this
    module's sizes (``max(LAYERS, pp * vpp)`` layers) at ``tp`` and ``pp``;
    with ``fp32_norms`` its norms are turned back to fp32 after the bf16
    conversion, before DDP wraps it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(7 + 100 * ps.get_pipeline_model_parallel_rank() + v)
    cfg = TransformerConfig(
        num_layers=max(LAYERS, pp * vpp), hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, add_bias_linear=False, activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=tp, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, num_moe_experts=experts or None, moe_router_topk=2,
        expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    spec = get_gpt_layer_local_spec(num_experts=experts or None, normalization="RMSNorm")
    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v if vpp > 1 else None)
    last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v if vpp > 1 else None)
    model = GPTModel(cfg, spec, vocab_size=padded, max_sequence_length=SEQ,
                     pre_process=first, post_process=last, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     vp_stage=v if vpp > 1 else None).bfloat16()
    for name, m in model.named_modules():
        if fp32_norms and name.endswith("layernorm"):  # its weight back to fp32
            m.float()
    return model


def _scheduler(opt: Any, lr: float, wd: float, style: str, **kw: Any) -> Any:
    """Megatron-LM's learning-rate and weight-decay schedule over ``opt``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        opt, init_lr=lr, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=0, lr_decay_steps=800,
        lr_decay_style=style, start_wd=wd, end_wd=wd, wd_incr_steps=800,
        wd_incr_style="constant", **kw)


def _train_and_save(root: Path, tp: int, sharding: str, bucket: int | None,
                    experts: int, ep: int, pp: int, vpp: int, fp32_norms: bool) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = [_model(tp, experts, ep, pp, vpp, v, fp32_norms) for v in range(vpp)]
    # Megatron-LM buckets the first chunk only
    ddps = [DistributedDataParallel(m.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket is not None, bucket_size=bucket), m,
        disable_bucketing=v > 0) for v, m in enumerate(chunks)]
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=True, clip_grad=1e9), ddps)
    sched = _scheduler(opt, 1e-2, 0.1, "constant")
    opt.zero_grad()
    t, p_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    for v, ddp in enumerate(ddps):
        ddp.zero_grad_buffer()
        for name, p in ddp.module.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{p_rank}/{v}/{name}/{t}".encode()))
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * 0.01)
        if bucket is not None:
            ddp.start_grad_sync()
        ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("the optimizer step was skipped")
    sched.step(increment=8)  # samples of the step's global batch
    md = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
          "chained_optim_avoid_prefix": True}
    if sharding == "fully_reshardable":
        md["distrib_optim_fully_reshardable_mem_efficient"] = False
    sd: dict[str, Any] = {
        "args": argparse.Namespace(num_layers=max(LAYERS, pp * vpp), hidden_size=HIDDEN,
                                   num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                                   vocab_size=VOCAB, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                   transformer_impl="local",
                                   use_distributed_optimizer=True,
                                   num_experts=experts or None, moe_router_topk=2,
                                   expert_model_parallel_size=ep, world_size=4,
                                   consumed_train_samples=8 * ITERATION,
                                   tokenizer_type="NullTokenizer", max_position_embeddings=SEQ,
                                   seed=1234),
        "checkpoint_version": 3.0, "iteration": ITERATION,
        "opt_param_scheduler": sched.state_dict()}
    if vpp == 1:
        sd["model"] = ddps[0].module.sharded_state_dict(metadata=md)
    for v, ddp in enumerate(ddps if vpp > 1 else []):  # Megatron-LM's keys of chunks
        sd[f"model{v}"] = ddp.module.sharded_state_dict(metadata=md)
    sd["optimizer"] = opt.sharded_state_dict(
        sd, metadata={**md, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    it = root / f"iter_{ITERATION:07d}"
    if torch.distributed.get_rank() == 0:
        it.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, str(it), TorchDistSaveShardedStrategy("torch_dist", 1),
                            content_metadata=md)
    if torch.distributed.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def load_and_dump(rank: int, world: int, ckpt: str, out: str, tp: int | None = None,
                  distributed: bool = False, experts: int = 0, ep: int = 1) -> None:
    """A job of ``world`` ranks (tensor parallel ``tp``, all of them by
    default; data parallel the rest; ``experts`` over ``ep`` ranks) loads the
    torch_dist checkpoint ``ckpt`` as Megatron-LM's ``load_checkpoint`` does
    (the checkpoint's content metadata, the model's and the optimizer's
    sharded state dicts, ``dist_checkpointing.load``, both
    ``load_state_dict``) with megatron-core's non-distributed mixed-precision
    optimizer or its ``DistributedOptimizer`` and writes to ``out/<rank>.pt``
    the group settings, the schedule, Adam's steps and each parameter's
    weight, fp32 master and moments (experts by their global index),
    flattened, from the element the rank holds them from (0 for the
    non-distributed optimizer: all)."""
    cpu_stubs()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tp or world, 1, expert_model_parallel_size=ep)
    try:
        with _CpuAsCuda():
            _load_and_dump(Path(ckpt), tp or world, distributed, experts, ep,
                           Path(out) / f"{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


def _load_and_dump(ckpt: Path, tp: int, distributed: bool, experts: int, ep: int,
                   out: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _model(tp, experts, ep)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, min_lr=0.0, weight_decay=0.0, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=distributed), [ddp])
    # the schedule of the loading job; Megatron-LM's --use-checkpoint-opt_param-scheduler
    sched = _scheduler(opt, 1.0, 0.0, "linear", use_checkpoint_opt_param_scheduler=True)
    it = ckpt / f"iter_{ITERATION:07d}"
    common = dist_checkpointing.load_common_state_dict(str(it))
    md = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if distributed and md is None:  # Megatron-LM's reading of a checkpoint without one
        fully = getattr(common.get("args"), "ckpt_fully_parallel_save", False)
        md = {"distrib_optim_sharding_type": "fully_sharded_model_space" if fully
              else "dp_zero_gather_scatter"}
    md = {**(md or {}), "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if distributed:
        _first_state(opt)
    sd: dict[str, Any] = {"model": ddp.module.sharded_state_dict(metadata=md)}
    sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=True, metadata=md)
    loaded = dist_checkpointing.load(sd, str(it))
    ddp.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["opt_param_scheduler"])
    torch.save(dump_state(ddp, opt, sched, distributed, experts, ep), out)


def dump_state(ddp: Any, opt: Any, sched: Any, distributed: bool, experts: int = 0,
               ep: int = 1) -> dict[str, Any]:
    """What :func:`load_and_dump` writes of a loaded job (its model
    ``ddp``, optimizer ``opt`` and schedule ``sched``): the group settings,
    the schedule, Adam's steps and each parameter's ``(start, [weight,
    master, exp_avg, exp_avg_sq])`` from the element the rank holds."""
    from megatron.core import parallel_state as ps

    chain = getattr(opt, "chained_optimizers", [opt])
    dump: dict[str, Any] = {
        "groups": [{k: v for k, v in g.items() if k != "params"}
                   for inner in chain for g in inner.optimizer.param_groups],
        "scheduler": sched.state_dict(),
        "steps": sorted({float(st["step"]) for inner in chain
                         for st in inner.optimizer.state.values()})}
    first = ps.get_expert_model_parallel_rank() * (experts // ep)  # the rank's first expert
    for local, p in ddp.module.named_parameters():
        name = re.sub(r"local_experts\.(\d+)\.",
                      lambda m: f"local_experts.{first + int(m.group(1))}.", local)
        dump[name] = None
        for inner in chain:
            got = _held_state(inner, p) if distributed else _whole_state(inner, p)
            dump[name] = dump[name] or got
    return dump


def _first_state(opt: Any) -> None:
    """A DistributedOptimizer over PyTorch's Adam made to load as over TE's
    FusedAdam. megatron-core 0.16.1 takes Adam's step from the parameters'
    state with PyTorch's Adam (no TE or Apex: the CPU), from the groups
    with FusedAdam (GPUs), and with PyTorch's Adam it cannot load: building
    the loading state dict fails while there is no state (before the first
    step), and the model-space load copies every state key but the step
    (``KeyError: 'step'``), its own checkpoints as ours. Here the state
    before the first step is made (loading overwrites all of it, the step
    from the checkpoint's groups) and the copy skips the step."""
    for inner in getattr(opt, "chained_optimizers", [opt]):
        inner.init_state_fn(inner.optimizer, inner.config)
        for st in inner.optimizer.state.values():
            st["step"] = torch.tensor(0.0)

        def put(model_param: Any, tensors: dict[str, torch.Tensor], inner: Any = inner) -> None:
            group, order = inner.model_param_group_index_map[model_param]
            main = inner.optimizer.param_groups[group]["params"][order]
            for k, dst in {"param": main, **inner.optimizer.state[main]}.items():
                if k != "step":
                    dst.copy_(tensors[k])

        inner._set_main_param_and_optimizer_states = put


def _whole_state(inner: Any, p: torch.Tensor) -> tuple[int, list[torch.Tensor]] | None:
    """A parameter's weight, fp32 master and moments in the non-distributed
    optimizer (None: another optimizer of the chain has it)."""
    m = next((m for ps, ms in zip(inner.float16_groups, inner.fp32_from_float16_groups)
              for q, m in zip(ps, ms) if q is p), None)
    if m is None:
        return None
    st = inner.optimizer.state[m]
    return 0, [t.detach().flatten().clone() for t in (p, m, st["exp_avg"], st["exp_avg_sq"])]


def _held_state(inner: Any, p: torch.Tensor) -> tuple[int, list[torch.Tensor]] | None:
    """The stretch of a parameter's weight, fp32 master and moments this data
    parallel rank's DistributedOptimizer holds (None: none of it)."""
    if p not in inner.model_param_gbuf_map:
        return None
    r = inner._get_model_param_range_map(p)["param"]
    if r.size == 0:
        return None
    st = inner._get_main_param_and_optimizer_states(p)
    return r.start, [p.detach().flatten()[r.start:r.end].clone(),
                     *(st[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq"))]
