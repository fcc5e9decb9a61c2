"""The mesh chooser against published LLaMA-family runs with FSDP, tensor,
pipeline and context parallelism: each published mesh must fit in the
estimate (with the run's recompute mode and micro-batches), its estimated
memory must not be above what the run measured, and it must be on the front
``ptcctl suggest`` shows (no mesh beats it in step time, memory and bytes sent
between hosts at once: :func:`~ptcfs.suggest.search.dominates`) or within 10%
of the fastest estimate that fits. Meshes their publisher measured more than
10% slower than another mesh of the same model on the same hosts are held
to that measurement instead (:data:`MEASURED_BEHIND`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from ptcfs.model.presets import parse_model
from ptcfs.suggest import Device, Query, suggest
from ptcfs.suggest.memory import StateClasses, activation_bytes, dims_of
from ptcfs.suggest.search import MEMORY_RESERVE, dominates, estimate, micro_size
from ptcfs.types import Host, ModelSpec, ParallelConfig

# LLaMA 3.1 shapes (Dubey et al., "The Llama 3 Herd of Models", 2024, Table 3).
L8 = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,vocab=128256,ffn=14336"
L70 = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,vocab=128256,ffn=28672"
L405 = "llama:layers=126,hidden=16384,heads=128,kv_heads=8,vocab=128256,ffn=53248"

#: torchtitan's benchmark hosts (Grand Teton): 8 H100 with 96 GB HBM2e (2.4 TB/s),
#: NVLink, 400 Gb/s RDMA per GPU, at a 500 W power limit
#: (benchmarks/llama3_h100_202412_torchtitan.md). Attention at 0.24 of the peak:
#: between what its 8B at 32K (0.225) and at 64K with cp=2 (0.25) take, Table 2.
GRAND_TETON = Device("h100-96gb", 96 * 10**9, 989e12, 450e9, 400e9 / 8, hbm=2.4e12,
                     attn_util=0.24)
#: Llama 3's hosts: 8 H100 80 GB HBM3, NVLink, 400 Gb/s RoCE per GPU (§3.3.1).
H100_80 = Device("h100-80gb", 80 * 10**9, 989e12, 450e9, 400e9 / 8)


@dataclass(frozen=True)
class Run:
    """One published run: the mesh, the batch, what it measured."""

    label: str
    model: str
    gpus: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    seq: int
    batch: int        # sequences per step
    micro: int        # sequences per micro-batch
    recompute: str
    device: Device
    vpp: int = 1      # 0: interleaved, V not stated: the V the layers allow rated best
    cp_shard: int = 0  # 1: FSDP over fsdp x cp, as the framework shards (torchtitan)
    memory_gib: float | None = None   # peak memory the run measured
    float8: bool = False   # linear layers in Float8 (torchao), as the table states
    async_tp: bool = False  # async tensor parallelism, as the table states
    tps: float | None = None  # tokens per second per GPU the run measured
    fsdp_pipeline: str = "step"  # FSDP under a pipeline: torchtitan's, or Llama 3's "micro"
    async_p2p: bool = False  # the pipeline's sends posted asynchronously
    pp_microbatches: str = "size"  # "stages": torchtitan's micro-batches, one per stage
    eager: bool = False  # without torch.compile, as the table states
    dp: int = 1       # data-parallel replicas (Megatron-Core's data parallelism)
    zero: int = 0     # 1: the optimizer state sharded over them (its distributed optimizer)
    runtime: str = "torch"  # "megatron": Megatron-Core with Transformer Engine
    grad_dtype: str = ""    # "bf16": gradients kept in bf16, as the recipe says


# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (end of 2024):
# Tables 1-6 as published. Sequence 8192 (the configs' default) unless the table
# gives one; "local batch" is per data-parallel rank, all in one micro-batch
# without a pipeline; with one, torchtitan's default of as many micro-batches as
# stages. Full or selective activation checkpointing as each table says:
# torchtitan's selective is per-op ("op": every other matmul recomputed).
# torchtitan applies FSDP on its dp_shard_cp mesh: with context parallelism
# the state is sharded over fsdp x cp (cp_shard=1), and the search keeps to
# that layout; the search also batches as torchtitan did (pp_microbatches="stages":
# as many micro-batches as stages, none accumulated without a pipeline).
_TORCHTITAN_TABLES = [
    Run("t1-8b-fsdp8", L8, 8, 8, 1, 1, 1, 8192, 16, 2, "op", GRAND_TETON,
        memory_gib=82.4, tps=5762, eager=True),
    Run("t2-8b-fsdp8-32k", L8, 8, 8, 1, 1, 1, 32768, 8, 1, "full", GRAND_TETON,
        memory_gib=83.9, float8=True, tps=3890),
    Run("t2-8b-fsdp4-cp2-64k", L8, 8, 4, 1, 1, 2, 65536, 4, 1, "full", GRAND_TETON,
        memory_gib=84.2, float8=True, tps=2540),
    Run("t2-8b-fsdp2-cp4-128k", L8, 8, 2, 1, 1, 4, 131072, 2, 1, "full", GRAND_TETON,
        memory_gib=84.0, float8=True, tps=1071),
    Run("t2-8b-cp8-256k", L8, 8, 1, 1, 1, 8, 262144, 1, 1, "full", GRAND_TETON,
        memory_gib=84.5, float8=True, tps=548),
    Run("t3-8b-fsdp128", L8, 128, 128, 1, 1, 1, 8192, 256, 2, "op", GRAND_TETON,
        memory_gib=67.0, tps=5605, eager=True),
    Run("t4-70b-fsdp32-tp8", L70, 256, 32, 8, 1, 1, 8192, 512, 16, "full", GRAND_TETON,
        memory_gib=71.9, float8=True, tps=829),
    Run("t4-70b-fsdp32-tp8-async", L70, 256, 32, 8, 1, 1, 8192, 512, 16, "full", GRAND_TETON,
        memory_gib=67.6, float8=True, async_tp=True, tps=876),
    Run("t5-405b-1f1b", L405, 512, 8, 8, 8, 1, 8192, 256, 4, "full", GRAND_TETON,
        memory_gib=82.5, float8=True, async_tp=True, tps=100),
    Run("t5-405b-interleaved", L405, 512, 8, 8, 8, 1, 8192, 256, 4, "full", GRAND_TETON,
        vpp=2, memory_gib=72.7, float8=True, async_tp=True, tps=128),
    Run("t6-405b-fsdp8-32k", L405, 512, 8, 8, 8, 1, 32768, 64, 1, "full", GRAND_TETON,
        memory_gib=75.3, float8=True, async_tp=True, tps=76),
    Run("t6-405b-fsdp1-cp8-256k", L405, 512, 1, 8, 8, 8, 262144, 8, 1, "full", GRAND_TETON,
        memory_gib=84.9, float8=True, async_tp=True, tps=16),
]
TORCHTITAN = [replace(r, cp_shard=1, pp_microbatches="stages") for r in _TORCHTITAN_TABLES]

# Dubey et al., "The Llama 3 Herd of Models" (2024), Table 4: the 405B
# pre-training meshes (data parallelism is FSDP there), 16M tokens per step,
# micro-batch 1. The paper states no recompute mode; selective is assumed.
# §3.3.2: an interleaved schedule "with V pipeline stages on one pipeline
# rank", V not stated (vpp=0 here). The paper does not say that FSDP shards
# over the context-parallel ranks, so these rows keep cp replicas (cp_shard=0).
_LLAMA3_TABLE_4 = [
    Run("l3-8k-8192gpus", L405, 8192, 64, 8, 16, 1, 8192, 2048, 1, "selective", H100_80,
        vpp=0),
    Run("l3-8k-16384gpus", L405, 16384, 128, 8, 16, 1, 8192, 2048, 1, "selective", H100_80,
        vpp=0),
    Run("l3-128k-cp16", L405, 16384, 8, 8, 16, 16, 131072, 128, 1, "selective", H100_80,
        vpp=0),
]
#: §3.3.1: FSDP "shards optimizer states and gradients, but for model shards we
#: do not reshard after forward computation": each micro-batch's parameters stay
#: gathered until its backward, its gradients are reduce-scattered.
#: §3.3.2: "we adopt asynchronous point-to-point communication in PP".
LLAMA3_TABLE_4 = [replace(r, fsdp_pipeline="micro", async_p2p=True) for r in _LLAMA3_TABLE_4]

# torchtitan's first 405B runs, docs/performance.md at 3faaa1a (August 2024)
# with train_configs/llama3_405b.toml: the same Grand Teton hosts ("HBM2e based
# lower TDP SXM H100"), 128 GPUs as FSDP 16 x TP 8 without a pipeline, local
# batch 2 of 8192 tokens, full activation checkpointing, torch.compile; in
# bf16, then with Float8 (its FSDP all-gathers in Float8 too, which the model
# prices as bf16: they hide behind compute either way), then with async TP.
# No memory was published.
_TORCHTITAN_2D_405B = [
    Run("tt-405b-fsdp16-tp8", L405, 128, 16, 8, 1, 1, 8192, 32, 2, "full", GRAND_TETON,
        tps=109),
    Run("tt-405b-fsdp16-tp8-float8", L405, 128, 16, 8, 1, 1, 8192, 32, 2, "full",
        GRAND_TETON, float8=True, tps=177),
    Run("tt-405b-fsdp16-tp8-float8-async", L405, 128, 16, 8, 1, 1, 8192, 32, 2, "full",
        GRAND_TETON, float8=True, async_tp=True, tps=185),
]
TORCHTITAN_2D_405B = [replace(r, cp_shard=1, pp_microbatches="stages")
                      for r in _TORCHTITAN_2D_405B]

# NVIDIA's tuned Megatron-Core recipes on DGX H100 (80 GB), NeMo 25.11
# (Megatron-Bridge docs/performance-summary.md; the meshes are its
# scripts/performance/configs/llama presets): FP8 with current scaling,
# 8K sequences, micro-batch 1, data parallelism with the distributed optimizer,
# no recompute (the presets set none), interleaved as the VP column says,
# tensor parallelism's communication overlapped (the recipes' tp_comm_overlap),
# gradients in bf16 (their grad_reduce_in_fp32 off), Transformer Engine's
# layers and Megatron-Core's pipeline (runtime="megatron").
# Held out: nothing in the model was fitted to them.
NEMO_H100 = [
    Run("n-8b-fsdp8", L8, 8, 8, 1, 1, 1, 8192, 128, 1, "none", H100_80, float8=True,
        tps=14451, runtime="megatron", grad_dtype="bf16"),  # Megatron-FSDP over 8
    Run("n-70b-tp4-pp8-vp5", L70, 64, 1, 4, 8, 1, 8192, 128, 1, "none", H100_80, vpp=5,
        float8=True, async_tp=True, tps=1602, dp=2, zero=1, runtime="megatron",
        grad_dtype="bf16"),
    Run("n-405b-tp8-pp8-cp2-vp8", L405, 1024, 1, 8, 8, 2, 8192, 512, 1, "none", H100_80,
        vpp=8, float8=True, async_tp=True, tps=292, dp=8, zero=1, runtime="megatron",
        grad_dtype="bf16"),
]

#: Published meshes that their publisher measured slower than another mesh
#: of the same model on the same hosts, by more than 10%: they cannot be on
#: the front or within 10% of the best in any estimate that holds both
#: measurements, so the test asserts what the measurements say instead
#: (:func:`test_meshes_measured_behind_another_are_rated_behind_it`). Each names
#: the faster mesh (a label, or a vpp for the same mesh interleaved) and the
#: measured ratio of tokens per second per GPU. torchtitan's 3D runs compare
#: schedules on one mesh, not meshes: its 2D run of the same 405B on the same
#: hosts took 185 TPS/GPU against their 100 (1F1B) and 128 (interleaved);
#: its 4D table at 32K runs 1F1B on the mesh whose interleaving measured 1.28x
#: faster at 8K (same pipeline, same 8 micro-batches, so the same bubble share).
MEASURED_BEHIND: dict[str, tuple[str | int, float]] = {
    "t5-405b-1f1b": ("tt-405b-fsdp16-tp8-float8-async", 185 / 100),
    "t5-405b-interleaved": ("tt-405b-fsdp16-tp8-float8-async", 185 / 128),
    "t6-405b-fsdp8-32k": (2, 128 / 100),
}


def _query(run: Run) -> tuple[Query, ParallelConfig]:
    model = parse_model(run.model, dtype="bf16", optimizer="adam")
    hosts = tuple(Host(f"h{i}", 8) for i in range(run.gpus // 8))
    q = Query(model, hosts, run.batch, run.seq, run.device, micro=run.micro,
              recompute=run.recompute, cp_shard=run.cp_shard, float8=run.float8,
              async_tp=run.async_tp, fsdp_pipeline=run.fsdp_pipeline,
              async_p2p=run.async_p2p, pp_microbatches=run.pp_microbatches, eager=run.eager,
              runtime=run.runtime, grad_dtype=run.grad_dtype)
    cfg = ParallelConfig(run.tp, run.pp, run.dp, hosts, run.fsdp, run.cp, zero=run.zero,
                         vpp=max(1, run.vpp), cp_shard=run.cp_shard if run.cp > 1 else 0)
    if run.vpp == 0:
        classes = StateClasses(q.model)
        cfg = min((replace(cfg, vpp=v) for v in range(1, q.model.layers // run.pp + 1)),
                  key=lambda c: estimate(q, c, classes).step)
    return q, cfg


ALL_ROWS = TORCHTITAN + TORCHTITAN_2D_405B + LLAMA3_TABLE_4 + NEMO_H100
ROWS = {r.label: r for r in ALL_ROWS}


@pytest.mark.parametrize("run", ALL_ROWS, ids=lambda r: r.label)
def test_the_published_mesh_fits(run: Run) -> None:
    q, cfg = _query(run)
    e = estimate(q, cfg, StateClasses(q.model))
    limit = q.device.memory * (1 - MEMORY_RESERVE)
    assert micro_size(q, cfg.data_parallel, cfg.pp) == run.micro  # the run's batching
    assert e.fits, f"{e.memory / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB: {e.memory_terms}"
    if run.memory_gib is not None:  # never above what the run measured (+5%)
        assert e.memory / 2**30 <= 1.05 * run.memory_gib, e.memory / 2**30


def _front_and_best(run: Run) -> tuple[bool, float]:
    """Whether a mesh ``ptcctl suggest`` shows beats the run's in step time,
    memory and inter-host bytes at once, and the run's step over the best."""
    q, cfg = _query(run)
    s = suggest(q)
    e = estimate(q, cfg, StateClasses(q.model))
    assert s.best is not None
    return any(dominates(o, e) for o in s.estimates), e.step / s.best.step


@pytest.mark.parametrize("run", [r for r in ALL_ROWS if r.label not in MEASURED_BEHIND],
                         ids=lambda r: r.label)
def test_the_published_mesh_is_on_the_front_or_near_the_best(run: Run) -> None:
    dominated, behind = _front_and_best(run)
    assert not dominated or behind <= 1.10, f"{behind:.2f}x the best estimate's step"


def _tokens_per_gpu_s(run: Run) -> float:
    return run.batch * run.seq / run.gpus / _step(run)


@pytest.mark.parametrize("label", sorted(MEASURED_BEHIND))
def test_meshes_measured_behind_another_are_rated_behind_it(label: str) -> None:
    """The model rates the faster mesh ahead by the ratio its publisher
    measured (within 10%), and so puts the slower one more than 10% behind
    the fastest estimate, as the measurements do."""
    run = ROWS[label]
    faster, measured = MEASURED_BEHIND[label]
    other = ROWS[faster] if isinstance(faster, str) else replace(run, vpp=faster)
    assert _tokens_per_gpu_s(other) / _tokens_per_gpu_s(run) == \
        pytest.approx(measured, rel=0.10)
    _, behind = _front_and_best(run)
    assert behind > 1.10, behind


def test_megatron_core_runs_keep_what_their_runtime_keeps() -> None:
    """NVIDIA's 405B recipe priced as Megatron-Core runs it (no standing
    receive buffers, Transformer Engine's FP8 inputs, bf16 gradients) fits;
    priced as a torchtitan run (receive buffers kept, 16-bit inputs, fp32
    gradients) it would not."""
    q, cfg = _query(ROWS["n-405b-tp8-pp8-cp2-vp8"])
    classes = StateClasses(q.model)
    megatron = estimate(q, cfg, classes)
    torch_like = estimate(replace(q, runtime="torch", grad_dtype=""), cfg, classes)
    assert "activations_recv_buffers" not in megatron.memory_terms
    assert torch_like.memory_terms["activations_recv_buffers"] > 0
    assert 2 * megatron.memory_terms["gradients"] == torch_like.memory_terms["gradients"]
    assert megatron.memory_terms["activations_layers"] < \
        torch_like.memory_terms["activations_layers"]
    assert megatron.fits and not torch_like.fits


def _llama2_7b() -> ModelSpec:
    return parse_model("llama:layers=32,hidden=4096,heads=32,kv_heads=32,vocab=32000,"
                       "ffn=11008", dtype="bf16", optimizer="adam")


def test_activations_are_per_micro_batch_in_flight() -> None:
    """LLaMA-2-7B on 8 GPUs, 512 sequences of 1K, micro-batch 1, tp=1, dp=8:
    64 micro-batches run one after another, so one micro-batch's activations
    are live, not 64 (which was estimated at 1.4 TB per GPU)."""
    model = _llama2_7b()
    hosts = (Host("h0", 8),)
    dims = dims_of(model, 1024)
    assert dims is not None
    one = ParallelConfig(1, 1, 8, hosts)
    acts = activation_bytes(dims, one, 1, 64, "none")
    single = activation_bytes(dims, one, 1, 1, "none")
    assert acts == single
    q = Query(model, hosts, 512, 1024, GRAND_TETON)
    e = estimate(q, one, StateClasses(model))
    assert e.memory < 200e9, e.memory_terms
    # with a pipeline, the first stage holds pp micro-batches
    pipe = ParallelConfig(1, 4, 2, hosts)
    first, last = activation_bytes(dims, pipe, 1, 64, "none")[0::3]
    assert first["layers"] == 4 * last["layers"]
    # and at 32K tokens a tensor-parallel mesh fits (published runs trained there)
    long = suggest(replace(q, batch=16, seq=32768, recompute="full"))
    assert long.best is not None and long.best.fits


def test_grouped_query_attention_moves_less_in_the_ring() -> None:
    """Context parallelism passes keys and values: with 8 of 64 heads
    carrying them, the ring moves an eighth of the bytes."""
    hosts = tuple(Host(f"h{i}", 8) for i in range(2))
    gqa = parse_model(L70, dtype="bf16", optimizer="adam")
    mha = parse_model(L70.replace("kv_heads=8", "kv_heads=64"), dtype="bf16",
                      optimizer="adam")
    slow = Device("slow-links", 80 * 10**9, 989e12, 10e9, 10e9)
    cfg = ParallelConfig(1, 1, 1, hosts, 1, 16)
    times = [estimate(Query(m, hosts, 1, 65536, slow, recompute="full"), cfg,
                      StateClasses(m)).step_terms["cp_comm"] for m in (gqa, mha)]
    assert 0 < times[0] < times[1] / 4


def test_context_parallelism_costs_most_at_short_sequences() -> None:
    """The cost of a ring over a step's compute falls as sequences grow."""
    model = parse_model(L8, dtype="bf16", optimizer="adam")
    hosts = (Host("h0", 8),)
    share = []
    for seq in (2048, 8192, 65536):
        q = Query(model, hosts, 1, seq, GRAND_TETON, recompute="full")
        cp = estimate(q, ParallelConfig(1, 1, 1, hosts, 1, 8), StateClasses(model))
        share.append(cp.step_terms["cp_comm"] / cp.step_terms["compute"])
    assert share[0] > share[1] > share[2]


def test_virtual_stages_shrink_the_bubble() -> None:
    model = parse_model(L70, dtype="bf16", optimizer="adam")
    hosts = tuple(Host(f"h{i}", 8) for i in range(4))
    q = Query(model, hosts, 64, 4096, GRAND_TETON, recompute="full")
    one, two = (estimate(q, ParallelConfig(8, 4, 1, hosts, vpp=v), StateClasses(model))
                for v in (1, 2))
    assert two.step_terms["bubble"] == pytest.approx(one.step_terms["bubble"] / 2)
    assert two.step < one.step


def test_groups_across_pods_get_the_oversubscribed_network() -> None:
    """Llama 3's fabric: full bisection within 3,072 GPUs, 1:7 above. FSDP
    over 64 hosts stays in a pod; over 1,024 hosts it crosses pods, and the
    same state per GPU then takes longer to gather."""
    from ptcfs.suggest.steptime import group_bandwidth

    def cfg(hosts: int, fsdp: int) -> ParallelConfig:
        hs = tuple(Host(f"h{i}", 8) for i in range(hosts))
        return ParallelConfig(8, hosts * 8 // (8 * fsdp), 1, hs, fsdp)

    small, large = cfg(64, 64), cfg(1024, 1024)
    assert group_bandwidth(small, H100_80, 8, 64) == H100_80.inter_host
    assert group_bandwidth(large, H100_80, 8, 1024) == H100_80.inter_host / 7
    assert group_bandwidth(large, H100_80, 8, 128) == H100_80.inter_host  # 1,024 GPUs
    # blocks of 2,048 GPUs: the one from 2,048 to 4,096 straddles a pod's edge
    assert group_bandwidth(large, H100_80, 8, 256) == H100_80.inter_host / 7
    assert group_bandwidth(large, H100_80, 1, 8) == H100_80.intra_host
    model = parse_model(L70, dtype="bf16", optimizer="adam")
    times = []
    for c in (small, large):
        q = Query(model, c.hosts, c.fsdp * 4, 4096, H100_80, recompute="full")
        times.append(estimate(q, c, StateClasses(model)).step_terms["fsdp_exposed"])
    assert times[1] > times[0]


def _step(run: Run, **options: bool) -> float:
    q, cfg = _query(run)
    q = replace(q, **options)
    return estimate(q, cfg, StateClasses(q.model)).step


def _measured_step(run: Run) -> float:
    assert run.tps is not None
    return run.batch * run.seq / run.gpus / run.tps


def test_float8_and_async_tp_gain_what_torchtitan_measured() -> None:
    """Float8 on 8B with FSDP: 6,667 -> 8,532 TPS on 8 GPUs, 6,514 -> 8,380 on
    128 (Tables 1 and 3, both with compile); async TP on 70B at TP 8: 829 ->
    876 (Table 4)."""
    for label, gain in (("t1-8b-fsdp8", 8532 / 6667), ("t3-8b-fsdp128", 8380 / 6514)):
        run = ROWS[label]
        assert _step(run, eager=False) / _step(run, eager=False, float8=True) == \
            pytest.approx(gain, rel=0.03)
    run = ROWS["t4-70b-fsdp32-tp8"]
    assert _step(run, float8=True) / _step(run, float8=True, async_tp=True) == \
        pytest.approx(876 / 829, rel=0.01)


@pytest.mark.parametrize("label", ["t2-8b-fsdp8-32k", "t2-8b-fsdp4-cp2-64k",
                                   "t4-70b-fsdp32-tp8", "t4-70b-fsdp32-tp8-async",
                                   "t5-405b-1f1b", "t5-405b-interleaved", "t6-405b-fsdp8-32k",
                                   "tt-405b-fsdp16-tp8-float8",
                                   "tt-405b-fsdp16-tp8-float8-async"])
def test_runs_step_time_within_10_percent_of_measured(label: str) -> None:
    """With the run's Float8 and async TP priced, and attention counted as
    its kernels run it at the hosts' rate (0.24 of the peak, from the 8B at
    32K and 64K), the 8B at 32K and 64K and the 70B and 405B runs at 8K and
    32K tokens are within 10% of the step time torchtitan measured. Not
    held here: the 405B's 2D run in bf16 (estimated at 81% of its measured
    step: torchtitan measured Float8 1.62x faster on it, August 2024, where
    the model gives 1.35x, and 1.28x on the 8B, December 2024, which the
    model holds), the 8B at 8K (85-86% of the measured step, see below) and
    context parallelism of 4 and 8 at 128K and 256K tokens (77-80%, on both
    the 8B and the 405B). All four 8B rows of Table 2 hold 32K tokens per
    GPU: with their dense work priced as at 32K, the measured attention cost
    (before it was counted as its kernels run it) 1.8x the model's at cp 4
    and 8, 1.3x at cp 2 and 1.5x without (1.2x for the 405B at 32K), so what
    is left grows with the ring's degree, not the length. Each ring step's keys and values
    take 20-50x less time than its block's attention, so exposed transfers do
    not explain it, nor do the merges (torch's _SDPAMerger: some 40 bytes per
    output element and step, 5-10% of a block); the cost is not modelled."""
    run = ROWS[label]
    assert _step(run) / _measured_step(run) == pytest.approx(1.0, abs=0.10)


@pytest.mark.parametrize("label", ["t1-8b-fsdp8", "t3-8b-fsdp128", "t2-8b-fsdp8-32k",
                                   "t2-8b-fsdp4-cp2-64k"])
def test_small_model_step_time_counts_its_elementwise_work(label: str) -> None:
    """The 8B's norms, rotary embedding, residual adds and SwiGLU move as many
    bytes per FLOP as twice the 70B's (``h`` is half): at the GPU's memory
    bandwidth, and 3x that without torch.compile (Tables 1 and 3 ran
    eager), they brought the 8B at 8K-64K tokens from 63-80% of the
    measured step to 78-82% (85-105% with attention at the hosts' rate);
    what else makes a small model's step slow at 8K is not modelled
    (torchtitan states 33-39% MFU for it)."""
    run = ROWS[label]
    q, cfg = _query(run)
    e = estimate(q, cfg, StateClasses(q.model))
    assert e.step_terms["elementwise"] > 0
    assert 0.75 <= e.step / _measured_step(run) <= 1.10, e.step_terms


def test_fsdp_under_a_pipeline_keeps_the_stage_as_its_framework_does() -> None:
    """torch.distributed.pipelining (torchtitan) keeps a stage's parameters
    gathered and its gradients whole until the last backward: with both
    counted, torchtitan's pipeline runs are estimated at 75-105% of the
    memory they measured (two layers' gathered parameters gave 40-55%); it
    gathers and reduces once a step, Llama 3's FSDP once per micro-batch.
    Its interleaved run held 9.8 GiB less than 1F1B on the same mesh (72.7
    against 82.5): in its one round of micro-batches each chunk's gradients
    are reduced before the other chunk's backwards begin, and with as many
    micro-batches as stages both schedules hold every forward at once
    (tests/test_suggest_pipelining.py checks both on torch's own schedule)."""
    for label in ("t5-405b-1f1b", "t5-405b-interleaved", "t6-405b-fsdp8-32k",
                  "t6-405b-fsdp1-cp8-256k"):
        run = ROWS[label]
        q, cfg = _query(run)
        e = estimate(q, cfg, StateClasses(q.model))
        assert run.memory_gib is not None
        assert 0.75 <= e.memory / 2**30 / run.memory_gib <= 1.05, (label, e.memory_terms)
        assert e.memory_terms["fsdp_unsharded_grads"] > e.memory_terms["gradients"]
    classes = StateClasses(parse_model(L405, dtype="bf16", optimizer="adam"))
    one_f_one_b, interleaved = (estimate(*_query(ROWS[f"t5-405b-{s}"]), classes)
                                for s in ("1f1b", "interleaved"))
    gap = (one_f_one_b.memory - interleaved.memory) / 2**30
    assert gap == pytest.approx(82.5 - 72.7, rel=0.2), (one_f_one_b.memory_terms,
                                                        interleaved.memory_terms)
    q, cfg = _query(ROWS["t5-405b-1f1b"])
    step, micro = (estimate(replace(q, fsdp_pipeline=f), cfg, StateClasses(q.model))
                   for f in ("step", "micro"))
    assert "fsdp_unsharded_grads" not in micro.memory_terms
    assert step.step_terms["fsdp_exposed"] < micro.step_terms["fsdp_exposed"]


def test_asynchronous_sends_leave_the_fill_and_the_drain() -> None:
    """Llama 3 (§3.3.2) posts the pipeline's sends asynchronously: only the
    pp - 1 hops of the fill and of the drain stay on the critical path."""
    q, cfg = _query(ROWS["l3-8k-16384gpus"])
    sync, overlapped = (estimate(replace(q, async_p2p=a), cfg, StateClasses(q.model))
                        for a in (False, True))
    assert overlapped.step_terms["pp_p2p"] < sync.step_terms["pp_p2p"] / 5


def test_the_bytes_between_hosts_are_the_collectives_that_span_hosts() -> None:
    """One host sends nothing between hosts; FSDP over 64 hosts sends each
    gather and reduction's (n-1)/n share (two gathers and a reduction without
    a pipeline), ten times what torchtitan's pp=8 mesh of the 405B sends."""
    q, _ = _query(ROWS["t1-8b-fsdp8"])
    one_host = estimate(q, ParallelConfig(1, 1, 1, q.hosts, 8), StateClasses(q.model))
    assert one_host.inter_host == 0 and one_host.inter_host_terms == {}
    q, piped = _query(ROWS["t5-405b-1f1b"])
    flat = ParallelConfig(8, 1, 1, q.hosts, 64)
    p, f = (estimate(q, c, StateClasses(q.model)) for c in (piped, flat))
    whole = 64 * (2 * f.memory_terms["parameters"] + f.memory_terms["gradients"])
    assert f.inter_host_terms == {"fsdp": pytest.approx(63 / 64 * whole)}
    assert set(p.inter_host_terms) == {"fsdp", "pp"}
    assert f.inter_host > 10 * p.inter_host
